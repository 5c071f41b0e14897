"""int8 activations on the quantized GEMM (quant_int8.c: the W8A8 / W4A8 path): each row quantized
per group of the weight, integer dot products, against F.linear on those quantized rows and
the dequantized weight, on every build this CPU runs that has int8 dot products (AVX512-VNNI,
AVX-VNNI); the builds without them refuse it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc.model.native import NativeKernels, cpu_features
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE
from engine_svc.model.native.quant import QuantizedWeight, as_int8, quantize_activations, quantize_int4, quantize_int8
from tests.engine.model.native.test_quant_kernels import _layouts  # every layout kind the weight-only tests take
from tests.engine.native_builds import session_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

RUNNABLE = [isa for isa in ISA_PREFERENCE if ISA_BUILDS[isa][1] <= cpu_features().flags]
INT8_DOTS = [isa for isa in RUNNABLE if {"-mavx512vnni", "-mavxvnni"} & set(ISA_BUILDS[isa][0])]
SHAPES = [(576, 576), (3072, 576), (576, 1536), (7, 64)]
# Both sides of the micro-tile's rows (3 or 6), several row blocks (227 rows at K = 576).
ROWS = [1, 2, 3, 4, 6, 7, 13, 16, 64, 230]


@pytest.fixture(scope="module", params=INT8_DOTS or [pytest.param(None, marks=pytest.mark.skip("no int8 dots"))])
def kernels(request, build_dir) -> NativeKernels:
    k = NativeKernels(session_build(request.param, build_dir), request.param)
    assert k.int8_dot_products
    return k


def _assert_w8a8(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, what: str, bias=None) -> None:
    want = F.linear(quantize_activations(x.float(), qw.group).double(), qw.dequantize().double())
    if bias is not None:
        want += bias.double()
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _rows(m: int, k: int) -> torch.Tensor:
    """Rows with what activations have: an outlier, a group of zeros, both signs."""
    x = torch.randn(m, k)
    x[:, 5] *= 30.0
    x[0, 32:64] = 0.0
    return x


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_rows_equal_linear_on_the_quantized_rows(kernels, shape):
    torch.manual_seed(shape[0] + shape[1])
    for qw in _layouts(torch.randn(*shape) * 0.1):
        packed = kernels.qpack(qw)
        for m in ROWS:
            x = _rows(m, shape[1])
            got = kernels.qgemm(x, packed, int8_activations=True)
            _assert_w8a8(got, x, qw, f"{qw.bits} bits, group {qw.group}, {m} rows")


def test_the_rows_round_to_nearest_even_per_group(kernels):
    """Ties of x * 127 / max|x| go to the even integer, as torch.round: a weight of ones picks
    the quantized rows out, and one off by one is 1/127 of the group's range off."""
    k = 64
    x = torch.zeros(2, k)
    x[:, 0] = 127.0  # the group's max: x * 127 / 127 is x itself
    x[0, 1:8] = torch.tensor([2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -2.5])
    x[1, 32:40] = torch.tensor([1e-3, -1e-3, 127.0, 0.5, 1.5, 2.5, -126.5, 3.0])  # a group of its own
    ones = quantize_int8(torch.eye(k))
    got = kernels.qgemm(x, kernels.qpack(ones), int8_activations=True)
    q = quantize_activations(x, 32)
    assert q[0, 1:8].tolist() == [2.0, -4.0, 0.0, -0.0, 2.0, 126.0, -2.0]
    assert q[1, 32:40].tolist() == [0.0, -0.0, 127.0, 0.0, 2.0, 2.0, -126.0, 3.0]
    assert not q[0, 32:].any()  # a group of zeros: scale 0
    torch.testing.assert_close(got, F.linear(q, ones.dequantize()), atol=1e-5 * 127, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_large_mins_gate_up_bias_and_bfloat16_rows(kernels, rows):
    torch.manual_seed(rows)
    inter, k = 200, 576  # a ragged last tile
    q4 = quantize_int4(torch.randn(2 * inter, k) * 0.1)
    mins = (torch.rand_like(q4.scale) - 0.5) * 200 * q4.scale * 15  # the two terms nearly cancel
    for qw in (QuantizedWeight(4, q4.qs, q4.scale, mins, 32), as_int8(q4, 16)):
        bias = torch.randn(2 * inter)
        x = _rows(rows, k) + 0.5
        plain = kernels.qpack(qw, bias)
        _assert_w8a8(kernels.qgemm(x, plain, int8_activations=True), x, qw, f"{qw.bits} bits", bias)
        fused = kernels.qpack(qw, bias, silu_mul=True)
        h = F.linear(quantize_activations(x, qw.group), qw.dequantize(), bias)
        want = F.silu(h[:, :inter]) * h[:, inter:]
        got = kernels.qgemm(x, fused, int8_activations=True)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        both = kernels.qgemm(x, fused, pre_activation=True, int8_activations=True)
        torch.testing.assert_close(both, h, atol=1e-5 * h.abs().max().item(), rtol=1e-5)
        xb = x.bfloat16()  # widened, then quantized: one bfloat16 rounding of the result
        got_b = kernels.qgemm(xb, plain, int8_activations=True)
        want_b = F.linear(quantize_activations(xb.float(), qw.group), qw.dequantize(), bias)
        assert got_b.dtype == torch.bfloat16
        torch.testing.assert_close(got_b.float(), want_b, atol=1e-5 * want_b.abs().max().item(), rtol=2**-8)


@pytest.mark.parametrize("rows", [2, 16, 64])
def test_int8_results_do_not_depend_on_the_thread_count_or_the_batch(kernels, rows):
    torch.manual_seed(rows)
    packed = kernels.qpack(quantize_int4(torch.randn(3072, 576) * 0.1))
    x = torch.randn(rows, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.qgemm(x, packed, int8_activations=True)
        torch.set_num_threads(2)
        two = kernels.qgemm(x, packed, int8_activations=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # A row's result is its own: the same alone as among others (integer sums, then one order).
    assert torch.equal(kernels.qgemm(x[-1:], packed, int8_activations=True), one[-1:])


def test_builds_without_int8_dots_and_wide_groups_are_refused(build_dir):
    qw = quantize_int4(torch.randn(64, 1024) * 0.1)
    wide = QuantizedWeight(4, qw.qs, qw.scale.view(64, -1, 32)[:, :, 0].contiguous(), None, 1024)
    for isa in RUNNABLE:
        k = NativeKernels(session_build(isa, build_dir), isa)
        assert k.int8_dot_products == (isa in INT8_DOTS)
        x = torch.randn(3, 1024)
        if not k.int8_dot_products:
            with pytest.raises(ValueError, match="int8 activations need int8 dot products"):
                k.qgemm(x, k.qpack(qw), int8_activations=True)
            continue
        with pytest.raises(ValueError, match="groups of at most 512"):
            k.qgemm(x, k.qpack(wide), int8_activations=True)


def test_a_nan_or_infinity_in_a_row_spoils_that_row_alone(kernels):
    """As in F.linear, where a float row would: the row's results are NaN, the others exact."""
    qw = quantize_int4(torch.randn(64, 576) * 0.1)
    packed = kernels.qpack(qw)
    for rows in (3, 16):  # one micro-tile, several
        x = torch.randn(rows, 576)
        x[1, 100] = float("nan")
        x[0, 7] = float("inf")
        got = kernels.qgemm(x, packed, int8_activations=True)
        assert got[:2].isnan().all()
        _assert_w8a8(got[2:], x[2:], qw, f"{rows} rows")
