"""The embedding and the LM head on quantized blocks (quantized_embeddings.py): lookups give
exactly the dequantized rows, the head gives F.linear on the dequantized weight at every
row count, on its quantized path for narrow steps and its float one beyond."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc.model.native import load_kernels
from engine_svc.model.native.quant import quantize_int4, quantize_int8
from engine_svc.model.native_layers import NativeLinear
from engine_svc.model.quantized_embeddings import NARROW_CANDIDATES, NARROW_ROWS, QuantizedEmbedding, SplitHead

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_lookups_are_the_dequantized_rows(quantize):
    torch.manual_seed(0)
    qw = quantize(torch.randn(300, 64) * 0.1)
    ids = torch.tensor([[5, 0, 299], [5, 17, 42]])
    got = QuantizedEmbedding(qw, torch.float32)(ids)
    assert got.shape == (2, 3, 64) and torch.equal(got, qw.dequantize()[ids])
    assert torch.equal(QuantizedEmbedding(qw, torch.bfloat16)(ids), qw.dequantize()[ids].bfloat16())


@pytest.fixture
def kernels():
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the native kernels do not load here")
    return kernels


def test_the_head_takes_the_quantized_blocks_for_narrow_steps_only(kernels):
    torch.manual_seed(1)
    qw = quantize_int8(torch.randn(1000, 96) * 0.1)
    ref = qw.dequantize()
    wide = NativeLinear(kernels, kernels.pack(ref, None, torch.float32))
    head = SplitHead(kernels, qw, wide)
    for rows in (1, NARROW_ROWS, NARROW_ROWS + 1, 64):
        x = torch.randn(rows, 96)
        got, want = head(x), F.linear(x, ref)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        # Which path ran: at one row the two sum in different orders, so their bits differ
        # somewhere (wider, the quantized GEMM runs the float GEMM's own tile: the same bits).
        quantized, packed = kernels.qgemm(x, head.weight_p), wide(x)
        if rows == 1:
            assert not torch.equal(quantized, packed)
        assert torch.equal(got, quantized if rows <= NARROW_ROWS else packed), rows


def test_the_heads_crossover_is_timed_and_followed(kernels):
    torch.manual_seed(2)
    qw = quantize_int8(torch.randn(4096, 96) * 0.1)
    wide = NativeLinear(kernels, kernels.pack(qw.dequantize(), None, torch.float32))
    head = SplitHead(kernels, qw, wide)
    assert head.choose_narrow_rows(torch.float32) in (NARROW_ROWS, *NARROW_CANDIDATES)
    head.narrow_rows = 4
    for rows, quantized in ((4, True), (5, False)):
        x = torch.randn(rows, 96)
        assert torch.equal(head(x), kernels.qgemm(x, head.weight_p) if quantized else wide(x)), rows
