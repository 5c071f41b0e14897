"""A GGUF file's quantized linear weights, kept as they are for the quantized kernels.

    read_quantized_linears(gguf_path, args) -> {our module name: QuantizedWeight}

Each linear layer whose tensors are all of a type ``native/quant_gguf.py`` maps (Q8_0,
Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) gets its blocks as they are in the file: no
dequantize-requantize round trip, so the engine computes with exactly the weights
llama.cpp would. Q/K rows permuted by llama.cpp's converter are put back in order by
moving whole rows (each row's groups are its own), and a fused projection's parts (q, k,
v; gate, up) are stacked, widened to a common layout where their types differ. Layers in
float types (F32, F16, BF16) are left to the float path. The embeddings and the LM head
are read apart (``read_quantized_embeddings``): they are not linear layers of the stack,
and backends/quantized_embeddings.py serves them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine_svc.model.arch.llama import ModelArgs
from engine_svc.model.load.gguf_metadata import PERMUTED_QK, architecture, open_gguf
from engine_svc.model.load.gguf_weights import _unpermute, hf_name
from engine_svc.model.load.loader import our_name
from engine_svc.model.native.quant import QuantizedWeight, concat_rows, take_rows
from engine_svc.model.native.quant_gguf import SUPPORTED_TYPES, from_gguf_blocks

logger = logging.getLogger(__name__)

_NOT_QUANTIZED = ("lm_head.weight", "embed_tokens.weight")


def read_quantized_linears(gguf_path: str | Path, args: ModelArgs) -> dict[str, QuantizedWeight]:
    path = Path(gguf_path)
    reader = open_gguf(path)
    permuted = architecture(reader, path) in PERMUTED_QK
    parts: dict[str, dict[int, QuantizedWeight | None]] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name) or ""
        mapped = our_name(name) if name.endswith(".weight") else None
        if mapped is None or mapped[0] in _NOT_QUANTIZED:
            continue
        module, part = mapped[0].removesuffix(".weight"), mapped[1] or 0
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            parts.setdefault(module, {})[part] = None  # a float part: the module stays float
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight = from_gguf_blocks(type_name, tensor.data, (shape[0], shape[1]))
        if permuted and ".self_attn.q_proj." in name:
            weight = take_rows(weight, _unpermute(torch.arange(shape[0]), args.num_heads))
        elif permuted and ".self_attn.k_proj." in name:
            weight = take_rows(weight, _unpermute(torch.arange(shape[0]), args.num_kv_heads))
        parts.setdefault(module, {})[part] = weight
    out: dict[str, QuantizedWeight] = {}
    for module, pieces in parts.items():
        ordered = [pieces[i] for i in sorted(pieces)]
        if all(p is not None for p in ordered):
            out[module] = concat_rows([p for p in ordered if p is not None])
    logger.info("GGUF %s: %d linear layers kept quantized, %.1f MiB", path.name, len(out), _mib(out))
    return out


def read_quantized_embeddings(gguf_path: str | Path, args: ModelArgs) -> dict[str, QuantizedWeight]:
    """The embedding's and the LM head's blocks as they are, for those of a type the
    quantized kernels take (backends/quantized_embeddings.py serves them): ``embed_tokens`` from
    ``token_embd.weight``, ``lm_head`` from ``output.weight`` or, where the file has none
    (a tied head), the same object as ``embed_tokens``."""
    tensors = {t.name: t for t in open_gguf(gguf_path).tensors}
    want = (args.vocab_size, args.hidden_size)
    out: dict[str, QuantizedWeight] = {}
    for module, name in (("embed_tokens", "token_embd.weight"), ("lm_head", "output.weight")):
        tensor = tensors.get(name)
        if tensor is None or tensor.tensor_type.name not in SUPPORTED_TYPES:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape == want:
            out[module] = from_gguf_blocks(tensor.tensor_type.name, tensor.data, want)
    if "output.weight" not in tensors and args.tie_word_embeddings and "embed_tokens" in out:
        out["lm_head"] = out["embed_tokens"]
    return out


def _mib(weights: dict[str, QuantizedWeight]) -> float:
    return sum(w.nbytes for w in weights.values()) / 2**20
