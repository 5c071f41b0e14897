"""What an engine sends, or fails to do, cannot exhaust or stall a frontend: a stand-in
engine (stand_in_engine.py, in this process) beside a real one, a real frontend."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc

from tests.reliability.faults import CallRecord, free_port, read_call, request
from tests.reliability.stand_in_engine import StandInEngine
from tests.rpc.frontend_calls import stub_of
from tests.services import start_frontend

PROGRESS_S = 2.0  # --engine-progress-timeout-s of the frontend under test


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_an_engine_that_publishes_more_blocks_than_its_pool_is_capped(engine_proc, procs):
    stand_in = await StandInEngine(engine_proc.address, num_kv_blocks=1000, num_published_blocks=100_000).start()
    try:
        port = free_port()
        frontend = procs(start_frontend(stand_in.address, extra=("--routing", "prefix", "--metrics-port", str(port))))
        await asyncio.to_thread(frontend.wait_serving)
        engine = (("engine", stand_in.address),)
        deadline = time.monotonic() + 30
        while True:
            m = await asyncio.to_thread(_scrape, port)
            if m.get(("tandem_frontend_prefix_index_dropped_blocks_total", ()), 0) >= 99_000:
                break
            assert time.monotonic() < deadline, m.get(("tandem_frontend_prefix_index_blocks", engine))
            await asyncio.sleep(0.2)
        assert m[("tandem_frontend_prefix_index_blocks", engine)] == 1000
        assert m[("tandem_frontend_prefix_index_dropped_blocks_total", ())] == 99_000
        assert "published more prefix-cache blocks than the 1000 its pool holds" in frontend.log()
    finally:
        await stand_in.stop()


async def test_a_black_hole_engine_loses_its_calls_to_a_serving_one(engine_proc, procs):
    """The stand-in answers GetLoad (idle, so least-load favours it) and takes every Add,
    but advances none: its calls move to the real engine once the watchdog sees it."""
    stand_in = await StandInEngine(engine_proc.address).start()
    try:
        frontend = procs(
            start_frontend(
                stand_in.address,
                engine_proc.address,
                extra=("--routing", "least-load", "--engine-progress-timeout-s", str(PROGRESS_S)),
            )
        )
        await asyncio.to_thread(frontend.wait_serving)
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = stub_of(channel)

            async def calls(num: int, tag: str) -> list[CallRecord]:
                records = [CallRecord(max_tokens=8) for _ in range(num)]
                await asyncio.gather(
                    *(
                        read_call(stub.Generate(request(f"{tag} {i}", max_tokens=8), timeout=PROGRESS_S + 15), r)
                        for i, r in enumerate(records)
                    )
                )
                return records

            t0 = time.monotonic()
            records = await calls(20, "first")
            assert stand_in.num_adds >= 1  # some were sent to the black hole first
            assert [r.code for r in records] == [grpc.StatusCode.OK] * 20, records
            assert all(len(r.token_ids) == 8 for r in records)
            assert time.monotonic() - t0 < PROGRESS_S + 12
            assert "advanced none of them" in frontend.log() and "trying another engine" in frontend.log()

            # Now suspect, the black hole gets at most one request at a time (a probe).
            adds = stand_in.num_adds
            records = await calls(10, "after")
            assert [r.code for r in records] == [grpc.StatusCode.OK] * 10, records
            assert stand_in.num_adds - adds <= 1
    finally:
        await stand_in.stop()


async def test_a_black_hole_is_judged_against_the_engine_that_serves_and_its_calls_move_before_their_deadlines(
    engine_proc, procs
):
    """With the default --engine-progress-timeout-s (30 s), calls whose deadline is shorter
    still end OK: the black hole's requests wait a few times what the real engine takes to a
    first output (at least --engine-progress-floor-s), then move to the real engine."""
    deadline_s = 20.0  # well under the 30 s timeout, well over the 3 s floor
    stand_in = await StandInEngine(engine_proc.address).start()
    try:
        frontend = procs(start_frontend(stand_in.address, engine_proc.address, extra=("--routing", "least-load")))
        await asyncio.to_thread(frontend.wait_serving)
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = stub_of(channel)
            records = [CallRecord(max_tokens=8) for _ in range(20)]
            await asyncio.gather(
                *(
                    read_call(stub.Generate(request(f"call {i}", max_tokens=8), timeout=deadline_s), r)
                    for i, r in enumerate(records)
                )
            )
            assert stand_in.num_adds >= 1  # some were sent to the black hole first
            assert [r.code for r in records] == [grpc.StatusCode.OK] * 20, records
            assert all(len(r.token_ids) == 8 for r in records)
        log = frontend.log()
        assert "they move to another engine" in log and "trying another engine" in log, log[-3000:]
        assert "advanced none of them" not in log  # the session was never ended: the timeout did not act
    finally:
        await stand_in.stop()
