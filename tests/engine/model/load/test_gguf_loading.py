"""GGUF loading on small files written here with gguf's own writer (no download).

A random Llama and a random Qwen2 (tests/model_factory.py) are written as GGUF files the
way llama.cpp's converter writes them (names, Llama's Q/K rows permuted, float32); reading it back must give the
Hugging Face tensors exactly, and the engine must build the same model from both files;
written in F16, BF16 and the Q4/Q5/Q8 types gguf can quantize, each weight must read back
as gguf's own dequantization of its bytes.
Files the engine cannot serve are refused with a message naming what is wrong.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine_svc.model.arch.llama import ModelArgs
from engine_svc.model.load.gguf_checkpoint import find_gguf
from engine_svc.model.load.gguf_metadata import GGUFError, hf_config, open_gguf
from engine_svc.model.load.gguf_weights import _unpermute, read_gguf_tensors
from engine_svc.model.load.loader import build_model, load_model
from tests.model_factory import make_model_dir

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``permute`` of llama.cpp's convert_hf_to_gguf.py, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"


def write_gguf(
    path, config: dict, tensors: dict[str, torch.Tensor], arch: str = "llama", extra: dict | None = None
) -> None:
    """``tensors`` (HF names) as llama.cpp writes them; ``extra`` tensors under GGUF names."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    permute = arch == "llama"  # llama.cpp's converter permutes Llama's Q/K rows, not Qwen2's
    for name, tensor in tensors.items():
        array = tensor.float().numpy()
        if permute and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, config["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, config["num_key_value_heads"])
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def llama(request, tmp_path_factory):
    """(HF directory, the same weights as a GGUF file, the HF tensors); Qwen2's has Q/K/V biases."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_model_dir(root / "hf", arch=request.param, vocab_size=256, num_heads=4, num_kv_heads=2)
    tensors = load_file(hf_dir / "model.safetensors")
    path = root / "tiny.gguf"
    write_gguf(path, json.loads((hf_dir / "config.json").read_text()), tensors, arch=request.param)
    return hf_dir, path, tensors


def test_unpermute_inverts_llama_cpps_permutation():
    w = torch.arange(8 * 64 * 3, dtype=torch.float32).reshape(8 * 64, 3)  # 8 heads of 64 rows
    permuted = torch.from_numpy(_llama_cpp_permute(w.numpy(), 8))
    assert not torch.equal(permuted, w)
    assert torch.equal(_unpermute(permuted, 8), w)


def test_gguf_tensors_read_back_as_the_hugging_face_ones(llama):
    hf_dir, path, tensors = llama
    args = ModelArgs.from_hf_config(hf_config(open_gguf(path), path))
    read, freq_factors = read_gguf_tensors(path, args)
    assert freq_factors is None
    assert {name for name, _ in read} == set(tensors)
    for name, value in read:
        assert torch.equal(value, tensors[name]), name


def test_the_gguf_file_computes_the_logits_of_the_hf_directory(llama):
    hf_dir, path, _ = llama
    args = ModelArgs.from_hf_config(hf_config(open_gguf(path), path))
    from_gguf, _ = build_model(args, read_gguf_tensors(path, args)[0], "cpu", torch.float32, path)
    from_hf, _ = load_model(hf_dir, "cpu", "float32")
    for (name, a), (_, b) in zip(sorted(from_gguf.state_dict().items()), sorted(from_hf.state_dict().items())):
        assert torch.equal(a, b), name
    assert torch.equal(from_gguf.rotary.inv_freq, from_hf.rotary.inv_freq)


def test_an_unsupported_architecture_is_refused_by_name(llama, tmp_path):
    hf_dir, _, tensors = llama
    path = tmp_path / "other.gguf"
    write_gguf(path, json.loads((hf_dir / "config.json").read_text()), tensors, arch="gemma2")
    with pytest.raises(GGUFError, match=r"architecture 'gemma2' is not supported; supported: llama, mistral, qwen2"):
        hf_config(open_gguf(path), path)


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # One IQ4_NL block (32 values in 18 bytes): a type gguf reads but this engine does not serve.
    writer.add_tensor("token_embd.weight", np.zeros((1, 18), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"tensor type IQ4_NL is not supported; supported types: .*Q4_K"):
        hf_config(open_gguf(path), path)


def test_a_file_that_is_not_gguf_gets_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="is not a readable GGUF file"):
        open_gguf(path)


def test_model_paths_name_one_gguf(llama, tmp_path):
    hf_dir, path, _ = llama
    assert find_gguf(path) == path
    assert find_gguf(path.parent) == path  # a directory holding one GGUF (hf/ beside it is not one)
    assert find_gguf(hf_dir) is None  # a Hugging Face directory
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="several GGUF files"):
        find_gguf(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(GGUFError, match="must be a GGUF"):
        find_gguf(tmp_path / "weights.bin")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_tensors_dequantize_in_place_of_the_weights(llama, tmp_path, qtype):
    """Each quantized Linear weight reads back as gguf's own dequantization of its bytes,
    in the [out, in] layout, and the model still builds from them."""
    from gguf.quants import dequantize, quantize

    hf_dir, _, tensors = llama
    config = json.loads((hf_dir / "config.json").read_text())
    kind = gguf.GGMLQuantizationType[qtype]
    path = tmp_path / f"{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), config["model_type"])
    for key, value in hf_config_keys(config).items():
        getattr(writer, key)(value)
    expected = {}
    for name, tensor in tensors.items():
        array = tensor.float().numpy()
        if array.ndim == 2:
            # Llama's Q/K rows are stored permuted (llama.cpp); rows[j] is the HF row at j.
            heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
            head = next((h for part, h in heads.items() if part in name), None)
            rows = np.arange(array.shape[0])
            if config["model_type"] == "llama" and head is not None:
                rows = _llama_cpp_permute(rows, head)
            packed = quantize(np.ascontiguousarray(array[rows]), kind)
            writer.add_tensor(_gguf_name(name), packed, raw_dtype=kind)
            values = dequantize(packed, kind).reshape(array.shape)
            expected[name] = torch.from_numpy(values[np.argsort(rows)])
        else:
            writer.add_tensor(_gguf_name(name), array)
            expected[name] = tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(path)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {qtype}
    args = ModelArgs.from_hf_config(hf_config(reader, path))
    read, _ = read_gguf_tensors(path, args)
    for name, value in read:
        assert torch.equal(value, expected[name].float()), name
    build_model(args, read, "cpu", torch.float32, path)


def hf_config_keys(config: dict) -> dict:
    return {
        "add_block_count": config["num_hidden_layers"],
        "add_embedding_length": config["hidden_size"],
        "add_feed_forward_length": config["intermediate_size"],
        "add_head_count": config["num_attention_heads"],
        "add_head_count_kv": config["num_key_value_heads"],
        "add_layer_norm_rms_eps": config["rms_norm_eps"],
        "add_vocab_size": config["vocab_size"],
    }


def test_rope_freqs_divide_the_rope_frequencies(tmp_path):
    """llama.cpp bakes Llama 3.1's RoPE scaling into a ``rope_freqs`` tensor of divisors."""
    hf_dir = make_model_dir(tmp_path / "hf", arch="llama", vocab_size=256, num_heads=4, num_kv_heads=2)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    path = tmp_path / "rope.gguf"
    factors = torch.linspace(1.0, 8.0, 64 // 4 // 2)  # one per frequency: head_dim 16 -> 8
    write_gguf(path, config, tensors, extra={"rope_freqs.weight": factors})
    args = ModelArgs.from_hf_config(hf_config(open_gguf(path), path))
    read, freq_factors = read_gguf_tensors(path, args)
    assert freq_factors is not None and torch.equal(freq_factors, factors)
    model, _ = build_model(args, read, "cpu", torch.float32, path, freq_factors=freq_factors)
    plain, _ = load_model(hf_dir, "cpu", "float32")
    torch.testing.assert_close(model.rotary.inv_freq, plain.rotary.inv_freq / factors)
