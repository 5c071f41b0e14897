"""AttentionMetadata: the step's per-layer-invariant indices, one small value per backend.

    decode:  SdpaDecode (gathered groups, masks)  | NativeDecode (block table, lengths) | None
    prefill: SdpaPrefill (one SDPA call a chunk)  | NativePrefill (one kernel call)     | None

Built once per step and read by every layer; ``paged_attention`` dispatches on the types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.model.attention.layout import BatchLayout, KVCache, flat_positions
from engine_svc.model.attention.native import NativeDecode, NativePrefill
from engine_svc.model.attention.sdpa import DECODE_GROUP_SIZE, SdpaDecode, SdpaPrefill
from engine_svc.model.native import NativeKernels


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: flat cache slot of each row's K/V
    num_decodes: int
    decode: SdpaDecode | NativeDecode | None  # None: no decode rows this step
    prefill: SdpaPrefill | NativePrefill | None  # None: no prefill chunks this step

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
        ``dtype`` (the model's). ``positions`` is ``flat_positions(query_lens, starts)`` (CPU)
        when the caller has it already. The ``workspace`` size caps how many decode rows
        share one gather. With ``kernels``, decode rows go to them, and with
        ``native_prefill`` prefill chunks too; the rest to SDPA.
        """
        layout = BatchLayout.build(query_lens, starts, block_tables, block_size)
        if positions is None:
            positions = flat_positions(query_lens, starts)
        num_decodes = layout.num_decodes
        decode: SdpaDecode | NativeDecode | None = None
        if num_decodes and kernels is not None:
            decode = NativeDecode.build(layout, kernels)
        elif num_decodes:
            decode = SdpaDecode.build(
                layout,
                device=device,
                dtype=dtype,
                workspace=workspace,
                decode_group_size=decode_group_size or DECODE_GROUP_SIZE,
            )
        prefill: SdpaPrefill | NativePrefill | None = None
        if num_decodes < layout.num_reqs and kernels is not None and native_prefill:
            prefill = NativePrefill.build(layout, kernels)
        elif num_decodes < layout.num_reqs:
            prefill = SdpaPrefill.build(layout, device=device, dtype=dtype, workspace=workspace)
        return cls(layout.slot_mapping(positions).to(device, non_blocking=True), num_decodes, decode, prefill)
