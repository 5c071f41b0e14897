"""A fault in the engine loop stays with its cause: a real in-process engine server on
127.0.0.1, with a fault injected into the engine core it drives.

    one command fails ─▶ that add is refused in band, the stream and the engine go on
    the loop thread dies ─▶ health NOT_SERVING at once, open streams and new ones UNAVAILABLE,
                           and shutdown waits for none of its requests (they can never finish)
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.config import EngineConfig
from engine_svc.service.server import EngineServer
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tests.rpc.engine_stream import EngineStream

SHUTDOWN_TIMEOUT_S = 600.0  # the drain a dead loop must not wait out; far past every bound below


class InjectedDeath(BaseException):
    """Escapes every ``except Exception``: what kills a thread for good."""


@pytest.fixture
async def engine(demo_model_dir):
    config = EngineConfig(
        model=str(demo_model_dir), host="127.0.0.1", port=0, num_kv_blocks=64, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    server = EngineServer(config)
    await server.start()
    await server.load()
    try:
        yield server
    finally:
        await asyncio.wait_for(server.drain_and_stop(), 60)  # a second stop is harmless


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status


async def test_a_command_that_fails_fails_its_request_alone(engine):
    core = engine.engine.core
    add_request = core.add_request

    def faulty(request):
        if request.prompt_token_ids == [9, 9, 9]:
            raise RuntimeError("injected fault")
        return add_request(request)

    core.add_request = faulty
    async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        stream = EngineStream(channel)
        stream.add("bad", [9, 9, 9], max_tokens=4)
        good = stream.add("good", [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        await asyncio.wait_for(stream.got_rejection.wait(), 30)
        await stream.wait("good", timeout=30)
        [rejected] = stream.rejected
        assert rejected.request_id == "bad" and rejected.error.code == pb.ERROR_CODE_INTERNAL
        assert len(good.token_ids) == 4 and good.error is None
        again = stream.add("bad", [5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True)  # the id is free again
        await stream.wait("bad", timeout=30)
        assert len(again.token_ids) == 2
        stream.close()
        assert await stream.status() == grpc.StatusCode.OK
    assert engine.engine.failure is None and engine.engine._thread.is_alive()


async def test_when_the_loop_thread_dies_health_and_every_stream_say_so_and_shutdown_waits_for_none(engine):
    address = f"127.0.0.1:{engine.port}"
    assert await _health(address) == health_pb2.HealthCheckResponse.SERVING

    def dying_step():
        raise InjectedDeath("injected")

    async with grpc.aio.insecure_channel(address) as channel:
        stream = EngineStream(channel)
        engine.engine.core.step = dying_step
        stream.add("r", [5, 6, 7], max_tokens=4)
        assert await stream.status(timeout=30) == grpc.StatusCode.UNAVAILABLE
        for _ in range(100):
            if await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        late = EngineStream(channel)
        late.add("late", [5, 6, 7], max_tokens=4)
        assert await late.status(timeout=30) == grpc.StatusCode.UNAVAILABLE
    assert isinstance(engine.engine.failure, InjectedDeath)
    assert engine.engine.num_unfinished() >= 1  # the request it died with never finishes
    await asyncio.wait_for(engine.drain_and_stop(), 30)  # it ends: no drain of SHUTDOWN_TIMEOUT_S for a dead loop
