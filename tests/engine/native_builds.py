"""What the native kernel tests share: the ISA builds this CPU can run (conftest.py builds
each once per test module, the ``kernels`` fixture), the dtypes and the tolerance."""

from __future__ import annotations

import torch

from engine_svc.model.native import cpu_features
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE

RUNNABLE = [isa for isa in ISA_PREFERENCE if ISA_BUILDS[isa][1] <= cpu_features().flags]
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rtol: float = 1e-5) -> None:
    """float32: to float32 rounding (relative to the tensor's scale); bfloat16: one rounding step."""
    got, want = got.float(), want.float()
    scale = max(1.0, want.abs().max().item())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=rtol * scale, rtol=rtol)
    else:
        torch.testing.assert_close(got, want, atol=1e-2 * scale, rtol=1e-2)
