"""The whole engine with ``--quantization`` against transformers on the same dequantized
weights: quantizing at load changes the weights, never the arithmetic done with them."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.quantized_layers import QuantizedLinear, quantize
from engine_svc.types import FinishReason, SamplingParams
from tests.engine.test_engine_vs_transformers import _assert_same_or_near_tie, _prompts
from tests.model_factory import load_hf_model, make_model_dir

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
NUM_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("quant") / "model", arch="llama", vocab_size=512)


def _dequantized_hf(path, method: str):
    """transformers' model with every linear layer but the LM head replaced by its
    quantize-then-dequantize copy (groups run along each output row, so quantizing the
    engine's fused q/k/v and gate/up rows is the same as quantizing each projection)."""
    hf = load_hf_model(path)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize(module.weight, method).dequantize())
    return hf


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_greedy_matches_transformers_on_the_dequantized_weights(model_dir, method):
    hf = _dequantized_hf(model_dir, method)
    hf.greedy_cache = {}
    core = EngineCore(
        EngineConfig(
            model=str(model_dir), dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=64,
            max_num_batched_tokens=96, quantization=method,
        )
    )  # fmt: skip
    layers = [m for m in core.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * core.runner.model_args.num_layers  # qkv, o, gate_up, down
    assert core.runner.matmuls == method
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
