"""Abuse scenarios aimed at a service's own lifecycle, registered in benchmarks.abuse (same command line).

    dead-loop-shutdown  the engine loop thread dies with requests in flight: seconds from the stop to stopped

The engine runs in this process (as tests/rpc/test_engine_loop_faults.py runs it), so that a
fault can be put into its loop; the drain it must not wait out is the default
--shutdown-timeout. Run from an older checkout with this file copied in to measure the code
before a change.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from engine_svc.config import EngineConfig
from engine_svc.service.server import EngineServer
from tests.rpc.engine_stream import EngineStream


class _LoopDeath(BaseException):
    """Escapes every ``except Exception``: what ends a thread for good."""


async def dead_loop_shutdown(pair, _stub) -> str:
    config = EngineConfig(model=str(pair.model), host="127.0.0.1", port=0, num_kv_blocks=256)
    server = EngineServer(config)
    await server.start()
    await server.load()
    stopped = False
    try:
        assert server.engine is not None and server.engine.core is not None

        def dying_step():
            raise _LoopDeath("injected")

        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stream = EngineStream(channel)
            server.engine.core.step = dying_step
            for i in range(4):
                stream.add(f"r{i}", [5, 6, 7], max_tokens=4)
            code = await stream.status(timeout=30)
        in_flight = server.engine.num_unfinished()
        t0 = time.monotonic()
        await asyncio.wait_for(server.drain_and_stop(), config.shutdown_timeout + 30)
        stopped = True
        return (
            f"loop died with {in_flight} requests in flight (stream ended {code.name}): shutdown took "
            f"{time.monotonic() - t0:.2f} s (--shutdown-timeout {config.shutdown_timeout:g})"
        )
    finally:
        if not stopped:
            await server.drain_and_stop()


SCENARIOS = {"dead-loop-shutdown": dead_loop_shutdown}
