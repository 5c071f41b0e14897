"""Where the model's arithmetic runs, decided once at load, weights packed once.

    --kernels   device, dtype         kernels (C)   matmuls                     attention
    auto        CPU, float32          native        "native" (gemm.c)           native decode (+ prefill)
    auto        CPU, bfloat16         native        "native"; "onednn" on AMX,  native decode (+ prefill)
                                                    or where the CPU has bf16
                                                    dot products the build lacks
    auto        CPU, kernels missing  none          "onednn" where it packs     PyTorch
    torch       any                   none          "torch" (F.linear)          PyTorch
    auto        GPU                   none          "torch"                     PyTorch

The native GEMM computes bfloat16 in float32, or, in the AVX512-BF16 build, as bfloat16
dot products with the same bits (native/gemm_bf16.h); on one Zen 5 core, at 8 to 256
rows of SmolLM2-135M's shapes, that is within ~10% of oneDNN's bfloat16 matmul either
way (and fuses the MLP's SiLU-and-multiply), and exact to the rule. AMX tiles are
oneDNN's alone, so an AMX CPU's bfloat16 goes there, as does a CPU with bfloat16 dot
products whose loaded build has none (``TANDEM_KERNEL_ISA``, an old compiler). Native
prefill attention needs a head size of whole vectors. A packing that fails (either kind)
leaves ``F.linear`` in place: one run never mixes two matmul implementations.

    build = KernelBuild.start(kernels, device, dtype)   # compiles while the weights load
    backend = install_backend(model, build.result(), kernels=..., device=..., dtype=..., batch_size_hint=...)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from engine_svc.model.arch.llama import Transformer
from engine_svc.model.backends.decode_stack import build_decode_stack
from engine_svc.model.backends.native_layers import install_native_layers, install_native_linears
from engine_svc.model.backends.packed_linear import pack_linears, packing_supported
from engine_svc.model.backends.quantized_embeddings import install_quantized_embeddings
from engine_svc.model.backends.quantized_layers import (
    install_prequantized_linears,
    install_quantized_linears,
    quantize_activations,
)
from engine_svc.model.native import NativeKernels, cpu_features, load_kernels
from engine_svc.model.native.quant import QuantizedWeight

logger = logging.getLogger(__name__)

Matmuls = Literal["native", "onednn", "torch", "int8", "int4", "gguf", "gptq", "awq", "compressed-tensors"]
_QUANTIZED: dict[str, Matmuls] = {"int8": "int8", "int4": "int4"}  # --quantization: the layers' own GEMM
# Quantized checkpoints whose layers run as they come, on the quantized GEMM.
_PREQUANTIZED: dict[str, Matmuls] = {
    "gguf": "gguf", "gptq": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors"
}  # fmt: skip


def uses_native_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> bool:
    """The native CPU kernels are for ``--kernels auto`` on CPU in float32 or bfloat16 only:
    ``torch`` is the plain-PyTorch reference, and a GPU never loads them."""
    return kernels == "auto" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


class KernelBuild:
    """The native kernels, compiled (first use only) on a thread while the weights load."""

    def __init__(self, thread: threading.Thread | None) -> None:
        self._thread = thread

    @classmethod
    def start(cls, kernels: str, device: torch.device, dtype: torch.dtype) -> KernelBuild:
        if not uses_native_kernels(kernels, device, dtype):
            return cls(None)
        thread = threading.Thread(target=load_kernels, name="kernel-build", daemon=True)
        thread.start()
        return cls(thread)

    def result(self) -> NativeKernels | None:
        """The loaded kernels, or None where they are not wanted or cannot be had."""
        if self._thread is None:
            return None
        self._thread.join()
        return load_kernels()  # cached by the thread's call


@dataclass(frozen=True)
class ModelBackend:
    kernels: NativeKernels | None
    matmuls: Matmuls
    native_prefill: bool  # prefill attention on the kernels too (decode is, whenever kernels is set)
    # Every matmul on the native kernels (the quantized GEMM among them): none splits a sum
    # across threads, so the thread count changes no result.
    own_kernels: bool = False

    def describe(self) -> str:
        kernels = f"native {self.kernels.isa} build" if self.kernels else "plain PyTorch"
        if self.native_prefill:
            attention = "native (decode and prefill)"
        else:
            attention = "native decode" if self.kernels else "PyTorch"
        return f"kernels: {kernels}; matmuls: {self.matmuls}; attention: {attention}"


def choose_matmuls(kernels: NativeKernels | None, wanted: str, device: torch.device, dtype: torch.dtype) -> Matmuls:
    """Where the linear layers should run (the module docstring's table), before packing."""
    if kernels is not None:
        flags = cpu_features()
        hardware_bf16 = "amx_bf16" in flags.flags or (flags.native_bf16 and not kernels.bf16_dot_products)
        if dtype == torch.bfloat16 and hardware_bf16 and packing_supported(device, dtype):
            return "onednn"
        return "native"
    if wanted == "auto" and packing_supported(device, dtype):
        return "onednn"
    return "torch"


def install_backend(
    model: Transformer,
    kernels: NativeKernels | None,
    *,
    wanted: str,
    device: torch.device,
    dtype: torch.dtype,
    batch_size_hint: int,
    quantization: str | None = None,
    prequantized: dict[str, QuantizedWeight] | None = None,
    prequantized_source: str = "gguf",
    quantized_embeddings: dict[str, QuantizedWeight] | None = None,
    int8_activations: bool = False,
    rope_positions: int | None = None,
) -> ModelBackend:
    """Swap the model's layers for the chosen backend's, in place; the one place that
    packs weights. ``wanted`` is ``--kernels``; ``batch_size_hint`` the rows oneDNN's
    packed layout is chosen for; ``quantization`` (``--quantization``) keeps the linear
    layers' weights quantized on the native quantized GEMM, the LM head on the backend's;
    ``prequantized`` are quantized weights read as they are, for the layers they name, from
    ``prequantized_source`` (a GGUF file's blocks; a GPTQ, AWQ or compressed-tensors
    checkpoint's integers); ``quantized_embeddings`` a GGUF file's embedding and LM head
    blocks (quantized_embeddings.py), with the float head kept for wide steps where that pays;
    ``int8_activations`` (``--activation-quantization int8``) the quantized linear layers'
    inputs quantized to int8 (quantized_layers.py); ``rope_positions`` the positions the
    native rotary table holds (the served context; default the model's)."""
    if quantization is not None and kernels is None:
        raise ValueError(
            f"--quantization {quantization} runs on the native CPU kernels, which this engine does not have "
            "(they need --kernels auto, a CPU with AVX2 and a C compiler once); drop --quantization"
        )
    matmuls = choose_matmuls(kernels, wanted, device, dtype)
    if kernels is not None:
        install_native_layers(model, kernels, dtype, rope_positions)
    num_packed = 0
    if prequantized and kernels is not None:
        install_prequantized_linears(model, kernels, prequantized)
    if quantization is not None:
        assert kernels is not None
        install_quantized_linears(model, kernels, quantization)
    if matmuls == "native":
        assert kernels is not None
        num_packed = install_native_linears(model, kernels, dtype)
    elif matmuls == "onednn":
        num_packed = pack_linears(model, batch_size_hint)
    if int8_activations:
        quantize_activations(model, kernels)  # refused here where it cannot run, before the head is timed
    if quantized_embeddings and kernels is not None:
        install_quantized_embeddings(
            model, kernels, quantized_embeddings, dtype, batch_size_hint, int8_activations=int8_activations
        )
    if kernels is not None and device.type == "cpu":
        model.decode_stack = build_decode_stack(model, kernels)
    backend = ModelBackend(
        kernels=kernels,
        matmuls=_QUANTIZED.get(
            quantization or "",
            _PREQUANTIZED[prequantized_source] if prequantized else matmuls if num_packed else "torch",
        ),
        native_prefill=kernels is not None and kernels.supports_prefill_attention(model.args.head_dim),
        own_kernels=kernels is not None and matmuls == "native",
    )
    if device.type == "cpu":
        logger.info("%s", backend.describe())
        if kernels is not None and model.args.sliding_window is not None:
            logger.info(
                "sliding-window layers (window %d) attend in PyTorch: the native kernels have no window",
                model.args.sliding_window,
            )
    return backend
