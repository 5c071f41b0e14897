"""The frontend around its engines: health, engines going away and coming back, several
engines, DNS discovery, queue-full errors, API keys and graceful shutdown.

Every service is a real subprocess on 127.0.0.1, stopped in a finalizer.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.request
from contextlib import ExitStack, asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.frontend_calls import engine_load, generate, ids_of, stub_of, wait_engine_idle
from tests.services import ServiceProcess, start_engine, start_frontend

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "tandem.generate.v1.GenerateService"
LONG = dict(max_tokens=1500, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def procs():
    """Collects started services and stops them all at the end of the test."""
    with ExitStack() as stack:

        def run(proc: ServiceProcess) -> ServiceProcess:
            stack.callback(proc.terminate)
            return proc

        yield run


@asynccontextmanager
async def frontend_stub(frontend: ServiceProcess):
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        yield stub_of(channel)


async def wait_health(proc: ServiceProcess, status: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = [await asyncio.to_thread(proc.health, name) for name in ("", SERVICE)]
        if now == [status, status]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"health {now}, expected {status}:\n{proc.log()}")
        await asyncio.sleep(0.05)


async def test_health_follows_the_engine_which_may_go_away_and_come_back(demo_model_dir, procs):
    port = free_port()
    frontend = procs(start_frontend(f"127.0.0.1:{port}")).wait_listening()
    await wait_health(frontend, NOT_SERVING)
    async with frontend_stub(frontend) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, text="hi")
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

        engine = procs(start_engine(demo_model_dir, port=port)).wait_serving()
        await wait_health(frontend, SERVING)
        assert ids_of(await generate(stub, text="hi", params=dict(max_tokens=3, temperature=0.0, ignore_eos=True)))

        # The engine dies mid-generation: the call fails at once with UNAVAILABLE.
        call = stub.Generate(g.GenerateRequest(text="hi", sampling_params=g.SamplingParams(**LONG)))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in call:
                engine.kill()
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"engine 127.0.0.1:{port} went away" in error.value.details()
        await wait_health(frontend, NOT_SERVING)

        # A new engine on the same address: the frontend reconnects by itself.
        procs(start_engine(demo_model_dir, port=port)).wait_serving()
        await wait_health(frontend, SERVING)
        assert ids_of(await generate(stub, text="hi", params=dict(max_tokens=3, temperature=0.0, ignore_eos=True)))


async def test_requests_spread_over_two_engines(demo_model_dir, procs):
    engines = [procs(start_engine(demo_model_dir)) for _ in range(2)]
    for e in engines:
        e.wait_serving()
    frontend = procs(start_frontend(*(e.address for e in engines))).wait_serving()
    async with frontend_stub(frontend) as stub:
        assert (await stub.GetModelInfo(g.GetModelInfoRequest())).num_engines == 2
        calls = [
            stub.Generate(g.GenerateRequest(text=f"hi {i}", sampling_params=g.SamplingParams(**LONG))) for i in range(6)
        ]
        readers = [asyncio.create_task(_first(c)) for c in calls]
        await asyncio.gather(*readers)
        loads = [await engine_load(e.address) for e in engines]
        assert all(load.num_running >= 2 for load in loads), loads
        for c in calls:
            c.cancel()
        for e in engines:
            await wait_engine_idle(e.address)


async def _first(call) -> None:
    async for _ in call:
        return


async def test_dns_name_finds_the_engine_and_metrics_count_calls(demo_model_dir, procs):
    engine = procs(start_engine(demo_model_dir)).wait_serving()
    metrics_port = free_port()
    frontend = procs(
        start_frontend(
            f"dns:///localhost:{engine.port}", extra=("--dns-refresh-s", "1", "--metrics-port", str(metrics_port))
        )
    )
    frontend.wait_serving()
    async with frontend_stub(frontend) as stub:
        responses = await generate(stub, text="hi", params=dict(max_tokens=2, temperature=0.0, ignore_eos=True))
        assert responses[-1].usage.completion_tokens == 2
    assert f"engine 127.0.0.1:{engine.port} discovered" in frontend.log()
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        metrics = page.read().decode()
    assert 'tandem_frontend_requests_total{code="OK"} 1.0' in metrics
    assert "tandem_frontend_engines_connected 1.0" in metrics


async def test_full_engine_queue_is_resource_exhausted(demo_model_dir, procs):
    # One request runs, one waits, the next finds the queue full.
    engine = procs(start_engine(demo_model_dir, "--max-num-seqs", "1", "--max-waiting", "1")).wait_serving()
    frontend = procs(start_frontend(engine.address)).wait_serving()
    long = g.GenerateRequest(text="hi", sampling_params=g.SamplingParams(max_tokens=1500, ignore_eos=True))
    async with frontend_stub(frontend) as stub:
        running = stub.Generate(long)
        await running.read()  # running now: the next one has to wait
        waiting = stub.Generate(long)
        await _until_engine(engine.address, lambda load: load.num_waiting == 1)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, text="hi")
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        running.cancel()
        waiting.cancel()


async def _until_engine(address: str, condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition(await engine_load(address)):
        assert asyncio.get_running_loop().time() < deadline, "the engine's load never matched"
        await asyncio.sleep(0.05)


async def test_api_keys_and_local_tokenizer(demo_model_dir, procs, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("second-key\n")
    engine = procs(start_engine(demo_model_dir)).wait_serving()
    extra = ("--api-key", "first-key", "--api-key-file", str(keys), "--tokenizer", str(demo_model_dir))
    frontend = procs(start_frontend(engine.address, extra=extra))
    frontend.wait_serving()  # health needs no key
    async with frontend_stub(frontend) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, text="hi")
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for metadata in ((("authorization", "Bearer first-key"),), (("x-api-key", "second-key"),)):
            responses = await generate(stub, text="hi", params=dict(max_tokens=2, ignore_eos=True), metadata=metadata)
            assert responses[-1].usage.completion_tokens == 2
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.GetModelInfo(g.GetModelInfoRequest(), metadata=(("authorization", "Bearer wrong"),))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"tokenizer loaded from {demo_model_dir}" in frontend.log()


async def test_sigterm_lets_in_flight_calls_finish(demo_model_dir, procs):
    engine = procs(start_engine(demo_model_dir)).wait_serving()
    frontend = procs(start_frontend(engine.address)).wait_serving()
    async with frontend_stub(frontend) as stub:
        call = stub.Generate(
            g.GenerateRequest(
                text="hi",
                return_token_ids=True,
                sampling_params=g.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
            )
        )
        responses = []
        async for r in call:
            if not responses:
                frontend.proc.send_signal(signal.SIGTERM)
            responses.append(r)
        assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH and len(ids_of(responses)) == 200
    assert await asyncio.to_thread(frontend.proc.wait, 30) == 0
    assert "shutting down" in frontend.log()


async def _end_code(call, timeout: float):
    """The call's status once it ends, or None if it is still streaming after ``timeout``."""

    async def drain():
        try:
            async for _ in call:
                pass
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    try:
        return await asyncio.wait_for(drain(), timeout)
    except asyncio.TimeoutError:
        return None


