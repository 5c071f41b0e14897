"""--workers 2: two frontend processes on one port, their metrics summed by the parent,
SIGTERM drains both, and a worker that dies takes the service down (nothing left behind)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
import urllib.request

import grpc
import pytest

from tests.rpc.frontend_calls import generate, ids_of, stub_of
from tests.services import start_engine, start_frontend

PARAMS = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
WORKER_LINE = re.compile(r"\[worker (\d) pid (\d+)\]: Generate \S+ OK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"left behind: {[p for p in pids if _alive(p)]}"


def _worker_pids(frontend) -> set[int]:
    return {int(p) for p in re.findall(r"\[worker \d pid (\d+)\]: listening on", frontend.log())}


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256")
    try:
        yield engine.wait_serving()
    finally:
        engine.terminate()


@pytest.fixture
def workers(engine):
    metrics_port = _free_port()
    frontend = start_frontend(engine.address, extra=("--workers", "2", "--metrics-port", str(metrics_port)))
    try:
        yield frontend.wait_serving(), metrics_port
    finally:
        pids = _worker_pids(frontend)
        frontend.terminate()
        _wait_gone(pids)


async def _calls_on_new_connections(address: str, num_connections: int) -> list[list[int]]:
    """One call on each of ``num_connections`` connections (a local subchannel pool each)."""

    async def one() -> list[int]:
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            return ids_of(await generate(stub_of(channel), text="Hello there", params=PARAMS))

    return await asyncio.gather(*(one() for _ in range(num_connections)))


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} in:\n{text}"
    return values[0]


async def test_two_workers_serve_one_port_and_their_metrics_add_up(workers):
    frontend, metrics_port = workers
    assert len(_worker_pids(frontend)) == 2, frontend.log()
    num_calls = 0
    for _ in range(10):  # the kernel spreads connections: both workers get some, soon
        results = await _calls_on_new_connections(frontend.address, 8)
        num_calls += len(results)
        assert all(r == results[0] and len(r) == 4 for r in results)
        served = {pid for _, pid in WORKER_LINE.findall(frontend.log())}
        if len(served) == 2:
            break
    assert served == {str(p) for p in _worker_pids(frontend)}, frontend.log()
    assert _metric(metrics_port, 'tandem_frontend_requests_total{code="OK"}') == num_calls
    assert _metric(metrics_port, "tandem_frontend_generation_tokens_total") == 4 * num_calls
    assert _metric(metrics_port, "tandem_frontend_requests_in_flight") == 0
    assert _metric(metrics_port, "tandem_frontend_engines_connected") == 1


async def test_sigterm_drains_every_worker_and_removes_the_ready_file(workers):
    frontend, _ = workers
    pids = _worker_pids(frontend)
    assert frontend.terminate() == 0
    _wait_gone(pids)
    assert not frontend.ready_file.exists()
    assert len(re.findall(r"pid \d+\]: stopped", frontend.log())) == 2


async def test_a_worker_that_dies_takes_the_service_down(workers):
    frontend, _ = workers
    pids = sorted(_worker_pids(frontend))
    os.kill(pids[0], signal.SIGKILL)
    assert frontend.proc.wait(timeout=60) == 1
    _wait_gone(pids)
    assert f"pid {pids[0]}) exited with code -9; stopping the other workers" in frontend.log()


async def test_a_killed_parent_takes_its_workers_with_it(workers):
    frontend, _ = workers
    pids = _worker_pids(frontend)
    frontend.kill()
    _wait_gone(pids)
