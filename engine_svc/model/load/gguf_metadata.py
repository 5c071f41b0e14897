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

The metadata sizes everything the engine builds: ``block_count`` layers, a KV cache and
attention workspace for ``context_length`` tokens, a sampler over ``vocab_size`` logits.
A file can say anything there, so ``read_shape`` reads each number as an integer,
compares it with the tensors the file holds (their shapes are in the header: nothing is
read or dequantized) and holds it within a cap; a disagreement is refused in one line
naming the file and the key::

    key ({arch}.)                must agree with                                   cap
    block_count                  the blocks blk.0 .. blk.{n-1}, each complete        1,024
    embedding_length             token_embd.weight's width                          65,536
    vocab_size                   token_embd.weight's (and output.weight's) rows      4,194,304
    attention.head_count         attn_q.weight's rows / head dim                     1,024
    attention.head_count_kv      attn_k / attn_v rows / head dim; divides head_count
    attention.key_length         (head dim; default embedding_length / head_count)   even, 1,024
    feed_forward_length          ffn_gate / ffn_up rows, ffn_down's width            1,048,576
    context_length               (no tensor)                                         16,777,216

and every tensor of a known name must have the shape these numbers give it. The caps are
8-16x the largest published models (Llama 3.1 405B: 126 blocks, width 16,384, 128 heads,
MLP 53,248; Gemma 3: 262,144 tokens, head dim 256), so they refuse only files no
model has. The context cap is also where positions stop being exact: RoPE multiplies each
position, as float32, by its frequencies (arch/rope.py, as transformers does), and float32
holds every integer only up to 2^24. The longest published context, Llama 4 Scout's 10M
tokens, is below it. Within the cap, what a long context costs at start is the runner's
check (attention/kv_memory.py: one full-length request must fit the memory available).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

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
    shape = read_shape(reader, path, arch)
    tensor_names = {t.name for t in reader.tensors}
    bos_token_id, eos_token_ids = special_token_ids(reader)
    rope_theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.context_length,
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


# -- the shape metadata, checked against the tensors (module docstring) ------------------

