"""Native CPU kernels: C sources shipped with the package, compiled on first use.

Only one kernel lives here: decode attention that reads the paged KV cache in place
(``paged_attention.c``). Building it needs a C compiler with OpenMP (``$CC``, else ``cc``);
the shared object is cached in ``$TANDEM_KERNEL_DIR`` (default: ``kernels/`` in
``tandem_common.cache.cache_dir()``), named by a hash of the source and the flags, so a
rebuild happens only when one of them changes (a build takes well under a second). A
cached build is loaded without a compiler, which lets an image ship a prebuilt kernel
(docker/engine.Dockerfile). The flags follow the CPU (AVX2 + FMA where torch reports
AVX2 or better), so a build never runs on a CPU it was not made for: another CPU asks
for another file. Where no build is cached and none can be made, ``load_decode_attention``
returns None and the engine keeps its plain-PyTorch path; the reason is logged once.

ctypes releases the GIL for the duration of each call, so the gRPC threads keep running
while the kernel works.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from tandem_common.cache import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_SYMBOL = "tandem_paged_decode_attention_f32"
_lock = threading.Lock()
_UNSET = object()
_kernel: object = _UNSET  # DecodeAttentionKernel | None once load_decode_attention has run


class DecodeAttentionKernel:
    """Callable wrapper; argument checks live here so the C code can trust its inputs."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        ctx_lens: torch.Tensor,
        max_ctx_len: int,
        scale: float,
    ) -> None:
        """out/q ``[rows, heads, head_dim]``; caches ``[blocks, block_size, kv_heads, head_dim]``;
        block_table ``[rows, stride]`` int32; ctx_lens ``[rows]`` int32. All float32, CPU,
        contiguous. Fills ``out`` in place."""
        num_rows, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        for t in (out, q, k_cache, v_cache):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("decode attention kernel takes contiguous float32 CPU tensors")
        if block_table.dtype != torch.int32 or ctx_lens.dtype != torch.int32 or not block_table.is_contiguous():
            raise ValueError("block_table and ctx_lens must be contiguous int32")
        if out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim:
            raise ValueError("decode attention kernel: shape mismatch")
        if block_table.shape[0] != num_rows or ctx_lens.shape[0] != num_rows:
            raise ValueError("decode attention kernel: one block-table row and one length per query row")
        rc = self._fn(
            out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_table.data_ptr(), ctx_lens.data_ptr(),
            num_rows, num_heads, num_kv_heads, head_dim, block_size,
            block_table.shape[1], max_ctx_len, scale, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode attention kernel failed (code {rc})")


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _flags() -> list[str]:
    flags = ["-O3", "-std=gnu11", "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    if capability.startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    return flags


def _target(flags: list[str]) -> Path:
    """Where this source, built with these flags, is (or will be) cached."""
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *flags, sys.platform]).encode()).hexdigest()[:16]
    folder = Path(os.environ["TANDEM_KERNEL_DIR"]) if os.environ.get("TANDEM_KERNEL_DIR") else cache_dir() / "kernels"
    return folder / f"paged_attention-{key}.so"


def _build(cc: str, flags: list[str], target: Path) -> None:
    """Compile the kernel into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a private name, then rename: engines starting together never load a
    # half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_decode_attention() -> DecodeAttentionKernel | None:
    """The compiled kernel, or None (reason logged) if it cannot be built on this machine."""
    global _kernel
    with _lock:
        if _kernel is not _UNSET:
            assert _kernel is None or isinstance(_kernel, DecodeAttentionKernel)
            return _kernel
        kernel = None
        flags = _flags()
        target, cc = _target(flags), _compiler()
        if not sys.platform.startswith("linux"):
            logger.warning("native kernels are built on Linux only; decode attention uses the PyTorch path")
        elif not target.is_file() and cc is None:
            logger.warning("no C compiler (set CC or install cc); decode attention uses the PyTorch path")
        else:
            try:
                if not target.is_file():
                    assert cc is not None
                    _build(cc, flags, target)
                lib = ctypes.CDLL(str(target))
                fn = getattr(lib, _SYMBOL)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]
                kernel = DecodeAttentionKernel(fn)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                logger.warning("native decode attention unavailable (%s); using the PyTorch path", e)
        _kernel = kernel
        return kernel
