"""Where the model's arithmetic runs: native / oneDNN / torch, decided in one place, and
every linear layer on the one that was chosen (engine_svc/model/backends/backend.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from engine_svc.model.arch.layers import RMSNorm
from engine_svc.model.arch.rope import RotaryEmbedding
from engine_svc.model.backends import backend as model_backend
from engine_svc.model.backends.backend import KernelBuild, choose_matmuls, install_backend
from engine_svc.model.backends.native_layers import NativeLinear, NativeRMSNorm, NativeRotary
from engine_svc.model.backends.packed_linear import PackedLinear, packing_supported
from engine_svc.model.load.loader import load_model
from engine_svc.model.native import load_kernels
from engine_svc.model.native.cpu import parse_cpuinfo
from tests.model_factory import make_model_dir

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AVX2_ONLY = parse_cpuinfo("model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx f16c fma avx2 bmi2\n")
BF16_DOTS = parse_cpuinfo(
    "model name\t: AMD EPYC 9B14\nflags\t\t: avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16\n"
)
AMX = parse_cpuinfo(
    "model name\t: Intel Xeon 8481C\n"
    "flags\t\t: f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile\n"
)
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("backend") / "model", arch="llama")


@pytest.fixture(scope="module")
def kernels():
    loaded = load_kernels() if shutil.which("cc") else None
    if loaded is None:
        pytest.skip("native kernels unavailable on this machine")
    return loaded


def test_without_kernels_only_onednn_or_torch():
    onednn = "onednn" if packing_supported(CPU, torch.float32) else "torch"
    assert choose_matmuls(None, "auto", CPU, torch.float32) == onednn
    assert choose_matmuls(None, "torch", CPU, torch.float32) == "torch"  # the reference stays plain
    assert choose_matmuls(None, "auto", CUDA, torch.bfloat16) == "torch"
    assert choose_matmuls(None, "auto", CPU, torch.float16) == "torch"  # oneDNN packing is for fp32 / bf16


@needs_cc
def test_with_kernels_bf16_dot_products_decide_between_native_and_onednn(monkeypatch, kernels):
    monkeypatch.setattr(model_backend, "cpu_features", lambda: AVX2_ONLY)
    assert choose_matmuls(kernels, "auto", CPU, torch.float32) == "native"
    assert choose_matmuls(kernels, "auto", CPU, torch.bfloat16) == "native"
    monkeypatch.setattr(model_backend, "cpu_features", lambda: BF16_DOTS)
    assert choose_matmuls(kernels, "auto", CPU, torch.float32) == "native"  # float32: gemm.c either way
    # The build's own bfloat16 dot products (AVX512-BF16) give the reference's bits: native.
    onednn = packing_supported(CPU, torch.bfloat16)
    bf16 = "onednn" if onednn and not kernels.bf16_dot_products else "native"
    assert choose_matmuls(kernels, "auto", CPU, torch.bfloat16) == bf16
    monkeypatch.setattr(model_backend, "cpu_features", lambda: AMX)  # AMX tiles are oneDNN's alone
    assert choose_matmuls(kernels, "auto", CPU, torch.float32) == "native"
    assert choose_matmuls(kernels, "auto", CPU, torch.bfloat16) == ("onednn" if onednn else "native")


def _linears(model: nn.Module) -> set[type]:
    kinds = (nn.Linear, NativeLinear, PackedLinear)
    return {type(m) for m in model.modules() if isinstance(m, kinds)}


def test_torch_leaves_every_layer_as_it_loaded(model_dir):
    model, _ = load_model(str(model_dir), CPU, torch.float32)
    chosen = install_backend(model, None, wanted="torch", device=CPU, dtype=torch.float32, batch_size_hint=8)
    assert (chosen.kernels, chosen.matmuls, chosen.native_prefill) == (None, "torch", False)
    assert _linears(model) == {nn.Linear} and isinstance(model.rotary, RotaryEmbedding)
    assert chosen.describe() == "kernels: plain PyTorch; matmuls: torch; attention: PyTorch"


@needs_cc
@pytest.mark.parametrize("features", [AVX2_ONLY, BF16_DOTS, AMX], ids=["avx2", "bf16-dots", "amx"])
def test_every_linear_layer_runs_where_the_choice_says(monkeypatch, model_dir, kernels, features):
    """One implementation for every linear layer, never a mix; norms and RoPE native
    whenever the kernels are loaded."""
    monkeypatch.setattr(model_backend, "cpu_features", lambda: features)
    model, args = load_model(str(model_dir), CPU, torch.bfloat16)
    chosen = install_backend(model, kernels, wanted="auto", device=CPU, dtype=torch.bfloat16, batch_size_hint=8)
    expected = {"native": NativeLinear, "onednn": PackedLinear}[chosen.matmuls]
    assert chosen.matmuls == choose_matmuls(kernels, "auto", CPU, torch.bfloat16)
    assert _linears(model) == {expected}
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    assert any(isinstance(m, NativeRMSNorm) for m in model.modules()) and isinstance(model.rotary, NativeRotary)
    assert chosen.native_prefill == kernels.supports_prefill_attention(args.head_dim)
    assert chosen.describe().startswith(f"kernels: native {kernels.isa} build; matmuls: {chosen.matmuls}")
    assert chosen.own_kernels == (chosen.matmuls == "native")  # oneDNN may split a sum across threads


def test_no_kernel_build_where_none_is_wanted():
    assert KernelBuild.start("torch", CPU, torch.float32).result() is None
    assert KernelBuild.start("auto", CUDA, torch.float32).result() is None
    assert KernelBuild.start("auto", CPU, torch.float16).result() is None
