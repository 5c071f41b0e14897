"""Native CPU kernels, compiled on first use for the ISA this CPU has, loaded with ctypes.

    load_kernels() -> NativeKernels | None

Sources (C, shipped in the package), their API declared once in ``tandem_api.h`` (which every
``.c`` includes; ``api.py`` reads its prototypes and mirrors its structs for ctypes): ``gemm.c``
(the linear layers, weights packed at load time, float32 or bfloat16; bfloat16 dot products in
the AVX512-BF16 build, ``gemm_bf16.h``; a LoRA term inside the product, ``gemm_lora.h``),
``quant.c`` (the quantized GEMM, a strategy per file beside it: ``quant_fused.c``,
``quant_wide.c``, ``quant_int8.c``, over ``quant_tiles.c``), ``elementwise.c`` (RMSNorm with the residual add,
SiLU-and-multiply, RoPE, argmax), ``attention.c`` and ``attention_prefill.c`` (decode and
prefill attention reading the paged KV cache in place, one query vector's arithmetic shared in
``attention_row.h``) and ``stack.c`` (a decode step's layers in one call); their layout is
the repository's ``.clang-format``.
``cpu.py`` reads the CPU's flags at run time and picks a build (AVX2, AVX512,
AVX512-BF16); ``build.py`` compiles it with the system's C compiler (``$CC``, else
``cc``) into a cache keyed by the sources and flags, so a build never runs on a CPU it was
not made for, and a cached build loads without a compiler. Where the best build for
the CPU cannot be made or loaded, the next less capable one the CPU runs is tried; where
none can, ``load_kernels`` returns None, logs why once, and the engine keeps its
plain-PyTorch path.

``TANDEM_KERNEL_ISA=avx2`` (say) picks a less capable build than the CPU allows, to
compare two builds on one machine; a build the CPU cannot run is never chosen.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from engine_svc.model.native.build import BuildError, build, compiler, target
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE, CpuFeatures, cpu_features
from engine_svc.model.native.kernels import KernelError, NativeKernels, PackedWeight

__all__ = [
    "BuildError",
    "CpuFeatures",
    "KernelError",
    "NativeKernels",
    "PackedWeight",
    "build",
    "cpu_features",
    "load_kernels",
]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_UNSET = object()
_kernels: object = _UNSET  # NativeKernels | None once load_kernels has run


def _choose_isa(features: CpuFeatures) -> str | None:
    best = features.kernel_isa
    wanted = os.environ.get("TANDEM_KERNEL_ISA")
    if wanted and best is not None:
        if wanted not in ISA_BUILDS:
            logger.warning("TANDEM_KERNEL_ISA=%s is not a kernel build (%s)", wanted, ", ".join(ISA_BUILDS))
        elif not ISA_BUILDS[wanted][1] <= features.flags:
            logger.warning("TANDEM_KERNEL_ISA=%s: this CPU cannot run it; using %s", wanted, best)
        else:
            return wanted
    return best


def _load(isa: str) -> NativeKernels | None:
    """The build for ``isa``, else the next less capable one the CPU runs (a compiler too
    old for AVX512-BF16 still makes an AVX2 build), else None; the reasons logged."""
    flags = cpu_features().flags
    candidates = tuple(c for c in ISA_PREFERENCE[ISA_PREFERENCE.index(isa) :] if ISA_BUILDS[c][1] <= flags)
    if compiler() is None:
        candidates = tuple(c for c in candidates if target(c).is_file())
        if not candidates:
            logger.warning("no C compiler (set CC or install cc) and no cached build; using the PyTorch path")
            return None
    for candidate in candidates:
        try:
            return NativeKernels(build(candidate), candidate)
        except (OSError, BuildError, AttributeError, subprocess.SubprocessError) as e:
            logger.warning("native %s kernels unavailable (%s)", candidate, e)
    logger.warning("no native kernels could be built or loaded; using the PyTorch path")
    return None


def load_kernels() -> NativeKernels | None:
    """The compiled kernels for this CPU, or None (reason logged) if they cannot be had."""
    global _kernels
    with _lock:
        if _kernels is not _UNSET:
            assert _kernels is None or isinstance(_kernels, NativeKernels)
            return _kernels
        kernels = None
        isa = _choose_isa(cpu_features())
        if not sys.platform.startswith("linux"):
            logger.warning("native kernels are built on Linux only; using the PyTorch path")
        elif isa is None:
            logger.warning("this CPU has no AVX2; native kernels are off, using the PyTorch path")
        else:
            kernels = _load(isa)
        _kernels = kernels
        return kernels
