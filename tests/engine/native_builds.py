"""What the native kernel tests share: the ISA builds this CPU can run, how a test session
builds them, the dtypes and the tolerance."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_svc.model.native import build, cpu_features
from engine_svc.model.native.build import WARNING_FLAGS
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE

RUNNABLE = [isa for isa in ISA_PREFERENCE if ISA_BUILDS[isa][1] <= cpu_features().flags]
DTYPES = [torch.float32, torch.bfloat16]


def session_build(isa: str, folder: Path) -> Path:
    """The test session's build of ``isa`` in ``folder`` (conftest's ``build_dir``), compiled
    by the first test that needs it and found in the cache by every later one. The warning
    flags change no instruction, so the build the kernel tests load is also the one that
    proves the sources compile cleanly (test_every_build_compiles)."""
    return build(isa, folder, extra_flags=WARNING_FLAGS)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rtol: float = 1e-5) -> None:
    """float32: to float32 rounding (relative to the tensor's scale); bfloat16: one rounding step."""
    got, want = got.float(), want.float()
    scale = max(1.0, want.abs().max().item())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=rtol * scale, rtol=rtol)
    else:
        torch.testing.assert_close(got, want, atol=1e-2 * scale, rtol=1e-2)
