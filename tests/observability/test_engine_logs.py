"""The engine's log stays quiet and truthful through routine events (issue 18, item 11).

Client cancels, streams left open at shutdown and requests cut by the shutdown are
routine: no ERROR line, no traceback. A client-chosen request id with a newline cannot
forge a log line: it is escaped.
"""

from __future__ import annotations

import asyncio
import re
import signal

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import stub_of
from tests.services import start_engine, start_frontend

EVIL_ID = "evil\n2026-01-01 00:00:00,000 ERROR forged: the id wrote this line"


async def test_cancels_and_shutdown_log_no_errors_and_ids_are_escaped(demo_model_dir):
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256", "--shutdown-timeout", "0.5")
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address).wait_serving()
        async with (
            grpc.aio.insecure_channel(engine.address) as channel,
            grpc.aio.insecure_channel(frontend.address) as public,
        ):
            # Through the frontend: one call cancelled, one still running at the shutdown
            # (the frontend's stream to the engine stays open until the engine ends it).
            params = g.SamplingParams(max_tokens=1500, ignore_eos=True)
            calls = [stub_of(public).Generate(g.GenerateRequest(text="Once", sampling_params=params)) for _ in range(2)]
            for call in calls:
                await call.read()
            calls[0].cancel()

            cancelled = EngineStream(channel)
            cancelled.add("c", [5, 6, 7], max_tokens=1000, ignore_eos=True)
            await asyncio.wait_for(cancelled.results["c"].first_output.wait(), 30)
            cancelled.cancel()

            busy = EngineStream(channel)  # still running when the shutdown timeout cuts it
            evil = busy.add(EVIL_ID, [5, 6, 7], max_tokens=1500, ignore_eos=True)
            await asyncio.wait_for(evil.first_output.wait(), 30)
            idle = EngineStream(channel)  # open, nothing in flight
            idle.add("done", [5, 6, 7], max_tokens=2, ignore_eos=True)
            await idle.wait("done")

            engine.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                while await calls[1].read() != grpc.aio.EOF:
                    pass
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            await busy.wait(EVIL_ID, timeout=30)
            assert evil.error is not None and "shut down" in evil.error.message
            # Open streams end with UNAVAILABLE after their last outputs, not by a cut.
            assert await busy.status() == await idle.status() == grpc.StatusCode.UNAVAILABLE
        assert engine.proc.wait(30) == 0
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()
    log = engine.log()
    assert "Traceback" not in log and not re.search(r"^\S+ \S+ (ERROR|CRITICAL) ", log, re.MULTILINE), log
    assert "evil\\n2026-01-01" in log  # the id is in the log, escaped
    assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log
