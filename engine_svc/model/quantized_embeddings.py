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
import time

import torch
from torch import nn

from engine_svc.model.llama import Transformer
from engine_svc.model.native import NativeKernels
from engine_svc.model.native.quant import QuantizedWeight, take_rows

logger = logging.getLogger(__name__)

# The most rows a step's logits take from the quantized head where the two cross, by
# machine, so it is timed at load (``SplitHead.choose_narrow_rows``): SmolLM2's head
# (49,152 x 576), two threads, ms, quantized (Q8_0) against float32: on a Zen 5 1 row 1.47
# against 1.98 (its 113 MB at 57 GB/s, near the machine's 65), 2 rows 2.36 against 2.12;
# on an Intel Xeon with AVX512 (family 6 model 167) 1 row 0.61 against 2.03, 5 rows 1.18
# against 2.14, 16 rows 2.90 against 2.91. NARROW_ROWS is the answer without a timing.
NARROW_ROWS = 1
NARROW_CANDIDATES = (2, 4, 8, 16)  # row counts tried at load, in turn, while the quantized head wins


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
        self.narrow_rows = NARROW_ROWS

    def choose_narrow_rows(self, dtype: torch.dtype, repeats: int = 5) -> int:
        """Time both heads (median of ``repeats``, rows of ``dtype``) at ``NARROW_CANDIDATES`` rows, in turn,
        and keep the quantized one up to the largest count where it is no slower (a few
        tens of milliseconds at load). Both give the same values up to the order of
        summation, so the choice moves speed only."""

        def median_ms(fn, x: torch.Tensor) -> float:
            fn(x)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        with torch.inference_mode():
            for rows in NARROW_CANDIDATES:
                x = torch.randn(rows, self.weight_p.in_features).to(dtype)
                if median_ms(self._narrow, x) > median_ms(self.wide, x):
                    break
                self.narrow_rows = rows
        return self.narrow_rows

    def _narrow(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.qgemm(x.contiguous() if x.stride(-1) != 1 else x, self.weight_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.narrow_rows:
            return self.wide(x)
        return self._narrow(x)


def install_quantized_embeddings(
    model: Transformer, kernels: NativeKernels, weights: dict[str, QuantizedWeight], dtype: torch.dtype
) -> None:
    """Swap in place; call after the LM head is on its backend (the wide path)."""
    if "embed_tokens" in weights:
        w = weights["embed_tokens"]
        assert tuple(model.embed_tokens.weight.shape) == (w.out_features, w.in_features)
        model.add_module("embed_tokens", QuantizedEmbedding(w, dtype))  # a module of another type
    narrow_rows = 0
    if "lm_head" in weights:
        head = SplitHead(kernels, weights["lm_head"], model.lm_head)
        model.add_module("lm_head", head)
        narrow_rows = head.choose_narrow_rows(dtype)
    logger.info(
        "GGUF blocks kept for %s (%.1f MiB); the LM head takes them for steps of up to %d rows",
        " and ".join(sorted(weights)),
        sum(w.nbytes for w in {id(w): w for w in weights.values()}.values()) / 2**20,
        narrow_rows,
    )
