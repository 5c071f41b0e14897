"""The LoRA term inside the native GEMM (gemm_lora.h) on every build this CPU runs, through
``LoraLinear`` (which lays the slots' B out in the packed weight's panel order).

Each row adds its own slot's ``(x @ A^T) @ B^T`` (scale folded in) before the bias and, for a
gate/up pair, before SiLU-and-multiply; rows with no slot must come out with exactly the
bits of the GEMM without adapters. Widths that are not whole panels, K with a vector tail,
ranks that differ per slot and a slot with rank 0 are all in the cases.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc.model.backends.native_layers import NativeLinear
from engine_svc.model.lora.adapter import LoraAdapter, LoraPart
from engine_svc.model.lora.slots import LoraBatch, LoraLinear, LoraStep
from engine_svc.model.native import NativeKernels, build, cpu_features
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

RUNNABLE = [isa for isa in ISA_PREFERENCE if ISA_BUILDS[isa][1] <= cpu_features().flags]
RANKS = (8, 3, 0)  # per slot


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request) -> NativeKernels:
    return NativeKernels(build(request.param), request.param)  # the cached build of each ISA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu_mul,widths,k", [(False, (100,), 70), (True, (72, 72), 64), (False, (64, 24, 24), 48)])
@pytest.mark.parametrize("rows", [1, 13, 40])
def test_each_row_adds_its_slots_term_and_base_rows_keep_their_bits(kernels, dtype, silu_mul, widths, k, rows):
    g = torch.Generator().manual_seed(rows * 100 + k)
    n = sum(widths)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    base = NativeLinear(kernels, kernels.pack(w, bias, dtype, silu_mul=silu_mul))
    step = LoraStep()
    layer = LoraLinear(
        base, step, num_slots=len(RANKS), in_features=k, part_widths=widths, max_rank=max(RANKS), kernels=kernels
    )
    deltas = []  # per slot: [k, n] float32, the term's matrix
    for slot, r in enumerate(RANKS):
        parts = []
        for part, width in enumerate(widths):
            if part == 1 and len(widths) == 3:
                continue  # a part the adapter does not target (k of q/k/v)
            parts.append(LoraPart(part, torch.randn(r, k, generator=g) * 0.3, torch.randn(width, r, generator=g) * 0.3))
        layer.write(slot, LoraAdapter(f"s{slot}", None, b"", {"m": parts}, r), "m")  # type: ignore[arg-type]
        delta = torch.zeros(k, n)
        for p in parts:
            start = sum(widths[: p.part])
            delta[:, start : start + widths[p.part]] = p.a.T @ p.b.T
        deltas.append(delta)
    row_slots = [int(s) for s in torch.randint(-1, len(RANKS), (rows,), generator=g)]
    x = torch.randn(rows, k, generator=g).to(dtype)
    step.batch = LoraBatch(row_slots, layer.max_rank)
    got = layer(x)
    step.batch = None
    alone = base(x)
    want = F.linear(x.float(), w.float(), bias.float())
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            want[row] += x[row].float() @ deltas[slot]
    if silu_mul:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    scale = max(1.0, want.abs().max().item())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * scale, rtol=tol)
    base_rows = torch.tensor([s < 0 for s in row_slots])
    assert torch.equal(got[base_rows].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       alone[base_rows].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
