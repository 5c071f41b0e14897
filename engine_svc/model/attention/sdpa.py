"""Paged attention through ``F.scaled_dot_product_attention``: CPU and CUDA alike.

* Decodes run in a few batched SDPA calls: each group's blocks are gathered into a
  reusable workspace, padded to the group's longest context and masked. Decodes are
  grouped in the order given, so callers sort them by context length to keep padding low;
  groups also keep each gather small enough to stay in cache before SDPA reads it.
  A decode row has one query per head, so the query heads that share a KV head are laid
  along the query-length axis: q ``[n, kv_heads, group, head_dim]`` meets K/V
  ``[n, kv_heads, ctx, head_dim]`` with no KV expansion.
* Each prefill chunk has its own SDPA call: ``is_causal`` on its fresh K/V when it starts
  at position 0 (nothing to gather), else a gather plus an offset causal mask.

Masks are additive in the model's dtype, which SDPA takes as is. With a sliding window
``w`` a row at position ``p`` attends to keys in ``(p - w, p]`` only (transformers'
``sliding_window_overlay``); blocks wholly before the window are still gathered (and
masked), and no block is freed for falling out of a window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_svc.model.attention.layout import BatchLayout, KVCache

# Decodes per gather + SDPA call. One call for all decodes gathers tens of MB per layer,
# which has left the CPU cache by the time SDPA reads it; groups of 8 keep it cached and
# measured ~1.3x faster than one group of 64 (2-core CPU, 135M model, context ~400) while
# per-call overhead stays small. The workspace holds a group of ~1k-token contexts.
DECODE_GROUP_SIZE = 8
DECODE_WORKSPACE_TOKENS = 8192


@dataclass(frozen=True)
class DecodeGroup:
    """``num_rows`` consecutive single-token rows starting at ``row_start``."""

    row_start: int
    num_rows: int
    num_blocks: int  # blocks gathered per row: the group's longest context, rounded up
    block_ids: torch.Tensor  # [num_rows * num_blocks] long, row-major, padded with block 0
    mask: torch.Tensor  # [num_rows, 1, 1, num_blocks * block_size] additive: 0 = attend, -inf = padding


@dataclass(frozen=True)
class SdpaDecode:
    """The step's decode rows, in groups that each take one gather and one SDPA call."""

    block_size: int
    groups: list[DecodeGroup]
    workspace: KVCache | None  # K and V gather buffers [tokens, kv_heads, head_dim], reused by every layer

    @classmethod
    def build(
        cls,
        layout: BatchLayout,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        workspace: KVCache | None,
        decode_group_size: int,
        sliding_window: int | None = None,
    ) -> SdpaDecode:
        """Rows per group: at most ``decode_group_size``, and the padded gather must fit the
        workspace (a single row that does not fit gathers into fresh memory)."""
        block_size, table = layout.block_size, layout.table
        capacity = workspace[0].shape[0] if workspace is not None else table.shape[1] * block_size * decode_group_size
        groups: list[DecodeGroup] = []
        i = 0
        while i < layout.num_decodes:
            # Grow the group while the padded gather fits the workspace.
            j, group_blocks = i, 0
            while j < layout.num_decodes and j - i < decode_group_size:
                nb = max(group_blocks, layout.blocks_needed[j])
                if j > i and (j + 1 - i) * nb * block_size > capacity:
                    break
                group_blocks, j = nb, j + 1
            ctx = torch.tensor(layout.seq_lens[i:j], dtype=torch.long)
            keys = torch.arange(group_blocks * block_size)[None, :]
            allowed = keys < ctx[:, None]
            if sliding_window is not None:
                allowed &= keys >= ctx[:, None] - sliding_window  # the row's position is ctx - 1
            mask = _additive(allowed, dtype)
            groups.append(
                DecodeGroup(
                    row_start=i,
                    num_rows=j - i,
                    num_blocks=group_blocks,
                    block_ids=table[i:j, :group_blocks].reshape(-1).to(device),
                    mask=mask.view(j - i, 1, 1, -1).to(device),
                )
            )
            i = j
        return cls(block_size, groups, workspace)


@dataclass(frozen=True)
class PrefillChunk:
    """``query_len`` rows of one request starting at row ``row_start`` and position ``start``."""

    row_start: int
    query_len: int
    start: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor | None  # [ceil((start + query_len) / block_size)] long; None when start == 0
    # [query_len, start + query_len] additive (0 / -inf); None for plain causal (start == 0, no window cut)
    mask: torch.Tensor | None


