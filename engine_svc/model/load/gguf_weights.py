"""A GGUF file's tensors, dequantized and renamed to Hugging Face names.

The loader (``loader.build_model``) then fuses and renames them exactly as it does a
safetensors checkpoint, so both formats share one path from here on::

    token_embd.weight            -> model.embed_tokens.weight
    output_norm.weight           -> model.norm.weight
    output.weight                -> lm_head.weight             (absent when tied)
    blk.{i}.attn_norm.weight     -> model.layers.{i}.input_layernorm.weight
    blk.{i}.attn_{q,k,v}.*       -> model.layers.{i}.self_attn.{q,k,v}_proj.*
    blk.{i}.attn_output.*        -> model.layers.{i}.self_attn.o_proj.*
    blk.{i}.ffn_norm.weight      -> model.layers.{i}.post_attention_layernorm.weight
    blk.{i}.ffn_{gate,up,down}.* -> model.layers.{i}.mlp.{gate,up,down}_proj.*
    rope_freqs.weight            -> RoPE frequency divisors (Llama 3.1's scaling, baked in)

Layout. GGUF lists dimensions fastest first (``[in, out]`` for a Linear); the reader's
arrays are already in numpy order (``[out, in]``), as torch wants them. llama.cpp's
converter permutes the rows of ``attn_q`` / ``attn_k`` of Llama-layout models, per head,
from the rotate-half pairing (i, i + d/2) to the interleaved pairing (2i, 2i + 1)::

    HF rows of one head:   [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]
    GGUF rows of one head: [x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)]

``_unpermute`` undoes it (the inverse of ``permute`` in llama.cpp's convert_hf_to_gguf.py,
as transformers' ``LlamaTensorProcessor`` does), so our rotate-half RoPE applies.
Quantized types are dequantized to float32 with ``gguf.quants.dequantize``, the
reference implementation published with llama.cpp, then cast by the loader.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from engine_svc.model.arch.llama import ModelArgs
from engine_svc.model.load.gguf_metadata import (
    PERMUTED_QK,
    GGUFError,
    architecture,
    check_tensor_types,
    open_gguf,
    read_shape,
)

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one no Llama-family model has."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    layer, part, suffix = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation. w: [num_heads * head_dim, ...] (weight or bias)."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf_tensors(
    path: str | Path, args: ModelArgs, kept: Callable[[str], bool] | None = None
) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor | None]:
    """(Hugging Face-named float32 tensors, RoPE frequency divisors or None) of ``path``.
    Tensors ``kept`` names (their HF name) come back as meta tensors, not dequantized: their
    layers are served from the quantized blocks (gguf_quantized.py)."""
    path = Path(path)
    reader = open_gguf(path)
    arch = architecture(reader, path)
    check_tensor_types(reader, path)
    read_shape(reader, path, arch)  # the metadata agrees with every tensor's shape, before any is read
    permuted = arch in PERMUTED_QK
    tensors: list[tuple[str, torch.Tensor]] = []
    freq_factors: torch.Tensor | None = None
    for tensor in reader.tensors:
        # GGUF shapes are fastest dimension first; ours are the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        name = hf_name(tensor.name)
        if kept is not None and name is not None and kept(name):
            tensors.append((name, torch.empty(shape, device="meta")))
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        # F32 comes back as a view of the read-only memory map; the model may own its weights.
        values = torch.from_numpy(array.copy() if not array.flags.writeable else np.ascontiguousarray(array))
        if values.numel() != int(np.prod(shape)):
            raise GGUFError(f"{path.name}: tensor {tensor.name} holds {values.numel()} values, not {shape}")
        values = values.reshape(shape)
        if tensor.name == _ROPE_FREQS:
            freq_factors = values
            continue
        if name is None:
            raise GGUFError(f"{path.name}: tensor {tensor.name} has no place in a {arch} model")
        if permuted and ".self_attn.q_proj." in name:
            values = _unpermute(values, args.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            values = _unpermute(values, args.num_kv_heads)
        tensors.append((name, values))
    logger.info("read %d tensors from %s", len(tensors), path)
    return tensors, freq_factors
