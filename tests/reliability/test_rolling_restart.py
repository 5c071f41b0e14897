"""Rolling restart of two engines behind one frontend under steady load.

Each engine in turn gets SIGTERM, drains, exits 0 and is started again on the same port.
Short calls fit in the drain; two clients keep long calls running, which the shutdown
timeout cuts. Every call that was accepted must either complete with all its tokens or
end with a status that says why (UNAVAILABLE); none may end OK with fewer tokens than
promised.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import CallRecord, free_port, read_call, request, wait_engine_drained
from tests.rpc.frontend_calls import stub_of
from tests.services import start_engine, start_frontend

NUM_SHORT_CLIENTS = 3
NUM_LONG_CLIENTS = 2
LONG = 1900  # tokens: more than one restart phase lasts
ENGINE_ARGS = ("--num-kv-blocks", "512", "--num-threads", "1", "--shutdown-timeout", "1")


async def _num_engines(stub) -> int:
    try:
        return (await stub.GetModelInfo(g.GetModelInfoRequest(), timeout=5)).num_engines
    except grpc.aio.AioRpcError:
        return 0


async def _wait_engines(stub, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while await _num_engines(stub) != n:
        assert time.monotonic() < deadline, f"the frontend does not see {n} engines"
        await asyncio.sleep(0.05)


async def test_rolling_restart_under_load(demo_model_dir, procs):
    ports = [free_port(), free_port()]
    engines = [procs(start_engine(demo_model_dir, *ENGINE_ARGS, port=p)) for p in ports]
    for e in engines:
        e.wait_serving()
    frontend = procs(start_frontend(*(e.address for e in engines))).wait_serving()
    records: list[CallRecord] = []
    stop = asyncio.Event()

    calls = {}

    async def client(stub, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            max_tokens = LONG if seed < 0 else rng.choice([2, 4, 8])
            record = CallRecord(max_tokens=max_tokens)
            records.append(record)
            calls[seed] = stub.Generate(request(f"client {seed} says", max_tokens=max_tokens), timeout=90)
            await read_call(calls[seed], record)

    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        await _wait_engines(stub, 2)
        clients = [asyncio.create_task(client(stub, i)) for i in range(-NUM_LONG_CLIENTS, NUM_SHORT_CLIENTS)]
        completed_per_phase = []
        for i in range(2):
            await asyncio.sleep(0.5)
            before = sum(r.code == grpc.StatusCode.OK and r.ended_at > 0 for r in records)
            engines[i].proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(engines[i].proc.wait, 60) == 0, engines[i].log()[-3000:]
            assert "shutting down: draining" in engines[i].log()
            engines[i] = procs(start_engine(demo_model_dir, *ENGINE_ARGS, port=ports[i]))
            await asyncio.to_thread(engines[i].wait_serving)
            await _wait_engines(stub, 2)
            completed_per_phase.append(sum(r.code == grpc.StatusCode.OK and r.ended_at > 0 for r in records) - before)
        await asyncio.sleep(0.5)
        stop.set()
        for seed in range(-NUM_LONG_CLIENTS, 0):
            calls[seed].cancel()  # the long calls in flight: ended by their clients
        await asyncio.wait_for(asyncio.gather(*clients), 90)

    long_calls = [r for r in records if r.max_tokens == LONG]
    short_calls = [r for r in records if r.max_tokens != LONG]
    assert sum(r.code == grpc.StatusCode.CANCELLED for r in long_calls) == NUM_LONG_CLIENTS
    long_calls = [r for r in long_calls if r.code != grpc.StatusCode.CANCELLED]
    for record in short_calls + long_calls:
        record.check_complete_or_explained(grpc.StatusCode.UNAVAILABLE)
    # The long calls were cut by a shutdown timeout, and said so.
    cut = [r for r in long_calls if "shut down before this request finished" in r.details]
    assert cut and all(r.code == grpc.StatusCode.UNAVAILABLE and r.token_ids for r in cut), long_calls
    ok = [r for r in short_calls if r.code == grpc.StatusCode.OK]
    assert len(ok) >= 20 and all(n > 0 for n in completed_per_phase), (len(ok), completed_per_phase)
    assert len(ok) >= 0.9 * len(short_calls), [r for r in short_calls if r.code != grpc.StatusCode.OK]
    for e in engines:
        await wait_engine_drained(e.address)
    frontend.terminate()  # first, so that the engines stop without a stream to wait for