MAX_BLOCKS = 1024
MAX_EMBEDDING = 1 << 16
MAX_VOCAB = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FEED_FORWARD = 1 << 20
MAX_CONTEXT = 1 << 24  # float32 holds every position exactly up to here

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Per block: the tensors every block must have.
_REQUIRED = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class GGUFShape:
    """The checked numbers: what config.json is written from."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    context_length: int

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape (numpy order, [out, in]) tensor ``name`` must have; None for a name no
        Llama-family model has (the weight reader refuses those by name)."""
        h, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        fixed = {
            "token_embd.weight": (v, h),
            "output.weight": (v, h),
            "output_norm.weight": (h,),
            "rope_freqs.weight": (self.head_dim // 2,),
        }
        if name in fixed:
            return fixed[name]
        m = _BLOCK_RE.fullmatch(name)
        if m is None:
            return None
        weights = {
            "attn_norm": (h,), "ffn_norm": (h,),
            "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f),
        }  # fmt: skip
        weight = weights.get(m.group(2))
        if weight is None:
            return None
        return weight if m.group(3) == "weight" else weight[:1]


def read_shape(reader: gguf.GGUFReader, path: Path, arch: str) -> GGUFShape:
    """The file's shape metadata, checked against its tensors (module docstring); GGUFError
    names the file and the first key that disagrees or exceeds its cap."""
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    key = _Keys(reader, path, arch)

    embedding = shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2:
        raise GGUFError(f"{path.name}: tensor token_embd.weight is missing or not 2-D ({embedding})")
    vocab_rows, width = embedding

    layers = key.count("block_count")
    blocks = {int(m.group(1)) for name in shapes if (m := _BLOCK_RE.fullmatch(name))}
    if blocks != set(range(layers)):
        held = f"blocks {min(blocks)} to {max(blocks)} ({len(blocks)} in all)" if blocks else "no block"
        key.refuse("block_count", layers, f"the file holds tensors of {held}")
    key.cap("block_count", layers, MAX_BLOCKS)
    for i in range(layers):
        missing = [f"blk.{i}.{t}.weight" for t in _REQUIRED if f"blk.{i}.{t}.weight" not in shapes]
        if missing:
            key.refuse("block_count", layers, f"tensor {missing[0]} is missing")

    hidden = key.count("embedding_length")
    if hidden != width:
        key.refuse("embedding_length", hidden, f"token_embd.weight is {list(embedding)}, {width} wide")
    key.cap("embedding_length", hidden, MAX_EMBEDDING)
    vocab = key.count("vocab_size", default=_token_count(reader))
    key.cap("vocab_size", vocab, MAX_VOCAB)
    if vocab != vocab_rows:
        key.refuse("vocab_size", vocab, f"token_embd.weight is {list(embedding)}, {vocab_rows} rows")
    heads = key.cap("attention.head_count", key.count("attention.head_count"), MAX_HEADS)
    kv_heads = key.cap("attention.head_count_kv", key.count("attention.head_count_kv", default=heads), MAX_HEADS)
    if heads % kv_heads:
        key.refuse("attention.head_count_kv", kv_heads, f"it must divide attention.head_count ({heads})")
    if key.present("attention.key_length"):
        head_dim = key.count("attention.key_length")
        source = "attention.key_length"
    elif hidden % heads:
        key.refuse("attention.head_count", heads, f"it does not divide embedding_length ({hidden})")
    else:
        head_dim, source = hidden // heads, f"embedding_length {hidden} / head_count {heads}"
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        key.refuse("attention.key_length", head_dim, f"the head dimension must be even (RoPE) and <= {MAX_HEAD_DIM}")
    q_rows, k_rows = shapes["blk.0.attn_q.weight"][0], shapes["blk.0.attn_k.weight"][0]
    if q_rows != heads * head_dim:
        key.refuse(
            "attention.head_count", heads, f"blk.0.attn_q.weight has {q_rows} rows, not {heads} x {head_dim} ({source})"
        )
    if k_rows != kv_heads * head_dim:
        key.refuse(
            "attention.head_count_kv",
            kv_heads,
            f"blk.0.attn_k.weight has {k_rows} rows, not {kv_heads} x {head_dim} (head dim {source})",
        )
    ffn = key.count("feed_forward_length")
    if shapes["blk.0.ffn_up.weight"][0] != ffn:
        key.refuse("feed_forward_length", ffn, f"blk.0.ffn_up.weight is {list(shapes['blk.0.ffn_up.weight'])}")
    key.cap("feed_forward_length", ffn, MAX_FEED_FORWARD)
    context = key.cap("context_length", key.count("context_length", default=2048), MAX_CONTEXT)

    shape = GGUFShape(layers, hidden, vocab, heads, kv_heads, head_dim, ffn, context)
    for name, actual in shapes.items():
        expected = shape.tensor_shape(name)
        if expected is not None and actual != expected:
            raise GGUFError(
                f"{path.name}: tensor {name} is {list(actual)}; the metadata ({arch}.embedding_length {hidden}, "
                f"head_count {heads}, head_count_kv {kv_heads}, head dim {head_dim}, feed_forward_length {ffn}, "
                f"vocab_size {vocab}) makes it {list(expected)}"
            )
    return shape


class _Keys:
    """Reads ``{arch}.{key}`` as a positive integer and holds it within its cap, or refuses by name."""

    def __init__(self, reader: gguf.GGUFReader, path: Path, arch: str) -> None:
        self.reader, self.path, self.arch = reader, path, arch

    def present(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.reader.fields

    def count(self, key: str, default: int | None = None) -> int:
        """The key's value, a positive integer."""
        value: Any = field_value(self.reader, f"{self.arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{self.path.name}: metadata key {self.arch}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            self.refuse(key, _short(value), "a positive integer is needed")
        if value < 1:
            self.refuse(key, value, "a positive integer is needed")
        return value

    def cap(self, key: str, value: int, cap: int) -> int:
        if value > cap:
            self.refuse(key, value, f"above the most this engine serves ({cap:,})")
        return value

    def refuse(self, key: str, value: object, why: str) -> NoReturn:
        raise GGUFError(f"{self.path.name}: {self.arch}.{key} is {value}: {why}")


def _token_count(reader: gguf.GGUFReader) -> int | None:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return None if tokens is None else len(tokens.data)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
