"""The whole engine with ``--quantization`` against transformers on the same dequantized
weights: quantizing at load changes the weights, never the arithmetic done with them."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.backends.quantized_layers import QuantizedLinear, quantize
from engine_svc.model.native import load_kernels
from engine_svc.model.native.quant import quantize_activations
from engine_svc.types import FinishReason, SamplingParams
from tests.engine.test_engine_vs_transformers import _assert_same_or_near_tie, _prompts
from tests.model_factory import load_hf_model, make_model_dir

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
NUM_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("quant") / "model", arch="llama", vocab_size=512)


def _dequantized_hf(path, method: str, int8_activations: bool = False):
    """transformers' model with every linear layer but the LM head replaced by its
    quantize-then-dequantize copy (groups run along each output row, so quantizing the
    engine's fused q/k/v and gate/up rows is the same as quantizing each projection); with
    ``int8_activations`` each such layer's input quantized per row and group of 32 first
    (q, k and v, gate and up, share an input, so fusing them changes nothing there either)."""
    hf = load_hf_model(path)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize(module.weight, method).dequantize())
                if int8_activations:
                    module.register_forward_pre_hook(lambda _m, args: (quantize_activations(args[0], 32),))
    return hf


INT8_DOTS = load_kernels() is not None and load_kernels().int8_dot_products
METHODS = [
    "int8",
    "int4",
    *(
        pytest.param(f"{m}+a8", marks=pytest.mark.skipif(not INT8_DOTS, reason="no int8 dots"))
        for m in ("int8", "int4")
    ),
]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_greedy_matches_transformers_on_the_dequantized_weights(model_dir, method):
    """``+a8``: with --activation-quantization int8, against transformers with each layer's
    input quantized the same way (then F.linear in float32)."""
    weights, _, a8 = method.partition("+")
    hf = _dequantized_hf(model_dir, weights, int8_activations=bool(a8))
    hf.greedy_cache = {}
    core = EngineCore(
        EngineConfig(
            model=str(model_dir), dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=64,
            max_num_batched_tokens=96, quantization=weights, activation_quantization="int8" if a8 else "none",
        )
    )  # fmt: skip
    layers = [m for m in core.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * core.runner.model_args.num_layers  # qkv, o, gate_up, down
    assert all(m.int8_activations == bool(a8) for m in layers)
    assert core.runner.matmuls == weights
    prompts = _prompts(11)[::2]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for prompt, result in zip(prompts, core.generate(prompts, params)):
        assert result.finish_reason == FinishReason.LENGTH
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
            )
        _assert_same_or_near_tie(hf, prompt, result.output_token_ids, out[0, len(prompt) :].tolist())


def test_quantization_without_the_native_kernels_is_refused_by_name(model_dir):
    with pytest.raises(ValueError, match="--quantization int8 runs on the native CPU kernels"):
        EngineCore(
            EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, kernels="torch", quantization="int8")
        )


def test_int8_activations_are_refused_where_they_cannot_run(model_dir, monkeypatch):
    with pytest.raises(ValueError, match="applies to quantized linear layers, and this model has none"):
        EngineCore(
            EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, activation_quantization="int8")
        )
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no native kernels")
    monkeypatch.setattr(kernels, "int8_dot_products", False)  # a CPU without VNNI, as the engine sees it
    with pytest.raises(ValueError, match="needs the native kernels on a CPU with AVX512-VNNI or AVX-VNNI"):
        EngineCore(
            EngineConfig(
                model=str(model_dir), dtype="float32", num_kv_blocks=64, quantization="int4",
                activation_quantization="int8",
            )
        )  # fmt: skip
