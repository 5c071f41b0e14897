"""Paged attention in plain PyTorch; the same code runs on CPU and CUDA.

KV cache layout, one pair of tensors per layer::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    block_id:    0              1              2              3
              ┌──────────────┬──────────────┬──────────────┬──────────────┐
              │ s0 s1 .. s15 │ s0 s1 .. s15 │ s0 s1 .. s15 │ s0 s1 .. s15 │   (block_size = 16)
              └──────────────┴──────────────┴──────────────┴──────────────┘
    flat slot = block_id * block_size + offset;  k_cache.view(-1, kv_heads, head_dim)[slot]

    request A, block table [2, 0]:  token position p lives in slot
        block_table[p // block_size] * block_size + p % block_size
        positions 0..15 -> block 2, positions 16..31 -> block 0

A step's tokens form one flattened batch ``[num_tokens, ...]`` with no padding. Rows are
grouped by request; single-token requests (decodes) lead the batch, multi-token chunks
(prefills) follow::

    rows: | d0 | d1 | d2 | chunk of B (start 0, 5 tokens) | chunk of C (start 32, 3 tokens) |

Every layer first writes the step's K/V into the cache by slot mapping, then reads each
request's context back through its block table, so a row attends to all cached tokens of
its request plus the rows of its own chunk up to itself (causal with an offset).

* Decodes run in a few batched SDPA calls: each group's blocks are gathered into a
  reusable workspace, padded to the group's longest context and masked. Decodes are
  grouped in the order given, so callers sort them by context length to keep padding low;
  groups also keep each gather small enough to stay in cache before SDPA reads it.
  A decode row has one query per head, so the query heads that share a KV head are laid
  along the query-length axis: q ``[n, kv_heads, group, head_dim]`` meets K/V
  ``[n, kv_heads, ctx, head_dim]`` with no KV expansion.
* Each prefill chunk has its own SDPA call: ``is_causal`` on its fresh K/V when it starts
  at position 0 (nothing to gather), else a gather plus an offset causal mask.
* On CPU, when the native kernels (engine_svc/model/native) are loaded, nothing is
  gathered and no mask is built: one call per layer reads every decode row's blocks in
  place, and (``native_prefill``) one more call runs every prefill chunk, flash-attention
  style, over the paged cache, which holds the chunk's own K/V by then. They take the
  step's block table as int32 ``[rows, max_blocks]`` and per-chunk rows, starts and
  lengths as int32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_svc.model.native import NativeKernels

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]

# Decodes per gather + SDPA call. One call for all decodes gathers tens of MB per layer,
# which has left the CPU cache by the time SDPA reads it; groups of 8 keep it cached and
# measured ~1.3x faster than one group of 64 (2-core CPU, 135M model, context ~400) while
# per-call overhead stays small. The workspace holds a group of ~1k-token contexts.
DECODE_GROUP_SIZE = 8
DECODE_WORKSPACE_TOKENS = 8192


@dataclass
class DecodeGroup:
    """``num_rows`` consecutive single-token rows starting at ``row_start``."""

    row_start: int
    num_rows: int
    num_blocks: int  # blocks gathered per row: the group's longest context, rounded up
    block_ids: torch.Tensor  # [num_rows * num_blocks] long, row-major, padded with block 0
    mask: torch.Tensor  # [num_rows, 1, 1, num_blocks * block_size] additive: 0 = attend, -inf = padding


@dataclass
class PrefillChunk:
    """``query_len`` rows of one request starting at row ``row_start`` and position ``start``."""

    row_start: int
    query_len: int
    start: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor | None  # [ceil((start + query_len) / block_size)] long; None when start == 0
    mask: torch.Tensor | None  # [query_len, start + query_len] additive (0 / -inf); None when start == 0 (plain causal)


@dataclass
class AttentionMetadata:
    """Per-step indices shared by every layer. Built once per step by ``build``."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] long: flat cache slot of each row's K/V
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: KVCache | None = None  # K and V gather buffers [tokens, kv_heads, head_dim], reused by every layer
    num_decodes: int = 0
    # Native kernels (set: decodes go through them instead of decode_groups; with
    # native_prefill, prefill chunks too instead of prefills).
    kernels: NativeKernels | None = None
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_ctx_lens: torch.Tensor | None = None  # [num_decodes] int32
    max_decode_ctx_len: int = 0
    prefill_block_table: torch.Tensor | None = None  # [num_chunks, max_blocks] int32
    prefill_rows: torch.Tensor | None = None  # [num_chunks] int32: first row of each chunk
    prefill_starts: torch.Tensor | None = None  # [num_chunks] int32: position of that row
    prefill_lens: torch.Tensor | None = None  # [num_chunks] int32

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        starts: list[int],
        block_tables: list[list[int]],
        *,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        positions: torch.Tensor | None = None,
        workspace: KVCache | None = None,
        decode_group_size: int | None = None,
        kernels: NativeKernels | None = None,
        native_prefill: bool = False,
    ) -> AttentionMetadata:
        """Index tensors for one step.

        Request ``i`` contributes ``query_lens[i]`` consecutive rows at positions
        ``starts[i] ..``; its ``block_tables[i]`` covers at least ``starts[i] + query_lens[i]``
        tokens. Requests with ``query_len == 1`` must come first. Masks are additive in
        ``dtype`` (the model's), which SDPA takes as is. ``positions`` is
        ``flat_positions(query_lens, starts)`` (CPU) when the caller has it already. The
        ``workspace`` size caps how many decode rows share one gather. With ``kernels``,
        decode rows are left to them (no groups are built), and with ``native_prefill``
        prefill chunks too (no chunks, masks or gathers).
        """
        decode_group_size = decode_group_size or DECODE_GROUP_SIZE
        num_reqs = len(query_lens)
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        if any(n == 1 for n in query_lens[num_decodes:]):
            raise ValueError("single-token requests must lead the batch")
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        for r, (table_row, nb) in enumerate(zip(block_tables, blocks_needed)):
            if len(table_row) < nb:
                raise ValueError(f"request {r}: block table has {len(table_row)} blocks, {nb} needed")

        # One padded block table for the whole step; index math runs as tensor ops.
        max_blocks = max(blocks_needed)
        table = torch.tensor(
            [bt[:nb] + [0] * (max_blocks - nb) for bt, nb in zip(block_tables, blocks_needed)], dtype=torch.long
        )  # [num_reqs, max_blocks]
        if positions is None:
            positions = flat_positions(query_lens, starts)
        req_of_row = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(query_lens))  # [num_tokens]
        slot_mapping = table[req_of_row, positions // block_size] * block_size + positions % block_size

        meta = cls(
            block_size=block_size,
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            workspace=workspace,
            num_decodes=num_decodes,
        )
        if kernels is not None:
            meta.kernels = kernels
            if num_decodes:
                meta.decode_block_table = table[:num_decodes].to(torch.int32)
                meta.decode_ctx_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.int32)
                meta.max_decode_ctx_len = max(seq_lens[:num_decodes])
            if native_prefill and num_decodes < num_reqs:
                chunk_lens = query_lens[num_decodes:]
                meta.prefill_block_table = table[num_decodes:].to(torch.int32)
                meta.prefill_lens = torch.tensor(chunk_lens, dtype=torch.int32)
                meta.prefill_starts = torch.tensor(starts[num_decodes:], dtype=torch.int32)
                meta.prefill_rows = (
                    torch.cumsum(meta.prefill_lens, 0, dtype=torch.int32) - meta.prefill_lens + num_decodes
                )
                return meta
        grouped = 0 if meta.kernels is not None else num_decodes  # decode rows left to SDPA groups
        # Decode rows per group: at most decode_group_size, and the padded gather must fit
        # the workspace (a single row that does not fit gathers into fresh memory).
        capacity = workspace[0].shape[0] if workspace is not None else max_blocks * block_size * decode_group_size
        i = 0
        while i < grouped:
            # Grow the group while the padded gather fits the workspace.
            j, group_blocks = i, 0
            while j < grouped and j - i < decode_group_size:
                nb = max(group_blocks, blocks_needed[j])
                if j > i and (j + 1 - i) * nb * block_size > capacity:
                    break
                group_blocks, j = nb, j + 1
            ctx = torch.tensor(seq_lens[i:j], dtype=torch.long)
            group_mask = _additive(torch.arange(group_blocks * block_size)[None, :] < ctx[:, None], dtype)
            meta.decode_groups.append(
                DecodeGroup(
                    row_start=i,
                    num_rows=j - i,
                    num_blocks=group_blocks,
                    block_ids=table[i:j, :group_blocks].reshape(-1).to(device),
                    mask=group_mask.view(j - i, 1, 1, -1).to(device),
                )
            )
            i = j
        row = num_decodes
        for r in range(num_decodes, num_reqs):
            n, s = query_lens[r], starts[r]
            block_ids: torch.Tensor | None = None
            chunk_mask: torch.Tensor | None = None
            if s > 0:
                block_ids = table[r, : blocks_needed[r]].to(device)
                chunk_mask = _additive(torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None], dtype).to(
                    device
                )
            meta.prefills.append(PrefillChunk(row, n, s, block_ids, chunk_mask))
            row += n
        return meta


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive mask; SDPA would otherwise convert a bool
    mask on every call, i.e. once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def flat_positions(query_lens: list[int], starts: list[int]) -> torch.Tensor:
    """Position of every row of the flattened batch: [num_tokens] long, on CPU."""
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    row_starts = torch.cumsum(q_lens, 0) - q_lens
    offsets = torch.tensor(starts, dtype=torch.long) - row_starts  # position - row, per request
    return torch.arange(int(q_lens.sum())) + torch.repeat_interleave(offsets, q_lens)


