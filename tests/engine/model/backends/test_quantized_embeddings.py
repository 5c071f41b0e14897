"""The embedding and the LM head on quantized blocks (model/backends/quantized_embeddings.py): lookups give
exactly the dequantized rows, from the blocks or from a tied head's panels; the head gives
F.linear on the dequantized weight at every row count, on its quantized path for narrow
steps and its float one beyond while it keeps one; the float head is kept only where the
timing at load says it pays."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.model.backends.native_layers import NativeLinear
from engine_svc.model.backends.quantized_embeddings import NARROW_ROWS, QuantizedEmbedding, QuantizedHead
from engine_svc.model.native import load_kernels
from engine_svc.model.native.quant import quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture
def kernels():
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the native kernels do not load here")
    return kernels


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_lookups_are_the_dequantized_rows(quantize):
    torch.manual_seed(0)
    qw = quantize(torch.randn(300, 64) * 0.1)
    ids = torch.tensor([[5, 0, 299], [5, 17, 42]])
    got = QuantizedEmbedding(qw, torch.float32)(ids)
    assert got.shape == (2, 3, 64) and torch.equal(got, qw.dequantize()[ids])
    assert torch.equal(QuantizedEmbedding(qw, torch.bfloat16)(ids), qw.dequantize()[ids].bfloat16())


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_lookups_in_a_tied_heads_panels_equal_those_in_its_blocks(kernels, quantize):
    torch.manual_seed(3)
    qw = quantize(torch.randn(301, 96) * 0.1)  # 301 rows: the last panel is part padding
    packed = kernels.qpack(qw)
    ids = torch.tensor([[300, 0, 1, packed.panel_width - 1], [packed.panel_width, 299, 5, 5]])
    got = QuantizedEmbedding(packed, torch.float32)(ids)
    assert torch.equal(got, QuantizedEmbedding(qw, torch.float32)(ids))
    assert torch.equal(got, qw.dequantize()[ids])


def _wide(kernels, qw) -> NativeLinear:
    return NativeLinear(kernels, kernels.pack(qw.dequantize(), None, torch.float32))


def test_the_head_takes_the_quantized_blocks_for_narrow_steps_only(kernels):
    torch.manual_seed(1)
    qw = quantize_int8(torch.randn(1000, 96) * 0.1)
    ref = qw.dequantize()
    wide = _wide(kernels, qw)
    head = QuantizedHead(kernels, qw, wide)
    head.narrow_rows = 4
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 96)
        got, want = head(x), F.linear(x, ref)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        # Which path ran: at one row the two sum in different orders, so their bits differ
        # somewhere (wider, the quantized GEMM runs the float GEMM's own tile: the same bits).
        quantized, packed = kernels.qgemm(x, head.weight_p), wide(x)
        if rows == 1:
            assert not torch.equal(quantized, packed)
        assert torch.equal(got, quantized if rows <= 4 else packed), rows
    head.wide = None  # every step on the blocks
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96)
        assert torch.equal(head(x), kernels.qgemm(x, head.weight_p)), rows


class _Slow(nn.Module):
    """A float head that takes ``seconds`` a call: the quantized head always wins."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.inner(x)


class _Free(nn.Module):
    """A float head that costs nothing (its values do not matter to the timing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_the_float_head_is_dropped_where_it_does_not_pay_and_kept_where_it_does(kernels):
    torch.manual_seed(2)
    qw = quantize_int8(torch.randn(4096, 96) * 0.1)
    head = QuantizedHead(kernels, qw, _Slow(_wide(kernels, qw), 0.02))
    plan = head.settle(torch.float32, widest_rows=16)
    assert head.wide is None and "dropped" in plan, plan
    x = torch.randn(16, 96)
    assert torch.equal(head(x), kernels.qgemm(x, head.weight_p))

    free = _Free()
    head = QuantizedHead(kernels, qw, free)
    plan = head.settle(torch.float32, widest_rows=16)
    assert head.wide is free and head.narrow_rows == NARROW_ROWS and "float head" in plan, plan
    x = torch.randn(2, 96)
    assert head(x) is x  # wider than narrow_rows: the float head's
