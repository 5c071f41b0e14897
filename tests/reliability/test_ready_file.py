"""A ready file left by a service killed outright names a dead pid: readers ignore it and
the next service removes it at its start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from tandem_common.ready import read_ready_file, remove_stale_ready_file
from tests.reliability.faults import free_port
from tests.services import start_frontend


def test_a_killed_workers_parent_leaves_no_live_looking_ready_file(procs):
    # No engine answers on this port: the frontend still listens, which writes the file.
    frontend = procs(start_frontend(f"127.0.0.1:{free_port()}", extra=("--workers", "2"))).wait_listening()
    info = read_ready_file(frontend.ready_file)
    assert info is not None and info["pid"] == frontend.proc.pid and info["state"] == "listening"
    deadline = time.monotonic() + 30
    while not (m := re.search(r"pids \[(\d+), (\d+)\]", frontend.log())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m, frontend.log()
    worker_pids = [int(p) for p in m.groups()]

    frontend.kill()  # SIGKILL: the parent cannot remove its file
    try:
        assert frontend.ready_file.exists()
        assert read_ready_file(frontend.ready_file) is None  # the pid in it is gone
        deadline = time.monotonic() + 15  # the workers follow their parent (PR_SET_PDEATHSIG)
        while any(_running(p) for p in worker_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(p) for p in worker_pids)
    finally:
        for pid in worker_pids:
            if _running(pid):
                os.kill(pid, 9)


def test_a_stale_file_is_removed_at_start_and_a_live_one_is_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    stale, live = tmp_path / "stale.json", tmp_path / "live.json"
    stale.write_text(json.dumps({"service": "frontend", "pid": dead_pid, "host": "h", "port": 1, "state": "serving"}))
    live.write_text(json.dumps({"service": "frontend", "pid": os.getpid(), "host": "h", "port": 1, "state": "serving"}))
    assert read_ready_file(stale) is None and read_ready_file(live) is not None
    remove_stale_ready_file(stale)
    remove_stale_ready_file(live)
    assert not stale.exists() and live.exists()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
