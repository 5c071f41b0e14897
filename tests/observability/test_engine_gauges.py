"""The engine's metrics tell the truth (issue 18, items 10 and 11), through a real pair.

* The gauges (running, waiting, KV usage) go back to 0 within a short, bounded time
  after a request ends by a client cancel, a stop string or a deadline, with the engine
  idle afterwards (nothing else would move them).
* A stop-string finish counts as ``stop`` in the engine's finish counter, not ``abort``.
* The metrics endpoint listens where --metrics-host (default: --host) says.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.frontend_calls import generate, stub_of, text_of
from tests.services import start_engine, start_frontend

SETTLE_S = 5.0  # how long the gauges may take to follow an end
LONG = dict(max_tokens=1500, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair_with_metrics(demo_model_dir):
    port = free_port()
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256", "--metrics-port", str(port))
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address)
        yield engine, frontend.wait_serving(), f"http://127.0.0.1:{port}/metrics"
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as page:
        text = page.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def gauges(url: str) -> tuple[float, float, float]:
    m = scrape(url)
    return (
        m[("tandem_engine_requests_running", ())],
        m[("tandem_engine_requests_waiting", ())],
        m[("tandem_engine_kv_cache_usage_ratio", ())],
    )


def finished(url: str, reason: str) -> float:
    return scrape(url).get(("tandem_engine_requests_finished_total", (("finish_reason", reason),)), 0.0)


async def until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(condition)):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        await asyncio.sleep(0.05)
    return value


async def wait_busy(url: str) -> None:
    await until(lambda: gauges(url)[0] >= 1, 30, "the running gauge never showed the request")


async def wait_settled(url: str) -> None:
    await until(lambda: gauges(url) == (0, 0, 0), SETTLE_S, f"gauges still {gauges(url)}")


async def test_gauges_follow_a_cancel_a_stop_string_and_a_deadline(pair_with_metrics):
    engine, frontend, url = pair_with_metrics
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)

        # Client cancel after the first tokens.
        call = stub.Generate(g.GenerateRequest(text="Once upon a time", sampling_params=g.SamplingParams(**LONG)))
        await call.read()
        await wait_busy(url)
        aborts = finished(url, "abort")
        call.cancel()
        await wait_settled(url)
        assert finished(url, "abort") == aborts + 1

        # A stop string ends it in the frontend, which aborts it in the engine: a stop.
        text = text_of(await generate(stub, text="Hello there", params=dict(LONG, max_tokens=24)))
        stop = text[8:12]
        assert stop and stop not in text[:8], text
        stops, aborts = finished(url, "stop"), finished(url, "abort")
        responses = await generate(stub, text="Hello there", params=dict(LONG, stop=[stop]))
        assert responses[-1].finish_reason == g.FINISH_REASON_STOP and responses[-1].stop_str == stop
        await wait_settled(url)
        await until(lambda: finished(url, "stop") == stops + 1, SETTLE_S, "the stop-string finish never counted")
        assert finished(url, "abort") == aborts

        # The client's deadline passes mid-generation: a third of what the whole generation
        # takes here (a fixed deadline can outlast it on a fast machine).
        t0 = time.monotonic()
        await generate(stub, text="Once upon a time", params=LONG)
        whole = time.monotonic() - t0
        await wait_settled(url)
        aborts = finished(url, "abort")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, text="Once upon a time", params=LONG, timeout=whole / 3)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_settled(url)
        assert finished(url, "abort") == aborts + 1


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a listening TCP socket on ``port``, from /proc/net/tcp."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        hex_ip, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":  # TCP_LISTEN
            addresses.add(socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1]))
    return addresses


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc/net/tcp")
def test_metrics_listen_on_the_service_host_by_default(pair_with_metrics):
    _, _, url = pair_with_metrics  # an engine started with --host 127.0.0.1 and no --metrics-host
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert _listening_addresses(port) == {"127.0.0.1"}  # never 0.0.0.0 behind a loopback --host


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc/net/tcp")
def test_metrics_host_flag_picks_the_address():
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.service.metrics import EngineMetrics

    config = EngineConfig.from_args(build_parser().parse_args(["--metrics-host", "127.0.0.2"]))
    assert config.metrics_host == "127.0.0.2"
    port = free_port()
    EngineMetrics(port, host=config.metrics_host)  # serves from a daemon thread until the test process ends
    assert _listening_addresses(port) == {"127.0.0.2"}
    with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as page:
        assert b"tandem_engine_requests_running" in page.read()
