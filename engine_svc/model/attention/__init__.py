"""Paged attention over a block-table KV cache; the same SDPA code runs on CPU and CUDA.

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

    layout.py    BatchLayout: the padded block table and per-request lengths every builder reads
    sdpa.py      SdpaDecode, SdpaPrefill: gathers and masks for F.scaled_dot_product_attention
    native.py    NativeDecode, NativePrefill: int32 tables for the native CPU kernels
    metadata.py  AttentionMetadata: one decode and one prefill value per step, chosen by backend;
                 AttentionSetup: what a model's steps build it with
    paged.py     paged_attention: writes K/V, then dispatches on those values' types
"""

from engine_svc.model.attention.layout import KVCache, flat_positions
from engine_svc.model.attention.metadata import AttentionMetadata, AttentionSetup
from engine_svc.model.attention.paged import paged_attention, write_kv
from engine_svc.model.attention.sdpa import workspace_tokens

__all__ = [
    "AttentionMetadata",
    "AttentionSetup",
    "KVCache",
    "flat_positions",
    "paged_attention",
    "workspace_tokens",
    "write_kv",
]
