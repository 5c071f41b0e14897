"""Small GGUF files written in code with ``gguf``'s own writer, for tests and benchmarks.

``write_tiny_gguf`` writes a random-weight Llama (2 layers, hidden 64, 4 heads of 16, 2 KV
heads, MLP 128, 260 tokens) as llama.cpp lays one out, with a byte-level BPE tokenizer in
its metadata so that an engine can serve it end to end. ``metadata`` replaces or adds
keys (``{"llama.block_count": 10**6}``; a value past 32 bits is written as a uint64),
``shapes`` writes tensors at other shapes, ``drop`` leaves tensors out: each lie a file can
tell about itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

ARCH = "llama"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 128, 2, 260


def honest_metadata() -> dict[str, object]:
    return {
        f"{ARCH}.block_count": LAYERS,
        f"{ARCH}.embedding_length": HIDDEN,
        f"{ARCH}.feed_forward_length": FFN,
        f"{ARCH}.attention.head_count": HEADS,
        f"{ARCH}.attention.head_count_kv": KV_HEADS,
        f"{ARCH}.context_length": 2048,
        f"{ARCH}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{ARCH}.rope.freq_base": 10000.0,
        f"{ARCH}.vocab_size": VOCAB,
    }


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in numpy order ([out, in] for a Linear), as the reader returns it."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    return shapes


def write_tiny_gguf(
    path: str | Path,
    *,
    metadata: dict[str, object] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    drop: tuple[str, ...] = (),
    seed: int = 0,
) -> Path:
    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), ARCH)
    for key, value in (honest_metadata() | (metadata or {})).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif value >= 2**32:  # type: ignore[operator]
            writer.add_uint64(key, int(value))  # type: ignore[arg-type]
        else:
            writer.add_uint32(key, int(value))  # type: ignore[call-overload]
    _add_tokenizer(writer)
    for name, shape in (tensor_shapes() | (shapes or {})).items():
        if name in drop:
            continue
        scale = 1.0 if name.endswith("norm.weight") else 0.1
        values = np.ones(shape, np.float32) if scale == 1.0 else rng.normal(0, scale, shape).astype(np.float32)
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary: GPT-2's 256 byte symbols, two merges, then BOS and EOS."""
    tokens = [*_byte_symbols(), "ab", "\u0120t", "<s>", "</s>"]
    assert len(tokens) == VOCAB
    types = [gguf.TokenType.NORMAL] * (VOCAB - 2) + [gguf.TokenType.CONTROL] * 2
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b", "\u0120 t"])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
