"""What this CPU can run, read at run time, and which build of the kernels fits it.

    cpu_features() -> CpuFeatures (model name, flags from /proc/cpuinfo)
    features.kernel_isa -> "avx512_bf16" | "avx512_vnni" | "avx512" | "avx2_vnni" | "avx2" | None

A build is only ever loaded on a CPU that has every flag it was compiled for, so no
binary meets an instruction its CPU lacks. Outside Linux, or where /proc/cpuinfo says
nothing useful, the flags come from torch's own dispatch level, which is coarser
(it cannot tell AVX512-BF16 apart).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# Compiler flags of each build, and the CPU flags (as /proc/cpuinfo names them) it needs.
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
# The VNNI builds add the integer dot products of int8 activations (quant_int8.c's W8A8 path).
ISA_BUILDS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx2": (_AVX2, _AVX2_FLAGS),
    "avx2_vnni": ([*_AVX2, "-mavxvnni"], _AVX2_FLAGS | {"avx_vnni"}),
    "avx512": (_AVX512, _AVX512_FLAGS),
    "avx512_vnni": ([*_AVX512, "-mavx512vnni"], _AVX512_FLAGS | {"avx512_vnni"}),
    "avx512_bf16": (
        [*_AVX512, "-mavx512vnni", "-mavx512bf16"],
        _AVX512_FLAGS | {"avx512_vnni", "avx512_bf16"},
    ),
}
# Most capable first. A CPU takes the first build whose flags it has, and falls back (a
# compiler too old for a build) to the next one it has them for.
ISA_PREFERENCE = ("avx512_bf16", "avx512_vnni", "avx512", "avx2_vnni", "avx2")

# Flags worth reporting next to a benchmark figure.
REPORTED_FLAGS = (
    "avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"
)  # fmt: skip


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]

    @property
    def kernel_isa(self) -> str | None:
        """The most capable kernel build this CPU runs, or None (no AVX2: the PyTorch path)."""
        for isa in ISA_PREFERENCE:
            if ISA_BUILDS[isa][1] <= self.flags:
                return isa
        return None

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware (AVX512-BF16 or AMX), which make bfloat16
        matmuls faster than float32 ones."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def reported(self) -> dict[str, bool]:
        return {flag: flag in self.flags for flag in REPORTED_FLAGS}


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model name and flags from /proc/cpuinfo text."""
    model, flags = "unknown", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model, flags)


def _from_torch() -> CpuFeatures:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    flags: set[str] = set()
    if capability in ("AVX2", "AVX512"):
        flags |= ISA_BUILDS["avx2"][1]
    if capability == "AVX512":
        flags |= ISA_BUILDS["avx512"][1]
    return CpuFeatures("unknown", frozenset(flags))


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CPU (read once per process)."""
    try:
        features = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return _from_torch()
    return features if features.flags else _from_torch()