def workspace_tokens(max_model_len: int, block_size: int) -> int:
    """Tokens the gather workspace holds: one whole context, or a full decode group of
    typical contexts, whichever is larger."""
    max_blocks = -(-max_model_len // block_size)
    return max(max_blocks * block_size, DECODE_WORKSPACE_TOKENS)


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's k, v ``[num_tokens, kv_heads, head_dim]`` at their slots."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather(kv_cache: KVCache, block_ids: torch.Tensor, workspace: KVCache | None) -> KVCache:
    """Copy whole blocks out of the cache: two tensors ``[len(block_ids), block_size, kv_heads, head_dim]``."""
    k_cache, v_cache = kv_cache
    num_blocks, block_size = block_ids.shape[0], k_cache.shape[1]
    num_tokens = num_blocks * block_size
    if workspace is None or num_tokens > workspace[0].shape[0]:
        return k_cache.index_select(0, block_ids), v_cache.index_select(0, block_ids)
    shape = (num_blocks, *k_cache.shape[1:])
    k = torch.index_select(k_cache, 0, block_ids, out=workspace[0][:num_tokens].view(shape))
    v = torch.index_select(v_cache, 0, block_ids, out=workspace[1][:num_tokens].view(shape))
    return k, v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q ``[num_tokens, heads, hd]``, k/v ``[num_tokens, kv_heads, hd]`` -> ``[num_tokens, heads, hd]``.

    Writes k/v into ``kv_cache`` first, so decode rows see their own token.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, heads, head_dim]

    if meta.kernels is not None:
        # The kernels read q's heads in place: [num_tokens, heads * hd] with q's row stride.
        q_rows = q.as_strided((q.shape[0], num_heads * head_dim), (q.stride(0), 1))
        n = meta.num_decodes
        if n:
            assert meta.decode_block_table is not None and meta.decode_ctx_lens is not None
            meta.kernels.decode_attention(
                out[:n], q_rows[:n], kv_cache[0], kv_cache[1],
                meta.decode_block_table, meta.decode_ctx_lens, meta.max_decode_ctx_len, scale,
            )  # fmt: skip
        if meta.prefill_lens is not None:
            assert meta.prefill_block_table is not None and meta.prefill_rows is not None
            assert meta.prefill_starts is not None
            meta.kernels.prefill_attention(
                out, q_rows, kv_cache[0], kv_cache[1],
                meta.prefill_block_table, meta.prefill_rows, meta.prefill_starts, meta.prefill_lens, scale,
            )  # fmt: skip

    for g in meta.decode_groups:
        n, ctx = g.num_rows, g.num_blocks * meta.block_size
        k_ctx, v_ctx = _gather(kv_cache, g.block_ids, meta.workspace)  # [n * blocks, block_size, kv_heads, hd]
        k_ctx = k_ctx.view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, ctx, hd]
        v_ctx = v_ctx.view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        q_g = q[g.row_start : g.row_start + n].reshape(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q_g, k_ctx, v_ctx, attn_mask=g.mask, scale=scale)
        out[g.row_start : g.row_start + n] = o.view(n, num_heads, head_dim)

    for c in meta.prefills:
        rows = slice(c.row_start, c.row_start + c.query_len)
        q_c = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, hd]
        if c.start == 0:
            k_c, v_c = k[rows], v[rows]  # [query_len, kv_heads, hd]
        else:
            assert c.block_ids is not None
            k_c, v_c = _gather(kv_cache, c.block_ids, meta.workspace)
            seq_len = c.start + c.query_len
            k_c = k_c.view(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, kv_heads, hd]
            v_c = v_c.view(-1, num_kv_heads, head_dim)[:seq_len]
        o = F.scaled_dot_product_attention(
            q_c,
            k_c.transpose(0, 1).unsqueeze(0),
            v_c.transpose(0, 1).unsqueeze(0),
            attn_mask=c.mask,
            is_causal=c.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )  # [1, heads, query_len, hd]
        out[rows] = o[0].transpose(0, 1)
    return out
