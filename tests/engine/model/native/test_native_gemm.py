"""The native GEMM (gemm.c) against F.linear, on every build this CPU can run: float32 to
float32 rounding, bfloat16 to one bfloat16 rounding step; its bits across thread counts,
row tilings and the bfloat16 dot-product path; oneDNN's packed linears beside it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.model.backends.packed_linear import PackedLinear, pack_linears, packing_supported
from engine_svc.model.native import NativeKernels
from tests.engine.native_builds import DTYPES, RUNNABLE, _close, session_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

# -- matmul ---------------------------------------------------------------------------------

GEMM_CASES = [  # rows, in, out, bias, fused silu-and-multiply
    (1, 64, 96, False, False),
    (5, 40, 33, True, False),  # widths that fill no whole panel or vector
    (37, 576, 960, False, False),
    (200, 300, 64, True, False),
    (7, 64, 256, False, True),
    (64, 96, 48, True, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n,bias,silu_mul", GEMM_CASES)
def test_gemm_matches_linear(kernels, dtype, rows, k, n, bias, silu_mul):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    want = F.linear(x, w, b)
    if silu_mul:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    got = kernels.gemm(x, kernels.pack(w, b, dtype, silu_mul=silu_mul))
    assert got.dtype == dtype and got.shape == want.shape
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,k,n,silu_mul",
    [(37, 576, 960, False), (8, 64, 200, True), (200, 300, 40, False), (400, 1537, 72, True)],
    # one row block split by panels; several row blocks (K of 1537: blocks of 60 rows or
    # fewer) with fewer panels than threads, split by whole items
)
def test_gemm_bits_do_not_depend_on_the_thread_count(kernels, dtype, rows, k, n, silu_mul):
    """Each output tile is one thread's, whichever takes it (its own run or another's)."""
    g = torch.Generator().manual_seed(rows + k)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    packed, before = kernels.pack(w, None, dtype, silu_mul=silu_mul), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = kernels.gemm(x, packed)
        for num_threads in (2, 3, 5):  # more threads than cores: runs are taken over
            torch.set_num_threads(num_threads)
            assert torch.equal(kernels.gemm(x, packed).view(torch.int16), want.view(torch.int16))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [13, 25, 37, 49])
def test_gemm_row_bits_do_not_depend_on_the_rows_beside_it(kernels, dtype, rows):
    """Micro-tiles split a block's rows evenly (37 as 9 9 9 10): each row's sums are the
    same chain of multiply-adds whichever tile, and tile size, holds it."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 200, generator=g) * 0.1).to(dtype)
    x = torch.randn(rows, 200, generator=g).to(dtype)
    packed = kernels.pack(w, None, dtype)
    alone = torch.cat([kernels.gemm(x[i : i + 1], packed) for i in range(rows)])
    assert torch.equal(kernels.gemm(x, packed).view(torch.int16), alone.view(torch.int16))


def test_gemm_reads_strided_rows(kernels):
    x = torch.randn(9, 100)[:, 10:74]  # row stride 100
    w = torch.randn(24, 64)
    _close(kernels.gemm(x, kernels.pack(w, None, torch.float32)), F.linear(x, w), torch.float32)


# Beyond GEMM_CASES: K of 1, odd K over several slices, several row blocks.
DOT_CASES = [*GEMM_CASES, (3, 1, 5, False, False), (13, 301, 40, True, True), (150, 1537, 40, True, True)]


@pytest.mark.skipif("avx512_bf16" not in RUNNABLE, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("rows,k,n,bias,silu_mul", DOT_CASES)
def test_bf16_dot_products_give_the_float32_multiply_adds_bits(build_dir, rows, k, n, bias, silu_mul):
    """VDPBF16PS adds a pair's products in k order, each sum rounded: the same bits as the
    float32 multiply-adds of the AVX512 build (odd K too: padded with a zero pair element)."""
    dp = NativeKernels(session_build("avx512_bf16", build_dir), "avx512_bf16")
    fma = NativeKernels(session_build("avx512", build_dir), "avx512")
    assert dp.bf16_dot_products and not fma.bf16_dot_products
    g = torch.Generator().manual_seed(rows * 1000 + k)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    want = fma.gemm(x, fma.pack(w, b, torch.bfloat16, silu_mul=silu_mul))
    packed, before = dp.pack(w, b, torch.bfloat16, silu_mul=silu_mul), torch.get_num_threads()
    try:
        for num_threads in (1, 2):  # a sum is never split across threads
            torch.set_num_threads(num_threads)
            assert torch.equal(dp.gemm(x, packed).view(torch.int16), want.view(torch.int16))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
def test_onednn_packed_linears_match_plain_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 40, bias=False))
    x = torch.randn(5, 48)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model, batch_size_hint=8) == 2
        assert all(isinstance(model[i], PackedLinear) for i in (0, 2))
        for rows in (1, 5):
            torch.testing.assert_close(model(x[:rows]), want[:rows], atol=1e-5, rtol=1e-5)


# -- small ops ------------------------------------------------------------------------------
