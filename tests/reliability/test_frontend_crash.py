"""A frontend is killed (SIGKILL) mid-stream: the engine aborts every request of that
frontend's stream and frees their KV blocks; the engine and its other streams go on."""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.reliability.faults import CallRecord, read_call, request, wait_engine_drained
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import engine_load, stub_of
from tests.services import start_frontend


async def test_frontend_kill_frees_everything_on_the_engine(shared):
    engine, _ = shared
    frontend = start_frontend(engine.address).wait_serving()
    try:
        async with (
            grpc.aio.insecure_channel(engine.address) as engine_channel,
            grpc.aio.insecure_channel(frontend.address) as channel,
        ):
            # A bystander on its own engine stream, which must not notice anything. Long enough
            # to be running still when the frontend's calls have all started (150 tokens could
            # be done by then).
            bystander = EngineStream(engine_channel)
            survivor = bystander.add("survivor", list(range(5, 40)), max_tokens=1000, temperature=0.0, ignore_eos=True)

            stub = stub_of(channel)
            started = [asyncio.Event() for _ in range(4)]
            records = [CallRecord(max_tokens=1500) for _ in range(4)]
            # 4 calls, one of them with n=4: 7 engine requests on the frontend's stream.
            calls = [stub.Generate(request(f"tale {i}" * 20, max_tokens=1500, n=4 if i == 0 else 1)) for i in range(4)]
            readers = [asyncio.create_task(read_call(c, r, e)) for c, r, e in zip(calls, records, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            load = await engine_load(engine.address)
            assert load.num_running >= 8 and load.num_used_blocks > 0, load

            frontend.kill()
            killed_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*readers), 10)
            assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in records), records
            # The engine noticed the dead stream and aborted its 7 requests within a moment.
            while (load := await engine_load(engine.address)).num_running > 1 or load.num_waiting:
                assert time.monotonic() - killed_at < 3, load
                await asyncio.sleep(0.02)

            # Only the bystander's request is left, and it finishes whole.
            await bystander.wait("survivor", timeout=60)
            assert len(survivor.token_ids) == 1000 and not bystander.foreign_ids
            bystander.close()
            await bystander.finished()
            assert await wait_engine_drained(engine.address, timeout=5) < 5
    finally:
        frontend.kill()
        frontend.terminate()
