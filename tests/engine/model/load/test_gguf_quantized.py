"""A GGUF file's quantized tensors kept as they are: the engine computes with exactly the
weights the file holds (llama.cpp's), on the quantized GEMM, and its greedy ids equal
transformers' on those weights dequantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from torch import nn

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.arch.llama import ModelArgs
from engine_svc.model.backends.quantized_embeddings import QuantizedEmbedding, QuantizedHead
from engine_svc.model.backends.quantized_layers import QuantizedLinear
from engine_svc.model.load.gguf_metadata import hf_config, open_gguf
from engine_svc.model.load.gguf_quantized import read_quantized_embeddings, read_quantized_linears
from engine_svc.model.load.gguf_weights import read_gguf_tensors
from engine_svc.model.load.loader import build_model
from engine_svc.model.native import load_kernels
from engine_svc.model.native.quant import quantize_activations
from engine_svc.types import SamplingParams
from tests.engine.model.load.test_gguf_loading import _gguf_name, _llama_cpp_permute, hf_config_keys
from tests.engine.test_engine_vs_transformers import _assert_same_or_near_tie, _prompts
from tests.model_factory import load_hf_model, make_model_dir

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

# Mixed types, as llama.cpp's K-quant mixes write them: q/k and v differ, so the fused
# q/k/v projection meets in a common layout. The embedding and the LM head in Q8_0, as
# llama.cpp's quantizer writes them for small models.
TYPES = {
    "q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1",
    "gate_proj": "Q5_0", "up_proj": "Q5_1", "down_proj": "Q8_0",
    "embed_tokens": "Q8_0", "lm_head": "Q8_0",
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(GGUF path, HF directory, the HF-named weights the file holds, dequantized)."""
    root = tmp_path_factory.mktemp("ggufq")
    hf_dir = make_model_dir(root / "hf", vocab_size=512, hidden_size=64, intermediate_size=128)
    config = json.loads((hf_dir / "config.json").read_text())
    path = root / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in hf_config_keys(config).items():
        getattr(writer, key)(value)
    # A byte-level BPE vocabulary of single characters, so the engine can serve the file.
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(config["vocab_size"])])
    writer.add_token_types([1] * config["vocab_size"])
    writer.add_token_scores([0.0] * config["vocab_size"])
    writer.add_token_merges([])
    held = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        array = tensor.float().numpy()
        part = next((p for p in TYPES if f".{p}." in f".{name}"), None)
        if part is None:
            writer.add_tensor(_gguf_name(name), array)
            held[name] = tensor.float()
            continue
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}.get(part)
        rows = _llama_cpp_permute(np.arange(array.shape[0]), heads) if heads else np.arange(array.shape[0])
        kind = gguf.GGMLQuantizationType[TYPES[part]]
        packed = quantize(np.ascontiguousarray(array[rows]), kind)
        writer.add_tensor(_gguf_name(name), packed, raw_dtype=kind)
        held[name] = torch.from_numpy(dequantize(packed, kind).reshape(array.shape)[np.argsort(rows)].copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_dir, held


def test_quantized_blocks_hold_the_weights_the_float_path_reads(checkpoint):
    path, _, _ = checkpoint
    args = ModelArgs.from_hf_config(hf_config(open_gguf(path), path))
    weights = read_quantized_linears(path, args)
    assert len(weights) == 4 * args.num_layers  # qkv, o, gate_up, down: every linear layer
    model, _ = build_model(args, read_gguf_tensors(path, args)[0], "cpu", torch.float32, path)
    for name, qw in weights.items():
        assert torch.equal(qw.dequantize(), model.get_submodule(name).weight), name
    assert weights["layers.0.attn.qkv_proj"].bits == 8  # Q4_0 beside Q8_0: widened, unchanged


def test_the_embedding_and_head_blocks_are_the_float_paths_weights(checkpoint):
    path, _, held = checkpoint
    args = ModelArgs.from_hf_config(hf_config(open_gguf(path), path))
    weights = read_quantized_embeddings(path, args)
    assert weights["embed_tokens"] is not weights["lm_head"]  # untied: two tensors in the file
    assert torch.equal(weights["embed_tokens"].dequantize(), held["model.embed_tokens.weight"])
    assert torch.equal(weights["lm_head"].dequantize(), held["lm_head.weight"])


def _hf_on_blocks(hf_dir, held: dict[str, torch.Tensor], int8_activations: bool = False):
    """transformers with the file's dequantized weights; with ``int8_activations`` every
    linear layer's input quantized per row and group of 32 first (a forward pre-hook)."""
    hf = load_hf_model(hf_dir)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and f"{name}.weight" in held:
                module.weight.copy_(held[f"{name}.weight"])
            if int8_activations and isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda _m, args: (quantize_activations(args[0], 32),))
    return hf


def _greedy_matches(core: EngineCore, hf) -> None:
    prompts = _prompts(5)[::3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt, result in zip(prompts, core.generate(prompts, params)):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
            )
        _assert_same_or_near_tie(hf, prompt, result.output_token_ids, out[0, len(prompt) :].tolist())


def test_the_engine_serves_the_blocks_and_matches_transformers_on_them(checkpoint):
    path, hf_dir, held = checkpoint
    hf = _hf_on_blocks(hf_dir, held)
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64))
    assert core.runner.matmuls == "gguf"
    # Loaded, the engine holds no map of the file: its weights were copied out of it.
    assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
    assert sum(isinstance(m, QuantizedLinear) for m in core.runner.model.modules()) == 8
    model = core.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedHead)
    assert core.runner.threads is not None  # no kernel splits a sum: threads are chosen by timing steps
    _greedy_matches(core, hf)
    dequantized = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, quantization="none"))
    assert dequantized.runner.matmuls != "gguf"


@pytest.mark.skipif(not (load_kernels() and load_kernels().int8_dot_products), reason="no int8 dot products")
def test_int8_activations_on_the_blocks_match_transformers_with_quantized_inputs(checkpoint):
    """--activation-quantization int8 on the file's blocks, the LM head's included: against
    transformers on the same weights with each of those layers' input quantized per row and
    group of 32 (every layer here is in groups of 32)."""
    path, hf_dir, held = checkpoint
    hf = _hf_on_blocks(hf_dir, held, int8_activations=True)
    core = EngineCore(
        EngineConfig(
            model=str(path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64,
            activation_quantization="int8",
        )
    )  # fmt: skip
    model = core.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 8 and all(m.int8_activations for m in layers)
    assert isinstance(model.lm_head, QuantizedHead) and model.lm_head.int8_activations
    model.lm_head.wide = None  # every step on the blocks, whatever the timing at load chose
    _greedy_matches(core, hf)
