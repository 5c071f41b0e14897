"""What a GGUF file says about its model, as the Hugging Face files we already read.

A GGUF file (llama.cpp's format, read here with the ``gguf`` package llama.cpp publishes)
carries key/value metadata and then the tensors. The keys are prefixed with the
architecture (``llama.block_count``); this module turns them into a ``config.json`` dict
and a ``generation_config.json`` dict, so ``ModelArgs.from_hf_config`` and
``read_special_token_ids`` serve a GGUF model exactly as they serve a Hugging Face one::

    general.architecture                       -> architectures / model_type
    {arch}.block_count                         -> num_hidden_layers
    {arch}.embedding_length                    -> hidden_size
    {arch}.feed_forward_length                 -> intermediate_size
    {arch}.attention.head_count(_kv)           -> num_attention_heads / num_key_value_heads
    {arch}.attention.key_length                -> head_dim (default hidden / heads)
    {arch}.attention.layer_norm_rms_epsilon    -> rms_norm_eps
    {arch}.rope.freq_base                      -> rope_theta
    {arch}.context_length                      -> max_position_embeddings
    no ``output.weight`` tensor                -> tie_word_embeddings
    tokenizer.ggml.{bos,eos,eot,eom}_token_id  -> bos_token_id / eos_token_id

Anything this engine cannot serve (another architecture, a RoPE scaling it does not
compute, a tensor type ``gguf`` cannot dequantize) is refused here by name, before any
weight is read.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# llama.cpp writes Llama and Mistral checkpoints as "llama" (with the Q/K rows permuted);
# "mistral" is accepted as a spelling of the same layout.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
# Architectures whose attn_q / attn_k rows llama.cpp's converter permuted (see gguf_weights).
PERMUTED_QK = frozenset({"llama", "mistral"})

_T = gguf.GGMLQuantizationType
# Dequantized at load to the serving dtype by gguf.quants (the reference implementation).
SUPPORTED_TENSOR_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
)


class GGUFError(ValueError):
    """A GGUF file this engine cannot serve; the message names what and why."""


class _Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map.

    The reader slices its map a few times per vocabulary entry and merge (about 250k
    slices for a 49k vocabulary), and each slice of a ``np.memmap`` runs two Python-level
    hooks; a plain view of the same mapping skips them, which opens SmolLM2's file about
    four times faster (1.9 s against 8.6 s on a loaded 2-core machine). The view keeps
    the map alive (as its base), and the reader reads the same bytes either way.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A reader over ``path`` (memory-mapped), or a GGUFError that says what is wrong.
    The last file opened is kept open: loading reads it twice (the float weights, then
    the quantized blocks), and parsing its metadata takes a second for a large vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _open(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def close_gguf() -> None:
    """Forget the reader ``open_gguf`` keeps, once a model is loaded: its memory map would
    keep the whole file resident (and its parsed metadata in the heap) for the engine's
    life, beside the weights copied out of it."""
    _open.cache_clear()


@functools.lru_cache(maxsize=1)
def _open(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return _Reader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError ...
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: gguf.GGUFReader, path: Path) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return str(arch)


def check_tensor_types(reader: gguf.GGUFReader, path: Path) -> None:
    """Refuse the file if any tensor has a type we cannot dequantize, naming them."""
    unsupported = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in SUPPORTED_TENSOR_TYPES})
    if unsupported:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise GGUFError(
            f"{path.name}: tensor type {', '.join(unsupported)} is not supported; supported types: {supported}"
        )


def hf_config(reader: gguf.GGUFReader, path: Path) -> dict:
    """config.json for the model in ``reader`` (see the table in the module docstring)."""
    arch = architecture(reader, path)
    check_tensor_types(reader, path)
    hf_arch, model_type = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path.name}: metadata key {arch}.{key} is missing")
        return value

    scaling = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{path.name}: RoPE scaling {scaling!r} is not supported; only unscaled RoPE")
    num_heads = int(need("attention.head_count"))
    hidden_size = int(need("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = field_value(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFError(f"{path.name}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
        vocab_size = len(tokens.data)
    bos_token_id, eos_token_ids = special_token_ids(reader)
    rope_theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field_value(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(field_value(reader, f"{arch}.attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(field_value(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "use_sliding_window": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids[0] if eos_token_ids else None,
        "torch_dtype": "float32",
    }


def special_token_ids(reader: gguf.GGUFReader) -> tuple[int | None, list[int]]:
    """(bos id, eos ids): the end-of-sequence id first, then end-of-turn / end-of-message."""
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    return (None if bos is None else int(bos)), eos


def generation_config(reader: gguf.GGUFReader) -> dict:
    bos, eos = special_token_ids(reader)
    return {"bos_token_id": bos, "eos_token_id": eos}
