"""Paged attention on the native CPU kernels (engine_svc/model/native/attention.c).

Nothing is gathered and no mask is built: one call per layer reads every decode row's
blocks in place, and one more runs every prefill chunk over the paged cache, which holds
the chunk's own K/V by then, each query vector with the decode kernel's arithmetic
(native/attention_row.h: a token's output has the same bits from either call). The kernels take the step's block
table as int32 ``[rows, max_blocks]`` and per-chunk rows, starts and lengths as int32, and
read q's heads in place: ``[num_tokens, heads * hd]`` with q's row stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.model.attention.layout import BatchLayout, KVCache
from engine_svc.model.native import NativeKernels


@dataclass(frozen=True)
class NativeDecode:
    """The step's decode rows (the first ``num_rows`` rows), one kernel call per layer."""

    kernels: NativeKernels
    num_rows: int
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    ctx_lens: torch.Tensor  # [num_decodes] int32
    max_ctx_len: int

    @classmethod
    def build(cls, layout: BatchLayout, kernels: NativeKernels) -> NativeDecode:
        n = layout.num_decodes
        return cls(
            kernels,
            n,
            layout.table[:n].to(torch.int32),
            torch.tensor(layout.seq_lens[:n], dtype=torch.int32),
            max(layout.seq_lens[:n]),
        )


@dataclass(frozen=True)
class NativePrefill:
    """The step's prefill chunks (the rows after the decodes), one kernel call per layer."""

    kernels: NativeKernels
    block_table: torch.Tensor  # [num_chunks, max_blocks] int32
    chunk_rows: torch.Tensor  # [num_chunks] int32: first row of each chunk
    chunk_starts: torch.Tensor  # [num_chunks] int32: position of that row
    chunk_lens: torch.Tensor  # [num_chunks] int32

    @classmethod
    def build(cls, layout: BatchLayout, kernels: NativeKernels) -> NativePrefill:
        n = layout.num_decodes
        lens = torch.tensor(layout.query_lens[n:], dtype=torch.int32)
        return cls(
            kernels,
            layout.table[n:].to(torch.int32),
            torch.cumsum(lens, 0, dtype=torch.int32) - lens + n,
            torch.tensor(layout.starts[n:], dtype=torch.int32),
            lens,
        )


def _q_rows(q: torch.Tensor) -> torch.Tensor:
    """q [num_tokens, heads, hd] as the kernels read it: [num_tokens, heads * hd], q's row stride."""
    return q.as_strided((q.shape[0], q.shape[1] * q.shape[2]), (q.stride(0), 1))


def native_decode(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, decode: NativeDecode, scale: float) -> None:
    n = decode.num_rows
    decode.kernels.decode_attention(
        out[:n],
        _q_rows(q)[:n],
        kv_cache[0],
        kv_cache[1],
        decode.block_table,
        decode.ctx_lens,
        decode.max_ctx_len,
        scale,
    )


def native_prefill(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, prefill: NativePrefill, scale: float) -> None:
    prefill.kernels.prefill_attention(
        out, _q_rows(q), kv_cache[0], kv_cache[1],
        prefill.block_table, prefill.chunk_rows, prefill.chunk_starts, prefill.chunk_lens, scale,
    )  # fmt: skip
