"""A /metrics scrape flood is rationed on a real pair (tandem_common/scrape_ration.py): the
flooding address gets its pages a second and 429s with Retry-After past them, another
address still gets a page, the service accepts at most its rate of connections, and a
generation call beside the flood ends OK; and the flags set the ration, which the log
states at start."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from tandem_common.scrape_ration import CLIENT_BURST_S, DEFAULT_CLIENT_RATE, DEFAULT_MAX_RATE
from tests.observability.test_metrics_server import _scrape
from tests.reliability.faults import free_port, request
from tests.rpc.frontend_calls import stub_of
from tests.services import start_engine, start_frontend

FLOOD_S = 3.0


@pytest.fixture(scope="module")
def pair(demo_model_dir):
    eport, fport = free_port(), free_port()
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256", "--metrics-port", str(eport))
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--metrics-port", str(fport))).wait_serving()
        yield {"engine": eport, "frontend": fport}, frontend
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def _flood(port: int, seconds: float, num_threads: int = 6) -> tuple[list[tuple[int, str]], float]:
    """Every answer a flood from 127.0.0.1 got, and how long it ran."""
    answers: list[tuple[int, str]] = []
    until = time.monotonic() + seconds

    def scrape_on() -> None:
        while time.monotonic() < until:
            answers.append(_scrape(port))

    t0 = time.monotonic()
    threads = [threading.Thread(target=scrape_on) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers, time.monotonic() - t0


@pytest.mark.parametrize("service", ["frontend", "engine"])
async def test_a_scrape_flood_is_rationed_per_address_and_in_all_and_generation_goes_on(pair, service):
    ports, frontend = pair
    port = ports[service]
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        call = stub_of(channel).Generate(request("beside the flood", max_tokens=64), timeout=120)
        (answers, elapsed), responses = await asyncio.gather(asyncio.to_thread(_flood, port, FLOOD_S), _read_all(call))
        assert await call.code() == grpc.StatusCode.OK and sum(len(r.token_ids) for r in responses) == 64
    statuses = [status for status, _ in answers]
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) <= DEFAULT_CLIENT_RATE * (elapsed + CLIENT_BURST_S) + 1, (statuses.count(200), elapsed)
    assert all(retry.isdigit() and int(retry) >= 1 for status, retry in answers if status == 429)
    assert len(answers) <= DEFAULT_MAX_RATE * (elapsed + 1) + 1, (len(answers), elapsed)  # a burst, then the rate
    assert await asyncio.to_thread(_scrape, port, "127.0.0.2") == (200, "")  # another address: its own ration


async def _read_all(call) -> list:
    return [response async for response in call]


def test_the_flags_set_the_ration_and_the_log_states_it(pair):
    ports, _ = pair
    port = free_port()
    flags = ("--metrics-port", str(port), "--metrics-client-rate", "2", "--metrics-max-rate", "10")
    frontend = start_frontend(f"127.0.0.1:{ports['engine']}", extra=flags)  # not an engine: metrics serve anyway
    try:
        deadline = time.monotonic() + 60
        while "metrics on http" not in frontend.log():  # served once the gRPC port listens
            assert time.monotonic() < deadline and frontend.proc.poll() is None, frontend.log()
            time.sleep(0.05)
        statuses = [_scrape(port)[0] for _ in range(8)]
        assert statuses.count(200) <= 2 * CLIENT_BURST_S + 1 and statuses[-1] == 429, statuses
        assert "(2 pages/s per client address, 10 connections/s in all)" in frontend.log()
    finally:
        frontend.terminate()
