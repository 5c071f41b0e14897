"""An engine is killed (SIGKILL) with requests in flight, then restarted on the same port."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import (
    NOT_SERVING,
    SERVING,
    CallRecord,
    free_port,
    read_call,
    request,
    wait_health,
)
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import start_engine, start_frontend

NUM_CALLS = 6


async def test_engine_kill_fails_calls_fast_and_a_restart_is_picked_up(demo_model_dir, procs):
    port = free_port()
    engine = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256", port=port)).wait_serving()
    frontend = procs(start_frontend(engine.address)).wait_serving()
    frontend_pid = frontend.proc.pid
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        started = [asyncio.Event() for _ in range(NUM_CALLS)]
        records = [CallRecord(max_tokens=1500) for _ in range(NUM_CALLS)]
        readers = [
            asyncio.create_task(
                read_call(stub.Generate(request(f"story {i}", max_tokens=1500, n=1 + i % 2)), records[i], started[i])
            )
            for i in range(NUM_CALLS)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

        killed_at = time.monotonic()
        engine.kill()
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        for r in records:
            assert r.code == grpc.StatusCode.UNAVAILABLE, r
            assert f"engine 127.0.0.1:{port} went away" in r.details, r
            assert r.ended_at - killed_at < 2.0, f"ended {r.ended_at - killed_at:.2f} s after the kill"
            assert r.finish_reason == g.FINISH_REASON_UNSPECIFIED  # no made-up final message

        # The frontend lives on, says NOT_SERVING, and refuses new calls at once.
        await wait_health(frontend, NOT_SERVING, timeout=5)
        assert frontend.proc.poll() is None
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, text="hi", params=dict(max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "no engine" in error.value.details()
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.GetModelInfo(g.GetModelInfoRequest())
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

        # A new engine on the same port: the same frontend process reconnects by itself.
        procs(start_engine(demo_model_dir, "--num-kv-blocks", "256", port=port)).wait_serving()
        await wait_health(frontend, SERVING, timeout=30)
        responses = await generate(stub, text="hi", params=dict(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH and responses[-1].usage.completion_tokens == 4
        assert (await stub.GetModelInfo(g.GetModelInfoRequest())).num_engines == 1
    assert frontend.proc.pid == frontend_pid and frontend.proc.poll() is None
