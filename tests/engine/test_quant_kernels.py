"""The quantized GEMM (quant.c) against F.linear on the dequantized weight, on every
build this CPU runs, for the layouts every quantized source maps onto."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc.model.native import NativeKernels, build, cpu_features
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE
from engine_svc.model.native.quant import (
    QuantizedWeight,
    as_int8,
    concat_rows,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    take_rows,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

RUNNABLE = [isa for isa in ISA_PREFERENCE if ISA_BUILDS[isa][1] <= cpu_features().flags]
# SmolLM2-135M's linear shapes (q/o, k/v, gate+up, down) and a ragged small one.
SHAPES = [(576, 576), (192, 576), (3072, 576), (576, 1536), (7, 64)]
ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 31, 64]


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request, tmp_path_factory) -> NativeKernels:
    return NativeKernels(build(request.param, tmp_path_factory.mktemp("qbuild")), request.param)


def _layouts(w: torch.Tensor) -> list[QuantizedWeight]:
    with_min = quantize_int8(w, 16)
    with_min = QuantizedWeight(8, with_min.qs, with_min.scale, torch.randn_like(with_min.scale) * 0.01, 16)
    return [quantize_int8(w), quantize_int8(w, 16), with_min, quantize_int4(w)]


@pytest.mark.parametrize("shape", SHAPES)
def test_qgemm_equals_linear_on_the_dequantized_weight(kernels, shape):
    torch.manual_seed(sum(shape))
    n, k = shape
    w = torch.randn(n, k) * 0.1
    for qw in _layouts(w):
        ref = qw.dequantize()
        for m in ROWS:
            x = torch.randn(m, k)
            got, want = kernels.qgemm(x, qw), F.linear(x, ref)
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)


def test_bfloat16_rows_round_once(kernels):
    torch.manual_seed(1)
    qw = quantize_int4(torch.randn(576, 576) * 0.1)
    x = torch.randn(5, 576).bfloat16()
    got = kernels.qgemm(x, qw)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), qw.dequantize()).bfloat16()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_strided_rows_and_bad_shapes(kernels):
    qw = quantize_int8(torch.randn(64, 96))
    x = torch.randn(3, 128)[:, :96]
    torch.testing.assert_close(kernels.qgemm(x, qw), F.linear(x, qw.dequantize()), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expected \[M, 96\]"):
        kernels.qgemm(torch.randn(2, 64), qw)


def test_quantizing_at_load_is_close_and_the_layouts_are_checked():
    torch.manual_seed(2)
    w = torch.randn(256, 512) * 0.05
    for qw, bound in ((quantize_int8(w), 1 / 254), (quantize_int4(w), 2 / 30)):
        err = (qw.dequantize() - w).abs().max() / w.abs().max()
        assert err <= bound * 1.01  # half a step at most: max/127/2 for int8, range/15/2 for int4
    q4 = quantize_int4(w)
    assert q4.nbytes == 256 * 256 + 2 * 4 * 256 * 16  # half a byte a weight, two floats a group
    nibbles = torch.randint(0, 16, (2, 64))
    packed = pack_nibbles(nibbles)
    assert packed[0, 0] == nibbles[0, 0] | (nibbles[0, 16] << 4)  # GGUF's order in a block
    assert torch.equal(QuantizedWeight(4, packed, torch.ones(2, 2), None, 32).values(), nibbles.float())
    with pytest.raises(ValueError, match="4 bits in groups of 16"):
        QuantizedWeight(4, packed, torch.ones(2, 4), None, 16)
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedWeight(8, torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 3), None, 32)


def test_rows_taken_stacked_and_widened_keep_every_value():
    torch.manual_seed(3)
    a, b = quantize_int4(torch.randn(8, 64)), quantize_int8(torch.randn(4, 64), 16)
    both = concat_rows([a, b])
    assert both.bits == 8 and both.group == 16
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=1e-6)
    same = concat_rows([a, quantize_int4(torch.randn(2, 64))])
    assert same.bits == 4 and same.out_features == 10
    index = torch.tensor([3, 0, 7])
    torch.testing.assert_close(take_rows(a, index).dequantize(), a.dequantize()[index], rtol=0, atol=0)
    torch.testing.assert_close(as_int8(a, 32).dequantize(), a.dequantize(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 16 cannot become groups of 32"):
        as_int8(b, 32)
