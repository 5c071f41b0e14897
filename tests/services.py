"""Start real Tandem services as subprocesses on 127.0.0.1 for tests, and always stop them.

Each service is started with ``--port 0 --ready-file PATH``: its port and state come from
that file (tandem_common/ready.py), never from its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_common.ready import read_ready_file

ROOT = Path(__file__).resolve().parent.parent


class ServiceProcess:
    """One service process. Its log is kept in memory (``log()``) for assertions, and its
    standard output too (``stdout()``) when ``capture_stdout`` is set."""

    def __init__(
        self, module: str, args: list[str], *, env: dict[str, str] | None = None, capture_stdout: bool = False
    ) -> None:
        self.module = module
        self.args = args
        self._port: int | None = None
        self._lines: list[str] = []
        self._stdout_lines: list[str] = []
        self._ready_dir = tempfile.TemporaryDirectory(prefix="tandem-ready-")
        self.ready_file = Path(self._ready_dir.name) / "ready.json"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--ready-file", str(self.ready_file), *args],
            stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=full_env,
            cwd=ROOT,
        )
        self._pump_thread = threading.Thread(target=self._pump, args=(self.proc.stderr, self._lines), daemon=True)
        self._pump_thread.start()
        if capture_stdout:
            self._stdout_thread = threading.Thread(
                target=self._pump, args=(self.proc.stdout, self._stdout_lines), daemon=True
            )
            self._stdout_thread.start()

    @staticmethod
    def _pump(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def log(self) -> str:
        return "".join(self._lines)

    def stdout(self) -> str:
        return "".join(self._stdout_lines)

    @property
    def port(self) -> int:
        """The service's port; waits for it to listen if it does not yet."""
        if self._port is None:
            self._wait_state("listening", 60.0)
        assert self._port is not None
        return self._port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _wait_state(self, state: str, timeout: float) -> None:
        """Until the ready file says ``state`` ("listening" is also met by "serving")."""
        deadline = time.monotonic() + timeout
        while (info := read_ready_file(self.ready_file)) is None or state not in ("listening", info["state"]):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited ({self.proc.returncode}) before {state}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.module} not {state} within {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        self._port = info["port"]

    def wait_listening(self, timeout: float = 60.0) -> ServiceProcess:
        if self._port is None:
            self._wait_state("listening", timeout)
        return self

    def wait_serving(self, timeout: float = 120.0) -> ServiceProcess:
        self._wait_state("serving", timeout)
        return self

    def health(self, service: str = "") -> int | None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                return (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                    .status
                )
            except grpc.RpcError:
                return None

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump_thread.join(timeout=5)
        if hasattr(self, "_stdout_thread"):
            self._stdout_thread.join(timeout=5)
        self._ready_dir.cleanup()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_engine(model_dir: Path | str, *extra: str, port: int = 0, env=None, **kw) -> ServiceProcess:
    """An engine on the demo model or another; blocks of 16 tokens unless ``extra`` names a
    size: the service tests size pools (``--num-kv-blocks``) and shared prefixes in blocks of
    16, whatever the default is."""
    if not any(a == "--block-size" or a.startswith("--block-size=") for a in extra):
        extra = ("--block-size", "16", *extra)
    return ServiceProcess("engine_svc", ["--model", str(model_dir), "--port", str(port), *extra], env=env, **kw)


def start_frontend(*engines: str, extra: tuple[str, ...] = (), port: int = 0, env=None, **kw) -> ServiceProcess:
    args = [a for e in engines for a in ("--engine", e)]
    return ServiceProcess("frontend_svc", [*args, "--port", str(port), *extra], env=env, **kw)


@contextmanager
def running_pair(model_dir: Path | str, *engine_args: str, frontend_args: tuple[str, ...] = (), **kw):
    """An engine and a frontend connected to it, both SERVING; both stopped on exit.
    ``kw`` (env, capture_stdout) applies to both."""
    engine = start_engine(model_dir, *engine_args, **kw)
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=frontend_args, **kw)
        yield engine, frontend.wait_serving()
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()