@dataclass(frozen=True)
class SdpaPrefill:
    """The step's prefill chunks, one SDPA call each."""

    chunks: list[PrefillChunk]
    workspace: KVCache | None

    @classmethod
    def build(
        cls,
        layout: BatchLayout,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        workspace: KVCache | None,
        sliding_window: int | None = None,
    ) -> SdpaPrefill:
        chunks: list[PrefillChunk] = []
        row = layout.num_decodes
        for r in range(layout.num_decodes, layout.num_reqs):
            n, s = layout.query_lens[r], layout.starts[r]
            block_ids: torch.Tensor | None = None
            mask: torch.Tensor | None = None
            if s > 0:
                block_ids = layout.table[r, : layout.blocks_needed[r]].to(device)
            if s > 0 or (sliding_window is not None and sliding_window < n):
                keys, queries = torch.arange(s + n)[None, :], torch.arange(s, s + n)[:, None]
                allowed = keys <= queries
                if sliding_window is not None:
                    allowed &= keys > queries - sliding_window
                mask = _additive(allowed, dtype).to(device)
            chunks.append(PrefillChunk(row, n, s, block_ids, mask))
            row += n
        return cls(chunks, workspace)


def workspace_tokens(max_model_len: int, block_size: int) -> int:
    """Tokens the gather workspace holds: one whole context, or a full decode group of
    typical contexts, whichever is larger."""
    max_blocks = -(-max_model_len // block_size)
    return max(max_blocks * block_size, DECODE_WORKSPACE_TOKENS)


def sdpa_decode(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, decode: SdpaDecode, scale: float) -> None:
    """Fills the decode rows of ``out`` [num_tokens, heads, hd] from q [num_tokens, heads, hd]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache[0].shape[2]
    group = num_heads // num_kv_heads
    for g in decode.groups:
        n, ctx = g.num_rows, g.num_blocks * decode.block_size
        k_ctx, v_ctx = _gather(kv_cache, g.block_ids, decode.workspace)  # [n * blocks, block_size, kv_heads, hd]
        k_ctx = k_ctx.view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, ctx, hd]
        v_ctx = v_ctx.view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        q_g = q[g.row_start : g.row_start + n].reshape(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q_g, k_ctx, v_ctx, attn_mask=g.mask, scale=scale)
        out[g.row_start : g.row_start + n] = o.view(n, num_heads, head_dim)


def sdpa_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    prefill: SdpaPrefill,
    scale: float,
) -> None:
    """Fills the prefill rows of ``out``; a chunk at position 0 reads its own k/v
    [num_tokens, kv_heads, hd] directly (as the cache holds them: rounded where it is
    narrower), a later one gathers its context from the cache."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    for c in prefill.chunks:
        rows = slice(c.row_start, c.row_start + c.query_len)
        q_c = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, hd]
        if c.start == 0:
            k_c, v_c = k[rows], v[rows]  # [query_len, kv_heads, hd]
            if kv_cache[0].dtype != k.dtype:  # what the cache holds: a bfloat16 cache's rounding
                k_c, v_c = k_c.to(kv_cache[0].dtype).to(k.dtype), v_c.to(kv_cache[0].dtype).to(k.dtype)
        else:
            assert c.block_ids is not None
            k_c, v_c = _gather(kv_cache, c.block_ids, prefill.workspace)
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
            enable_gqa=num_heads > num_kv_heads,
        )  # [1, heads, query_len, hd]
        out[rows] = o[0].transpose(0, 1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive mask; SDPA would otherwise convert a bool
    mask on every call, i.e. once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _gather(kv_cache: KVCache, block_ids: torch.Tensor, workspace: KVCache | None) -> KVCache:
    """Copy whole blocks out of the cache: two tensors ``[len(block_ids), block_size, kv_heads,
    head_dim]`` in the workspace's dtype (a bfloat16 cache beside float32 rows widened)."""
    k_cache, v_cache = kv_cache
    num_blocks, block_size = block_ids.shape[0], k_cache.shape[1]
    num_tokens = num_blocks * block_size
    if workspace is None or num_tokens > workspace[0].shape[0]:
        dtype = k_cache.dtype if workspace is None else workspace[0].dtype
        return k_cache.index_select(0, block_ids).to(dtype), v_cache.index_select(0, block_ids).to(dtype)
    shape = (num_blocks, *k_cache.shape[1:])
    k_ws, v_ws = workspace[0][:num_tokens].view(shape), workspace[1][:num_tokens].view(shape)
    if k_ws.dtype != k_cache.dtype:
        return k_ws.copy_(k_cache.index_select(0, block_ids)), v_ws.copy_(v_cache.index_select(0, block_ids))
    return torch.index_select(k_cache, 0, block_ids, out=k_ws), torch.index_select(v_cache, 0, block_ids, out=v_ws)
