"""paged_attention: write the step's K/V into the cache, then attend with each part's backend."""

from __future__ import annotations

import torch

from engine_svc.model.attention.layout import KVCache
from engine_svc.model.attention.metadata import AttentionMetadata
from engine_svc.model.attention.native import NativeDecode, NativePrefill, native_decode, native_prefill
from engine_svc.model.attention.sdpa import SdpaDecode, SdpaPrefill, sdpa_decode, sdpa_prefill
from engine_svc.model.native import NativeKernels


def write_kv(
    kv_cache: KVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kernels: NativeKernels | None = None,
) -> None:
    """Store the step's k, v ``[num_tokens, kv_heads, head_dim]`` at their slots (rounded
    to the cache's dtype where it is narrower: ``--kv-cache-dtype bfloat16``): with the
    native kernels, one copy per row (torch's ``index_copy_`` took ~3% of a prefill step
    on views of the fused qkv projection), else, or for rows they do not take, by torch."""
    k_cache, v_cache = kv_cache
    if kernels is not None and kernels.write_kv(k_cache, v_cache, k, v, slot_mapping):
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q ``[num_tokens, heads, hd]``, k/v ``[num_tokens, kv_heads, hd]`` -> ``[num_tokens, heads, hd]``.

    Writes k/v into ``kv_cache`` first, so decode rows see their own token and native
    prefill reads its chunk's own K/V from the cache. Decode and prefill rows are disjoint.
    A layer with a ``sliding_window`` reads the step's metadata for that window.
    """
    meta = meta.for_window(sliding_window)
    native = [p.kernels for p in (meta.prefill, meta.decode) if isinstance(p, (NativePrefill, NativeDecode))]
    write_kv(kv_cache, k, v, meta.slot_mapping, native[0] if native else None)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, heads, head_dim]
    match meta.decode:
        case NativeDecode() as native_d:
            native_decode(out, q, kv_cache, native_d, scale)
        case SdpaDecode() as sdpa_d:
            sdpa_decode(out, q, kv_cache, sdpa_d, scale)
        case None:
            pass
    match meta.prefill:
        case NativePrefill() as native_p:
            native_prefill(out, q, kv_cache, native_p, scale)
        case SdpaPrefill() as sdpa_p:
            sdpa_prefill(out, q, k, v, kv_cache, sdpa_p, scale)
        case None:
            pass
    return out
