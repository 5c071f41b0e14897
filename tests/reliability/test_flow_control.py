"""Calls that hold resources without reading them: a per-frontend limit on concurrent
calls, a client that stops reading (its request is aborted in the engine after
--stalled-client-timeout-s), and a slow reader whose engine dies (the call still ends
UNAVAILABLE at once, right after the output that was already on its way).

Clients here keep their HTTP/2 receive window at about 1 KiB (no BDP probing, little
read-ahead), so that a client that stops reading fills it within a few tokens."""

from __future__ import annotations

import asyncio
import time

import grpc

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import request, wait_engine_drained
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import start_engine, start_frontend

SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def read_rest(call, delay_s: float = 0.0) -> tuple[grpc.StatusCode | None, str, int]:
    """Reads a call (already read with ``read()``) to its end, ``delay_s`` between messages:
    (status, details, finish reasons seen); status None when it is still open after 20 s."""
    finished = 0
    try:
        while True:
            response = await asyncio.wait_for(call.read(), 20)
            if response is grpc.aio.EOF:
                return grpc.StatusCode.OK, "", finished
            finished += bool(response.finish_reason)
            await asyncio.sleep(delay_s)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", finished
    except asyncio.TimeoutError:
        return None, "", finished


def heavy(max_tokens: int, n: int) -> g.GenerateRequest:
    """~400 bytes per streamed token: 20 alternatives with their texts."""
    return request("Once upon a time", max_tokens=max_tokens, n=n, logprobs=20)


async def test_concurrent_calls_beyond_the_limit_are_resource_exhausted(demo_model_dir, procs):
    engine = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256")).wait_serving()
    # One client holds both slots here: no per-client share (its default is half the slots).
    frontend = procs(
        start_frontend(engine.address, extra=("--max-concurrent-calls", "2", "--max-calls-per-client", "0"))
    ).wait_serving()
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        calls = [stub.Generate(request(f"long {i}", max_tokens=1500)) for i in range(2)]
        for call in calls:
            await asyncio.wait_for(call.read(), 60)  # both are in progress
        for _ in range(3):
            try:
                await generate(stub, text="one more", params=dict(max_tokens=2))
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "limit of 2 concurrent Generate calls (--max-concurrent-calls)" in e.details()
            else:
                raise AssertionError("a third concurrent call was accepted")
        calls[0].cancel()
        deadline = time.monotonic() + 10
        while True:  # the slot frees once the frontend has seen the cancel
            try:
                responses = await generate(stub, text="now", params=dict(max_tokens=2, ignore_eos=True))
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
                await asyncio.sleep(0.1)
        assert responses[-1].usage.completion_tokens == 2
        calls[1].cancel()
    await wait_engine_drained(engine.address)


async def test_a_client_that_stops_reading_is_aborted_in_the_engine(demo_model_dir, procs):
    engine = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256")).wait_serving()
    frontend = procs(start_frontend(engine.address, extra=("--stalled-client-timeout-s", "1"))).wait_serving()
    async with grpc.aio.insecure_channel(frontend.address, options=SMALL_WINDOW) as parked_channel:
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            parked = stub_of(parked_channel).Generate(heavy(max_tokens=1900, n=4))
            await asyncio.wait_for(parked.read(), 60)
            # It reads no more: the engine soon stops computing for it (4 x 1900 tokens would
            # take far longer), paused once its unread output passes the call's bound, while
            # others are served; and once its write has waited the timeout, the call ends.
            await wait_engine_drained(engine.address, timeout=30)
            other = await generate(stub_of(channel), text="meanwhile", params=dict(max_tokens=4, ignore_eos=True))
            assert other[-1].usage.completion_tokens == 4
            deadline = time.monotonic() + 30
            while " RESOURCE_EXHAUSTED: " not in frontend.log() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            code, details, finished = await read_rest(parked)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "read none of its stream for 1 s" in details and "(--stalled-client-timeout-s)" in details
    assert finished == 0
    assert "Generate" in frontend.log() and " RESOURCE_EXHAUSTED: " in frontend.log()


async def test_a_slow_reader_sees_its_engine_die_within_seconds(demo_model_dir, procs):
    """Output already merged for the slow reader when the engine dies is delivered, and the
    call ends UNAVAILABLE right after it; it used to wait for an output that never came."""
    engine = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256")).wait_serving()
    frontend = procs(start_frontend(engine.address)).wait_serving()
    async with grpc.aio.insecure_channel(frontend.address, options=SMALL_WINDOW) as channel:
        call = stub_of(channel).Generate(heavy(max_tokens=1900, n=1))
        await asyncio.wait_for(call.read(), 60)
        await asyncio.sleep(0.5)  # not reading: the window fills, the output waits merged (the engine is not done)
        engine.kill()
        killed_at = time.monotonic()
        code, details, _ = await read_rest(call, delay_s=0.005)  # still a slow reader
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert "went away" in details
    assert time.monotonic() - killed_at < 15
