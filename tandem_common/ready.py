"""The readiness file: how a tool that starts a service learns its port and when it serves.

A service started with ``--ready-file PATH`` writes one JSON object there, atomically
(write a temporary file, then rename), so a reader never sees half of it::

    {"service": "engine", "pid": 4242, "host": "127.0.0.1", "port": 50051, "state": "listening"}

``state`` is ``"listening"`` as soon as the port is bound (with ``--port 0`` this is
how the chosen port becomes known), then ``"serving"`` once health turns SERVING. The
service removes the file when it stops. A service killed outright (SIGKILL, a crash, the
machine's OOM killer) cannot, so a file may be left that names a dead process: readers
must check that ``pid`` still runs (``read_ready_file`` does, and answers None for such a
file), and a service removes a stale file at its start (``remove_stale_ready_file``),
before it binds its port. This file, not the log, is the interface: log lines may change
at any time.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def write_ready_file(
    path: str | os.PathLike | None, *, service: str, host: str, port: int, state: str, **extra: object
) -> None:
    """``extra``: more ports a service listens on (the frontend's ``http_port``); None ones are left out."""
    if not path:
        return
    path = Path(path)
    info = {"service": service, "pid": os.getpid(), "host": host, "port": port, "state": state}
    info.update({k: v for k, v in extra.items() if v is not None})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def remove_ready_file(path: str | os.PathLike | None) -> None:
    if path:
        Path(path).unlink(missing_ok=True)


def read_ready_file(path: str | os.PathLike) -> dict | None:
    """The file's contents, or None while it does not exist or names a process that is gone."""
    info = _read(path)
    if info is None or not pid_alive(info.get("pid")):
        return None
    return info


def remove_stale_ready_file(path: str | os.PathLike | None) -> None:
    """Removes ``path`` when it names a process that is gone (a service killed outright)."""
    if not path:
        return
    info = _read(path)
    if info is not None and not pid_alive(info.get("pid")):
        Path(path).unlink(missing_ok=True)
        logger.info("removed the stale ready file %s of pid %s, which is gone", path, info.get("pid"))


def pid_alive(pid: object) -> bool:
    """Whether process ``pid`` runs; a zombie (ended, not yet reaped by its parent) does not."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    try:  # Linux: the state follows the parenthesised command name, "Z" for a zombie
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _read(path: str | os.PathLike) -> dict | None:
    try:
        info = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return info if isinstance(info, dict) else None


def wait_ready_file(
    path: str | os.PathLike,
    proc: subprocess.Popen,
    *,
    state: str = "listening",
    timeout: float | None = 120.0,
    check: Callable[[], None] | None = None,
) -> dict:
    """Wait until the service behind ``proc`` reports ``state`` (or later) in ``path``.

    Raises RuntimeError at once if the process exits first, TimeoutError after ``timeout``
    (None: no limit). ``check`` runs at every poll and may raise to stop the wait (another
    process it depends on died, the user pressed Ctrl-C ...).
    """
    wanted = ("listening", "serving").index(state)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        info = read_ready_file(path)
        if info is not None and ("listening", "serving").index(info["state"]) >= wanted:
            return info
        if proc.poll() is not None:
            raise RuntimeError(f"the process exited with code {proc.returncode} before it was {state}")
        if check is not None:
            check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the process was not {state} within {timeout:.0f} s")
        time.sleep(0.02)
