"""The quantized GEMM (quant.c) against F.linear on the dequantized weight, on every
build this CPU runs, for the layouts every quantized source maps onto: the register path
(few rows) and the dequantized-panel path (wider), one and several row blocks."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc.model.native import NativeKernels, cpu_features
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE
from engine_svc.model.native.quant import (
    QuantizedWeight,
    as_int8,
    concat_rows,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    relayout,
    take_rows,
)
from engine_svc.model.native.quant_pack import pack_panels
from tests.engine.native_builds import session_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

RUNNABLE = [isa for isa in ISA_PREFERENCE if ISA_BUILDS[isa][1] <= cpu_features().flags]
# SmolLM2-135M's linear shapes (q/o, k/v, gate+up, down) and a ragged small one.
SHAPES = [(576, 576), (192, 576), (3072, 576), (576, 1536), (7, 64)]
# Both sides of the register path's limit (4 or 5 rows), the micro-tile's (6 or 12), and
# several row blocks (168 rows at K = 576, 60 at K = 1536).
ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 13, 16, 31, 64, 65, 200]


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request, build_dir) -> NativeKernels:
    return NativeKernels(session_build(request.param, build_dir), request.param)


@functools.cache
def _cases(shape: tuple[int, int]) -> list[tuple[QuantizedWeight, torch.Tensor]]:
    """The layouts of one random weight of ``shape`` with their dequantized weights, made
    once for every build."""
    torch.manual_seed(sum(shape))
    return [(qw, qw.dequantize()) for qw in _layouts(torch.randn(*shape) * 0.1)]


def _layouts(w: torch.Tensor) -> list[QuantizedWeight]:
    """Every layout kind: int8 in groups of 32 and 16, int8 with mins (float32 scales: the
    mins are not float16 values), 4-bit with mins in groups of 32 (float16 scales) and of 128
    (GPTQ / AWQ's usual group)."""
    with_min = quantize_int8(w, 16)
    with_min = QuantizedWeight(8, with_min.qs, with_min.scale, torch.randn_like(with_min.scale) * 0.01, 16)
    q4 = quantize_int4(w)
    layouts = [quantize_int8(w), quantize_int8(w, 16), with_min, q4]
    if w.shape[1] % 128 == 0:
        scale = q4.scale.view(w.shape[0], -1, 4)[:, :, 0].contiguous()
        layouts.append(QuantizedWeight(4, q4.qs, scale, -8 * scale, 128))
    return layouts


def _assert_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    want = F.linear(x.float(), w)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("shape", SHAPES)
def test_qgemm_equals_linear_on_the_dequantized_weight(kernels, shape):
    k = shape[1]
    torch.manual_seed(k)
    for qw, ref in _cases(shape):
        packed = kernels.qpack(qw)
        assert torch.equal(packed.dequantize(), ref)
        for m in ROWS:
            x = torch.randn(m, k)
            _assert_linear(kernels.qgemm(x, packed), x, ref, f"{qw.bits} bits, group {qw.group}, {m} rows")


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_group_sums_hold_where_the_mins_dominate(kernels, rows):
    """One and two rows sum each group as s * sum(x q) + m * sum(x): with mins a hundred times
    the scales' range (and of both signs), the two terms are large and nearly cancel, the
    case where that grouping would round worst."""
    torch.manual_seed(7)
    n, k = 96, 576
    q4 = quantize_int4(torch.randn(n, k) * 0.1)
    mins = (torch.rand_like(q4.scale) - 0.5) * 200 * q4.scale * 15
    wide = QuantizedWeight(4, q4.qs, q4.scale, mins, 32)
    for qw in (wide, as_int8(wide, 16)):
        packed = kernels.qpack(qw)
        x = torch.randn(rows, k) + 0.5  # group sums of x far from 0
        _assert_linear(kernels.qgemm(x, packed), x, qw.dequantize(), f"{qw.bits} bits, large mins, {rows} rows")


def test_packed_weight_pointers_are_its_tensors(kernels):
    qw = quantize_int4(torch.randn(64, 64) * 0.1)
    packed = kernels.qpack(qw, torch.randn(64))
    qs, scale, minimum, bias = packed.pointers
    assert (qs.value, scale.value) == (packed.qs.data_ptr(), packed.scale.data_ptr())
    assert (minimum.value, bias.value) == (packed.min.data_ptr(), packed.bias.data_ptr())
    assert kernels.qpack(quantize_int8(torch.randn(64, 64))).pointers[2:] == (None, None)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 16, 64])
