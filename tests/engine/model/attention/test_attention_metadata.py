"""AttentionMetadata: one value per backend for the decode rows and one for the prefill
chunks, with the index tensors each backend reads (the SDPA layout is held in
tests/engine/model/test_model.py::test_attention_metadata_layout)."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine_svc.model.attention import AttentionMetadata
from engine_svc.model.attention.native import NativeDecode, NativePrefill
from engine_svc.model.attention.sdpa import SdpaDecode, SdpaPrefill
from engine_svc.model.native import load_kernels

# Two decodes (contexts 10 and 1), then a fresh 3-token chunk and a 2-token chunk at position 4.
STEP = ([1, 1, 3, 2], [9, 0, 0, 4], [[5, 6, 8], [7], [1], [2, 3]])


@pytest.fixture(scope="module")
def kernels():
    loaded = load_kernels() if shutil.which("cc") else None
    if loaded is None:
        pytest.skip("native kernels unavailable on this machine")
    return loaded


def test_the_native_kernels_get_int32_tables_and_nothing_gathered(kernels):
    meta = AttentionMetadata.build(*STEP, block_size=4, device="cpu", kernels=kernels, native_prefill=True)
    assert isinstance(meta.decode, NativeDecode) and isinstance(meta.prefill, NativePrefill)
    d, p = meta.decode, meta.prefill
    assert d.num_rows == meta.num_decodes == 2
    assert d.block_table.dtype == torch.int32 and d.block_table.tolist() == [[5, 6, 8], [7, 0, 0]]
    assert (d.ctx_lens.tolist(), d.max_ctx_len) == ([10, 1], 10)
    assert p.block_table.tolist() == [[1, 0, 0], [2, 3, 0]]
    assert (p.chunk_rows.tolist(), p.chunk_starts.tolist(), p.chunk_lens.tolist()) == ([2, 5], [0, 4], [3, 2])
    assert all(t.dtype == torch.int32 for t in (p.chunk_rows, p.chunk_starts, p.chunk_lens))
    assert meta.slot_mapping.tolist() == [8 * 4 + 1, 7 * 4, 4, 5, 6, 3 * 4, 3 * 4 + 1]


def test_native_decode_beside_sdpa_prefill_where_the_prefill_kernel_does_not_fit(kernels):
    meta = AttentionMetadata.build(*STEP, block_size=4, device="cpu", kernels=kernels, native_prefill=False)
    assert isinstance(meta.decode, NativeDecode) and isinstance(meta.prefill, SdpaPrefill)
    assert [(c.row_start, c.query_len, c.start) for c in meta.prefill.chunks] == [(2, 3, 0), (5, 2, 4)]


def test_a_part_with_no_rows_has_no_value():
    only_prefill = AttentionMetadata.build([3], [0], [[1]], block_size=4, device="cpu")
    assert (only_prefill.num_decodes, only_prefill.decode) == (0, None)
    assert isinstance(only_prefill.prefill, SdpaPrefill)
    only_decodes = AttentionMetadata.build([1, 1], [3, 5], [[0], [1, 2]], block_size=4, device="cpu")
    assert isinstance(only_decodes.decode, SdpaDecode) and only_decodes.prefill is None
    assert [g.num_rows for g in only_decodes.decode.groups] == [2]


def test_a_sliding_window_cuts_the_masks_of_its_own_value(kernels):
    """Keys in (position - window, position] only, on SDPA even where the native kernels
    take the full-attention layers; the full value is unchanged."""
    meta = AttentionMetadata.build(
        *STEP, block_size=4, device="cpu", kernels=kernels, native_prefill=True, sliding_window=3
    )
    assert isinstance(meta.decode, NativeDecode) and meta.for_window(None) is meta
    sliding = meta.for_window(3)
    assert sliding.sliding_window == 3 and torch.equal(sliding.slot_mapping, meta.slot_mapping)
    assert isinstance(sliding.decode, SdpaDecode) and isinstance(sliding.prefill, SdpaPrefill)
    decode_allowed = sliding.decode.groups[0].mask[:, 0, 0] == 0  # [rows, keys]
    assert decode_allowed[0].nonzero().flatten().tolist() == [7, 8, 9]  # position 9 sees 7..9
    assert decode_allowed[1].nonzero().flatten().tolist() == [0]
    fresh, later = sliding.prefill.chunks
    assert fresh.mask is None  # 3 rows from position 0: the window cuts nothing
    assert (later.mask == 0).nonzero().tolist() == [[0, 2], [0, 3], [0, 4], [1, 3], [1, 4], [1, 5]]
    with pytest.raises(ValueError, match="sliding window 5"):
        meta.for_window(5)
