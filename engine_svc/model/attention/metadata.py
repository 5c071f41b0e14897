"""AttentionMetadata: the step's per-layer-invariant indices, one small value per backend.

    decode:  SdpaDecode (gathered groups, masks)  | NativeDecode (block table, lengths) | None
    prefill: SdpaPrefill (one SDPA call a chunk)  | NativePrefill (one kernel call)     | None

Built once per step and read by every layer; ``paged_attention`` dispatches on the types.
A model with sliding-window layers gets a second value, ``sliding``, for those layers: the
same slots, masks cut to the window, always on SDPA (the native kernels have no window).
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
    sliding_window: int | None = None  # the window this value's masks apply; None = full attention
    sliding: AttentionMetadata | None = None  # for the sliding-window layers, when the model has any

    def for_window(self, sliding_window: int | None) -> AttentionMetadata:
        """The value a layer with this window (None: full attention) reads."""
        if sliding_window is None:
            return self
        if self.sliding is None or self.sliding.sliding_window != sliding_window:
            raise ValueError(f"attention metadata was built without sliding window {sliding_window}")
        return self.sliding

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
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """Index tensors for one step.

        Request ``i`` contributes ``query_lens[i]`` consecutive rows at positions
        ``starts[i] ..``; its ``block_tables[i]`` covers at least ``starts[i] + query_lens[i]``
        tokens. Requests with ``query_len == 1`` must come first. Masks are additive in
        ``dtype`` (the model's). ``positions`` is ``flat_positions(query_lens, starts)`` (CPU)
        when the caller has it already. The ``workspace`` size caps how many decode rows
        share one gather. With ``kernels``, decode rows go to them, and with
        ``native_prefill`` prefill chunks too; the rest to SDPA. ``sliding_window``
        (the model's sliding layers' window) adds the ``sliding`` value.
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
        slot_mapping = layout.slot_mapping(positions).to(device, non_blocking=True)
        sliding = None
        if sliding_window is not None:
            sliding = cls(
                slot_mapping,
                num_decodes,
                SdpaDecode.build(
                    layout,
                    device=device,
                    dtype=dtype,
                    workspace=workspace,
                    decode_group_size=decode_group_size or DECODE_GROUP_SIZE,
                    sliding_window=sliding_window,
                )
                if num_decodes
                else None,
                SdpaPrefill.build(
                    layout, device=device, dtype=dtype, workspace=workspace, sliding_window=sliding_window
                )
                if num_decodes < layout.num_reqs
                else None,
                sliding_window,
            )
        return cls(slot_mapping, num_decodes, decode, prefill, sliding=sliding)


@dataclass(frozen=True)
class AttentionSetup:
    """What one model's steps build their ``AttentionMetadata`` with, fixed at load: the
    runner's model and a speculative draft model each hold one."""

    block_size: int
    device: torch.device
    dtype: torch.dtype
    workspace: KVCache
    kernels: NativeKernels | None
    native_prefill: bool
    sliding_window: int | None

    def metadata(
        self, query_lens: list[int], starts: list[int], block_tables: list[list[int]], positions: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens,
            starts,
            block_tables,
            positions=positions,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            workspace=self.workspace,
            kernels=self.kernels,
            native_prefill=self.native_prefill,
            sliding_window=self.sliding_window,
        )