def test_gate_up_epilogue_and_bias(kernels, rows):
    torch.manual_seed(rows)
    inter, k = 200, 576  # 200 columns: a ragged last tile
    qw = quantize_int4(torch.randn(2 * inter, k) * 0.1)
    bias = torch.randn(2 * inter)
    packed = kernels.qpack(qw, bias, silu_mul=True)
    assert packed.out_features == inter and torch.equal(packed.dequantize(), qw.dequantize())
    x = torch.randn(rows, k)
    h = F.linear(x, qw.dequantize(), bias)
    want = F.silu(h[:, :inter]) * h[:, inter:]
    torch.testing.assert_close(kernels.qgemm(x, packed), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    plain = kernels.qpack(qw, bias)
    torch.testing.assert_close(kernels.qgemm(x, plain), h, atol=1e-5 * h.abs().max().item(), rtol=1e-5)
    # Before the epilogue (where a LoRA adapter adds its term): [gate | up] from the paired panels.
    both = kernels.qgemm(x, packed, pre_activation=True)
    assert both.shape == h.shape
    torch.testing.assert_close(both, h, atol=1e-5 * h.abs().max().item(), rtol=1e-5)
    assert torch.equal(kernels.qgemm(x, plain, pre_activation=True), kernels.qgemm(x, plain))
    xb = x.bfloat16()  # bfloat16: the product rounded once, then torch's bfloat16 SiLU and multiply
    hb = F.linear(xb.float(), qw.dequantize(), bias).bfloat16()
    want_b = F.silu(hb[:, :inter]) * hb[:, inter:]
    scale = want_b.float().abs().max().item()
    torch.testing.assert_close(kernels.qgemm(xb, packed).float(), want_b.float(), atol=1e-2 * scale, rtol=1e-2)


@pytest.mark.parametrize("rows", [5, 64])
def test_bfloat16_rows_round_once(kernels, rows):
    torch.manual_seed(1)
    qw = kernels.qpack(quantize_int4(torch.randn(576, 576) * 0.1))
    x = torch.randn(rows, 576).bfloat16()
    got = kernels.qgemm(x, qw)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), qw.dequantize())
    scale = want.abs().max().item()
    # One bfloat16 rounding of a result that is float32-exact up to summation order.
    torch.testing.assert_close(got.float(), want, atol=1e-5 * scale, rtol=2**-8)


@pytest.mark.parametrize("rows", [2, 16, 64])
def test_results_do_not_depend_on_the_thread_count(kernels, rows):
    torch.manual_seed(rows)
    qw = kernels.qpack(quantize_int4(torch.randn(3072, 576) * 0.1))
    x = torch.randn(rows, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.qgemm(x, qw)
        torch.set_num_threads(2)
        two = kernels.qgemm(x, qw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_strided_rows_and_bad_shapes(kernels):
    qw = kernels.qpack(quantize_int8(torch.randn(64, 96)))
    for rows in (3, 40):
        x = torch.randn(rows, 128)[:, :96]
        _assert_linear(kernels.qgemm(x, qw), x, qw.dequantize(), f"{rows} strided rows")
    with pytest.raises(ValueError, match=r"expected \[M, 96\]"):
        kernels.qgemm(torch.randn(2, 64), qw)
    other = pack_panels(quantize_int8(torch.randn(64, 96)), kernels.panel_width * 2)
    with pytest.raises(ValueError, match="panels of"):
        kernels.qgemm(torch.randn(2, 96), other)


def test_scales_are_float16_where_that_changes_none():
    torch.manual_seed(4)
    w = torch.randn(64, 256) * 0.05
    q4 = pack_panels(quantize_int4(w), 32)
    assert q4.scale.dtype == q4.min.dtype == torch.float16
    assert q4.nbytes == 64 * 128 + 2 * 2 * 64 * 8  # 0.625 bytes a weight: GGUF Q4_1's
    odd = quantize_int4(w)
    odd = QuantizedWeight(4, odd.qs, odd.scale * (1 + 2**-15), odd.min, 32)  # not a float16 value
    packed = pack_panels(odd, 16)
    assert packed.scale.dtype == torch.float32 and torch.equal(packed.dequantize(), odd.dequantize())
    tiny = quantize_int8(w * 1e-6)  # scales below float16's normal range stay float32
    assert tiny.scale.abs().min() < 2**-14 and torch.equal(pack_panels(tiny, 32).dequantize(), tiny.dequantize())


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
    with pytest.raises(ValueError, match="4 bits in groups of 24"):
        QuantizedWeight(4, packed, torch.ones(2, 4), None, 24)
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
    with pytest.raises(ValueError, match="8-bit groups of 16 cannot become 8-bit groups of 32"):
        as_int8(b, 32)
    g128 = QuantizedWeight(4, a.qs, a.scale[:, :1].contiguous(), None, 64)
    mixed = concat_rows([g128, a])  # 4-bit parts of different groups stay 4-bit
    assert (mixed.bits, mixed.group, mixed.min is not None) == (4, 32, True)
    torch.testing.assert_close(mixed.dequantize(), torch.cat([g128.dequantize(), a.dequantize()]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot become 4-bit"):
        relayout(b, 4, 16, True)
