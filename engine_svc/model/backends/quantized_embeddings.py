"""The embedding and the LM head on a GGUF file's quantized blocks, where the file has them so.

    install_quantized_embeddings(model, kernels, weights, dtype, widest_rows)
        weights: {"embed_tokens": QuantizedWeight, "lm_head": QuantizedWeight}, either or
        both (gguf_quantized.read_quantized_embeddings); one object for both when tied

    nn.Embedding -> QuantizedEmbedding   the rows looked up, dequantized: the same values
                                         as the float table, without holding it; a tied
                                         head's rows are read from the head's own panels
    LM head      -> QuantizedHead        the quantized GEMM for every step, or for steps
                                         up to a crossover with the float head kept beside
                                         it for wider ones, where that pays (timed at load)

A decode step at small batch reads every weight once, so its time follows their bytes, and
the head is the largest single weight of a small model: SmolLM2-135M's is 113 MB in
float32 against 30 MB as the file's Q8_0 blocks. The quantized GEMM dequantizes in
registers, which costs compute that a wide step spends on every row, so where the float
head is much faster on wide steps (a bfloat16 head on AMX, or a CPU where the dequantizing
costs more) it is kept for them; where it is not, holding it would only triple the head's
memory, so it is dropped and the resident weights are about the file's bytes. Both heads
compute the same values, in another order of summation.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine_svc.model.arch.llama import Transformer
from engine_svc.model.native import NativeKernels
from engine_svc.model.native.quant import QuantizedWeight
from engine_svc.model.native.quant_pack import PackedQuantWeight

logger = logging.getLogger(__name__)

# The most rows a step's logits take from the quantized head while a float head is kept,
# without a timing. SmolLM2's head (49,152 x 576), two threads, ms, quantized (Q8_0)
# against the float head: on a Zen 5 (float32) 1 row 1.47 against 1.98, 2 rows 2.36
# against 2.12; on an Intel Xeon with AVX512 and AMX (family 6 model 167), float32,
# 1 row 0.74 against 2.49, 16 rows 3.9 against 6.0, 64 rows 14.0 against 15.8, 128 rows
# 27.0 against 29.3, 256 rows 70 against 66; the same Xeon in bfloat16 (its float head on
# AMX through oneDNN) 4 rows 1.37 against 1.26, 64 rows 13.3 against 3.0.
NARROW_ROWS = 1
# The float head is kept only if it is this much faster at some step width up to the
# widest; within it, a few percent on the widest steps do not pay for the float head's
# memory (3.7 times the Q8_0 blocks' in float32).
WIDE_HEAD_GAIN = 1.1
MOST_ROWS_TIMED = 256


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight | PackedQuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight  # not a Parameter: no state_dict entry
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_q.dequantize_rows(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)


class QuantizedHead(nn.Module):
    """Steps of up to ``narrow_rows`` rows on the quantized panels, wider ones on ``wide``;
    every step on the panels once ``wide`` is None."""

    def __init__(
        self, kernels: NativeKernels, weight: QuantizedWeight, wide: nn.Module | None, int8_activations: bool = False
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight_p = kernels.qpack(weight)  # the kernel's panels (native/quant_pack.py)
        self.wide = wide
        self.narrow_rows = NARROW_ROWS
        # --activation-quantization int8: the quantized head's rows quantized too (a wide
        # step on a kept float head is not)
        self.int8_activations = int8_activations

    def settle(self, dtype: torch.dtype, widest_rows: int, repeats: int = 3) -> str:
        """Time both heads (median of ``repeats``, rows of ``dtype``) at 2, 4, 8 ... rows up to
        ``widest_rows`` (the widest step's logits; at most MOST_ROWS_TIMED): keep the
        quantized head up to the largest count where it is no slower, and drop the float
        head unless it is WIDE_HEAD_GAIN times faster somewhere. Both give the same values
        up to the order of summation, so this moves speed and memory only. Says what it chose."""
        if self.wide is None:
            return "every step on the quantized blocks"

        def median_ms(fn, x: torch.Tensor) -> float:
            fn(x)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2] * 1e3

        crossed, rows = False, 2
        with torch.inference_mode():
            while rows <= max(2, min(widest_rows, MOST_ROWS_TIMED)):
                x = torch.randn(rows, self.weight_p.in_features).to(dtype)
                quantized, wide = median_ms(self._narrow, x), median_ms(self.wide, x)
                crossed = crossed or quantized > wide
                if not crossed:
                    self.narrow_rows = rows
                if quantized > WIDE_HEAD_GAIN * wide:
                    return (
                        f"steps of up to {self.narrow_rows} rows on the quantized blocks, wider ones on the float head "
                        f"({rows} rows: {wide:.2f} ms against {quantized:.2f})"
                    )
                rows *= 2
        self.wide = None  # freed: nothing else holds the float head
        return f"every step on the quantized blocks (the float head, no more than {WIDE_HEAD_GAIN}x faster, dropped)"

    def _narrow(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous() if x.stride(-1) != 1 else x
        return self.kernels.qgemm(x, self.weight_p, int8_activations=self.int8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.shape[0] > self.narrow_rows:
            return self.wide(x)
        return self._narrow(x)


def install_quantized_embeddings(
    model: Transformer,
    kernels: NativeKernels,
    weights: dict[str, QuantizedWeight],
    dtype: torch.dtype,
    widest_rows: int,
    int8_activations: bool = False,
) -> None:
    """Swap in place; call after the LM head is on its backend (the float head for wide
    steps). ``widest_rows``: the most rows a step takes logits for, as far as is known;
    ``int8_activations``: the quantized head's rows quantized to int8 (the head is timed so)."""
    head = None
    held: list[QuantizedWeight | PackedQuantWeight] = []  # the blocks kept, each once
    if "lm_head" in weights:
        head = QuantizedHead(kernels, weights["lm_head"], model.lm_head, int8_activations)
        model.add_module("lm_head", head)  # a module of another type
        held.append(head.weight_p)
    if "embed_tokens" in weights:
        w = weights["embed_tokens"]
        assert tuple(model.embed_tokens.weight.shape) == (w.out_features, w.in_features)
        if head is None or weights["lm_head"] is not w:
            held.append(w)
        # Tied: the rows come from the head's panels, so the blocks are held once.
        model.add_module("embed_tokens", QuantizedEmbedding(held[-1], dtype))
    logger.info(
        "GGUF blocks kept for %s (%.1f MiB); LM head: %s",
        " and ".join(sorted(weights)),
        sum(w.nbytes for w in held) / 2**20,
        head.settle(dtype, widest_rows) if head is not None else "no LM head blocks",
    )
