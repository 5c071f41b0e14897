"""Compile the kernels' C sources for one ISA into a shared object, cached on disk.

The object is cached in ``$TANDEM_KERNEL_DIR`` (default: ``kernels/`` in
``tandem_common.cache.cache_dir()``) under a name that hashes the sources, the flags and
the platform, so a rebuild happens only when one of them changes, and a cached build is
loaded without a compiler (an image can ship one prebuilt: docker/engine.Dockerfile).
The sources compile in parallel, one compiler process each, then link: about a second
on two cores. Any ISA's build compiles on any x86-64 machine (the tests build them all);
which one is loaded is ``cpu.py``'s decision.

A shared object is code the engine runs: a cached one is loaded only if neither it nor
its folder can have been written by another user (owned by this user or root, not
group/other-writable; a sticky folder such as /tmp is fine), else BuildError. The
default folder is per user (``~/.cache/tandem/kernels``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine_svc.model.native.cpu import ISA_BUILDS
from tandem_common.cache import cache_dir

HERE = Path(__file__).resolve().parent
SOURCES = (
    "gemm.c", "elementwise.c", "attention.c", "attention_prefill.c", "quant.c", "quant_fused.c", "quant_wide.c",
    "quant_int8.c", "quant_tiles.c", "stack.c",
)  # fmt: skip
HEADERS = (
    "tandem_api.h", "tandem_kernels.h", "attention_row.h", "gemm_bf16.h", "gemm_tile.h", "gemm_lora.h", "quant.h",
    "work_split.h",
)  # fmt: skip
BASE_FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=fast", "-fPIC", "-fopenmp", "-fno-math-errno"]
# What the sources must compile cleanly under (the tests build every ISA with them). Not in
# the engine's own build: a newer compiler's new warning must not cost a server its kernels.
WARNING_FLAGS = ("-Wall", "-Wextra", "-Wmissing-prototypes", "-Werror")


class BuildError(RuntimeError):
    pass


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def flags(isa: str, extra_flags: Sequence[str] = ()) -> list[str]:
    return [*BASE_FLAGS, *ISA_BUILDS[isa][0], *extra_flags]


def kernel_dir() -> Path:
    if os.environ.get("TANDEM_KERNEL_DIR"):
        return Path(os.environ["TANDEM_KERNEL_DIR"])
    return cache_dir() / "kernels"


def target(isa: str, folder: Path | None = None, extra_flags: Sequence[str] = ()) -> Path:
    """Where the build of the current sources for ``isa`` is (or will be) cached."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update("\0".join([*flags(isa, extra_flags), sys.platform]).encode())
    return (folder or kernel_dir()) / f"tandem_kernels-{isa}-{h.hexdigest()[:16]}.so"


def _check_trusted(path: Path) -> None:
    """Refuse a shared object that another user could have written or swapped."""
    for p, is_dir in ((path.parent, True), (path, False)):
        st = p.stat()
        others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid not in (os.getuid(), 0) or (others_write and not (is_dir and st.st_mode & stat.S_ISVTX)):
            raise BuildError(
                f"{p} is owned or writable by another user; not loading kernels from it "
                "(fix its owner and mode, or point TANDEM_KERNEL_DIR at a private folder)"
            )


def build(isa: str, folder: Path | None = None, extra_flags: Sequence[str] = ()) -> Path:
    """The cached build for ``isa``, compiled now if it is missing (with ``extra_flags``
    added to the compiler's, e.g. WARNING_FLAGS). Raises BuildError."""
    out = target(isa, folder, extra_flags)
    if out.is_file():
        _check_trusted(out)
        return out
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (set CC or install cc)")
    out.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    # Build in a private folder, then rename: engines starting together never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        objects = [Path(tmp) / (Path(src).stem + ".o") for src in SOURCES]
        procs = [
            subprocess.Popen(
                [cc, *flags(isa, extra_flags), "-c", str(HERE / src), "-o", str(obj)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for src, obj in zip(SOURCES, objects)
        ]
        errors = []
        for proc in procs:
            output, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                errors.append(output.strip()[-2000:])
        if errors:
            raise BuildError(f"{cc} failed: {' | '.join(errors)}")
        lib = Path(tmp) / out.name
        result = subprocess.run(
            [cc, "-shared", "-fopenmp", *map(str, objects), "-o", str(lib), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise BuildError(f"{cc} failed to link: {result.stderr.strip()[-2000:]}")
        lib.chmod(0o755)  # whatever the umask: only its owner may write it
        os.replace(lib, out)
    _check_trusted(out)
    return out
