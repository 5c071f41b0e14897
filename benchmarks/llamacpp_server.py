"""llama.cpp's ``llama-server`` as a measured peer: started on a free local port, stopped whole.

    with LlamaServer(binary, gguf, threads=2, slots=64, ctx=32768) as server:
        server.base_url, server.pid, server.buffers()

llama.cpp is not a dependency of this project: the binary's path comes from the command
line (benchmarks/figures/vs_llamacpp.md says how to build it). The server runs in a process group of
its own, so nothing it starts outlives the run, but in this process's session: a session
of its own would be a scheduler autogroup of its own, at the default share whatever this
run's priority. Its log goes to a temporary file, so its own report of the buffers it
allocated can be read back (``buffers()``: MiB per kind, the weights as ``model``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

# llama.cpp's load log: "<backend> <kind> buffer size = <n> MiB", e.g. a CPU_Mapped model buffer.
_BUFFER = re.compile(r"(\S+) (model|KV|compute|output|RS) buffer size =\s*([0-9.]+) MiB")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(binary: str, gguf: str, *, port: int, threads: int, slots: int, ctx: int, extra: list[str]) -> list[str]:
    """The server's command line: ``threads`` for generation and for prompt batches, ``slots``
    parallel sequences, each with a KV cache of its own of ``ctx / slots`` tokens (its
    default with ``--parallel`` given: a unified cache would make every sequence's attention
    span every cached token of all of them), continuous batching (its default), no web UI,
    and the log's "trace" level, the first that reports the buffers (a few lines per
    request)."""
    return [binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(ctx), "--no-webui", "--log-verbosity", "4", *extra]  # fmt: skip


def parse_buffers(log: str) -> dict[str, float]:
    """MiB per buffer kind (``model``, ``KV``, ``compute`` ...) summed over backends, and
    each backend's own as ``<kind>:<backend>``."""
    out: dict[str, float] = {}
    for backend, kind, mib in _BUFFER.findall(log):
        out[kind] = out.get(kind, 0.0) + float(mib)
        out[f"{kind}:{backend}"] = out.get(f"{kind}:{backend}", 0.0) + float(mib)
    return out


def version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return " ".join((out.stdout + out.stderr).split())


class LlamaServer:
    def __init__(
        self, binary: str, gguf: str, *, threads: int, slots: int, ctx: int, extra: list[str] = (), timeout: float = 300
    ) -> None:
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(
                f"--llama-server {binary!r} is not an executable file (see benchmarks/figures/vs_llamacpp.md)"
            )
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = command(binary, gguf, port=self.port, threads=threads, slots=slots, ctx=ctx, extra=list(extra))
        self.timeout = timeout
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def buffers(self) -> dict[str, float]:
        return parse_buffers(self.log())

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, process_group=0)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        """Until /health says 200 (it answers 503 while the model loads)."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) while loading:\n{self.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not ready in {self.timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __exit__(self, *exc) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)
