"""What the frontend tells its operator: where its metrics listen, how calls that the client
ended are logged and counted (deadline vs cancel, tokens streamed), that routine events
log no tracebacks, that a client's request_id cannot forge a log line, and that a model
without tokenizer.json is said once, with what to do, instead of every second."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import free_port, request, wait_engine_drained
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import ServiceProcess, start_engine, start_frontend


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the IPv4 sockets listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.fixture(scope="module")
def observed(demo_model_dir):
    """An engine and a frontend with metrics on; the frontend is stopped by the last test."""
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256")
    frontend = None
    metrics_port = free_port()
    try:
        engine.wait_serving()
        # A short grace: the last test's call must still be running when it ends (the demo
        # model writes its 1,500 tokens in about half a second, well inside a second).
        frontend = start_frontend(
            engine.address, extra=("--metrics-port", str(metrics_port), "--shutdown-timeout", "0.1")
        )
        yield engine, frontend.wait_serving(), metrics_port
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def metric(metrics_port: int, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
    return 0.0


def test_metrics_listen_where_the_service_does(observed):
    _, _, metrics_port = observed
    assert listening_addresses(metrics_port) == {"127.0.0.1"}  # --host 127.0.0.1; was 0.0.0.0


async def test_deadlines_and_cancels_are_told_apart_with_the_tokens_streamed(observed):
    engine, frontend, metrics_port = observed
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, text="deadline", timeout=1.0, params=dict(max_tokens=1500, ignore_eos=True))
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        call = stub.Generate(request("cancel me", max_tokens=1500))
        received = 0
        async for response in call:
            received += len(response.token_ids)
            if received >= 5:
                break
        call.cancel()
    await wait_engine_drained(engine.address)
    await asyncio.sleep(0.2)
    log = frontend.log()
    deadline_line = next(line for line in log.splitlines() if " DEADLINE_EXCEEDED: " in line)
    assert int(re.search(r"completion_tokens=(\d+)", deadline_line).group(1)) >= 0
    cancel_line = next(line for line in log.splitlines() if " CANCELLED: " in line)
    assert int(re.search(r"completion_tokens=(\d+)", cancel_line).group(1)) >= received, cancel_line
    assert metric(metrics_port, 'tandem_frontend_requests_total{code="DEADLINE_EXCEEDED"}') == 1
    assert metric(metrics_port, 'tandem_frontend_requests_total{code="CANCELLED"}') == 1
    assert metric(metrics_port, "tandem_frontend_generation_tokens_total") >= received


async def test_a_request_id_cannot_forge_a_log_line(observed):
    _, frontend, _ = observed
    forged = "mine\n2026-01-01 00:00:00,000 ERROR frontend_svc: forged\x1b[31m"
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        responses = await generate(stub_of(channel), text="hi", request_id=forged, params=dict(max_tokens=2))
    assert responses[-1].usage.completion_tokens == 2
    await asyncio.sleep(0.2)
    lines = frontend.log().splitlines()
    assert not any(line.startswith("2026-01-01") or "\x1b" in line for line in lines)
    assert any(
        "Generate mine\\n2026-01-01 00:00:00,000 ERROR frontend_svc: forged\\x1b[31m OK: " in line for line in lines
    )


async def test_routine_events_log_no_traceback(observed):
    """Cancels, deadlines (above) and a shutdown with a call in flight are routine."""
    engine, frontend, _ = observed
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        call = stub_of(channel).Generate(request("in flight at shutdown", max_tokens=1500))
        await call.read()
        frontend.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError):
            while await call.read() is not grpc.aio.EOF:
                pass
    assert await asyncio.to_thread(frontend.proc.wait, 30) == 0
    log = frontend.log()
    assert "Traceback" not in log, log
    assert not [line for line in log.splitlines() if re.match(r"\S+ \S+ (ERROR|CRITICAL) ", line)], log


@pytest.fixture
def procs():
    """Registers started services; all are stopped when the test ends."""
    with ExitStack() as stack:

        def run(proc: ServiceProcess) -> ServiceProcess:
            stack.callback(proc.terminate, 20.0)
            return proc

        yield run


@pytest.fixture
def model_without_tokenizer(demo_model_dir, tmp_path):
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for f in demo_model_dir.iterdir():
        if f.name == "model.safetensors":
            (model / f.name).symlink_to(f)
        elif f.name != "tokenizer.json":
            shutil.copy(f, model / f.name)
    return model


async def test_a_model_without_tokenizer_json_is_said_once_with_what_to_do(model_without_tokenizer, procs):
    engine = procs(start_engine(model_without_tokenizer, "--num-kv-blocks", "64")).wait_serving()
    frontend = procs(start_frontend(engine.address)).wait_listening()
    deadline = time.monotonic() + 30
    while "no tokenizer.json" not in frontend.log():
        assert time.monotonic() < deadline, frontend.log()
        await asyncio.sleep(0.1)
    await asyncio.sleep(4.0)  # it used to warn every second
    said = [line for line in frontend.log().splitlines() if "tokenizer" in line and " INFO " not in line]
    assert len(said) == 1 and " ERROR " in said[0] and "--tokenizer DIR" in said[0], said
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        for call in (
            lambda: generate(stub, text="hi"),
            lambda: stub.Tokenize(g.TokenizeRequest(text="hi")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call()
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION, error.value
            assert "no tokenizer.json" in error.value.details() and "--tokenizer DIR" in error.value.details()
    assert frontend.health() == health_pb2.HealthCheckResponse.NOT_SERVING
