"""The embedding and the LM head on a GGUF file's quantized blocks, where the file has them so.

    install_quantized_embeddings(model, kernels, weights, dtype)
        weights: {"embed_tokens": QuantizedWeight, "lm_head": QuantizedWeight}, either or
        both (gguf_quantized.read_quantized_embeddings); one object for both when tied

    nn.Embedding -> QuantizedEmbedding   the rows looked up, dequantized: the same values
                                         as the float table, without holding it
    LM head      -> SplitHead            a step of at most NARROW_ROWS rows (one) on the
                                         quantized GEMM, wider steps on the float head

A decode step at small batch reads every weight once, so its time follows their bytes, and
the head is the largest single weight of a small model: SmolLM2-135M's is 113 MB in
float32 against 30 MB as the file's Q8_0 blocks. The quantized GEMM dequantizes in
registers, which costs compute that a wide step has to spend on every row: there the
float head's packed GEMM is faster, so it stays for those (the float head is the same
weight dequantized: both compute the same values, in another order of summation).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine_svc.model.llama import Transformer
from engine_svc.model.native import NativeKernels
from engine_svc.model.native.quant import QuantizedWeight, take_rows

logger = logging.getLogger(__name__)

# The most rows a step's logits take from the quantized head, where the two cross. SmolLM2's
# head (49,152 x 576) on the Zen 5 of benchmarks/README.md, two threads, ms: 1 row 1.47
# quantized (Q8_0) against 1.98 float32 (its 113 MB at 57 GB/s, near the machine's 65),
# 2 rows 2.36 against 2.12, 4 rows 3.10 against 2.51.
NARROW_ROWS = 1


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight  # not a Parameter: no state_dict entry
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return take_rows(self.weight_q, ids.reshape(-1)).dequantize().to(self.dtype).view(*ids.shape, -1)


class SplitHead(nn.Module):
    def __init__(self, kernels: NativeKernels, weight: QuantizedWeight, wide: nn.Module) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight_p = kernels.qpack(weight)  # the kernel's panels (native/quant_pack.py)
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > NARROW_ROWS:
            return self.wide(x)
        return self.kernels.qgemm(x.contiguous() if x.stride(-1) != 1 else x, self.weight_p)


def install_quantized_embeddings(
    model: Transformer, kernels: NativeKernels, weights: dict[str, QuantizedWeight], dtype: torch.dtype
) -> None:
    """Swap in place; call after the LM head is on its backend (the wide path)."""
    if "embed_tokens" in weights:
        w = weights["embed_tokens"]
        assert tuple(model.embed_tokens.weight.shape) == (w.out_features, w.in_features)
        model.add_module("embed_tokens", QuantizedEmbedding(w, dtype))  # a module of another type
    if "lm_head" in weights:
        model.add_module("lm_head", SplitHead(kernels, weights["lm_head"], model.lm_head))
    logger.info(
        "GGUF blocks kept for %s (%.1f MiB); the LM head takes them for steps of up to %d rows",
        " and ".join(sorted(weights)),
        sum(w.nbytes for w in {id(w): w for w in weights.values()}.values()) / 2**20,
        NARROW_ROWS,
    )