async def test_killed_engine_of_two_fails_its_calls_and_is_used_again_after_restart(demo_model_dir, procs):
    port = free_port()
    doomed = procs(start_engine(demo_model_dir, port=port)).wait_serving()
    other = procs(start_engine(demo_model_dir)).wait_serving()
    frontend = procs(start_frontend(doomed.address, other.address)).wait_serving()
    async with frontend_stub(frontend) as stub:
        calls = [
            stub.Generate(g.GenerateRequest(text=f"hi {i}", sampling_params=g.SamplingParams(**LONG))) for i in range(6)
        ]
        await asyncio.gather(*(_first(c) for c in calls))
        on_doomed = (await engine_load(doomed.address)).num_running
        assert on_doomed >= 1
        doomed.kill()
        codes = await asyncio.gather(*(_end_code(c, timeout=5.0) for c in calls))
        # Calls on the killed engine end UNAVAILABLE; the others stream on (or have finished
        # whole, where the other engine is fast enough).
        assert codes.count(grpc.StatusCode.UNAVAILABLE) == on_doomed, codes
        assert codes.count(None) + codes.count(grpc.StatusCode.OK) == len(calls) - on_doomed, codes
        for c in calls:
            c.cancel()
        for i in range(4):
            assert ids_of(
                await generate(stub, text=f"after {i}", params=dict(max_tokens=3, temperature=0.0, ignore_eos=True))
            )
        procs(start_engine(demo_model_dir, port=port)).wait_serving()
        deadline = time.monotonic() + 30
        while (await stub.GetModelInfo(g.GetModelInfoRequest())).num_engines < 2:
            assert time.monotonic() < deadline, "the restarted engine was not reconnected"
            await asyncio.sleep(0.1)
        calls = [
            stub.Generate(g.GenerateRequest(text=f"again {i}", sampling_params=g.SamplingParams(**LONG)))
            for i in range(6)
        ]
        await asyncio.gather(*(_first(c) for c in calls))
        assert (await engine_load(doomed.address)).num_running >= 1  # the restarted engine takes work
        for c in calls:
            c.cancel()
        await wait_engine_idle(other.address)
