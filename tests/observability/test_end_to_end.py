"""Tracing, metrics and JSON logs of a real engine + frontend pair.

Both services run as subprocesses with tracing on (the frontend by --otlp-endpoint, the
engine by OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) exporting to an in-test OTLP collector,
metrics on --metrics-port and --log-format json.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import grpc
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.parser import text_string_to_metric_families

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.observability.collector import Collector
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import start_engine, start_frontend

FRONTEND_SPAN = "tandem.generate.v1.GenerateService/Generate"
ENGINE_SPAN = "tandem.engine.request"
PARAMS = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    """(collector, engine, frontend, engine metrics URL, frontend metrics URL)."""
    with Collector() as collector:
        fast_export = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": ""}
        engine_metrics, frontend_metrics = free_port(), free_port()
        engine = start_engine(
            demo_model_dir,
            "--num-kv-blocks",
            "256",
            "--metrics-port",
            str(engine_metrics),
            "--log-format",
            "json",
            env={**fast_export, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{collector.address}"},
        )
        frontend = None
        try:
            engine.wait_serving()
            frontend = start_frontend(
                engine.address,
                env=fast_export,
                extra=(
                    "--otlp-endpoint",
                    collector.address,
                    "--metrics-port",
                    str(frontend_metrics),
                    "--log-format",
                    "json",
                ),
            )
            frontend.wait_serving()
            yield (
                collector,
                engine,
                frontend,
                f"http://127.0.0.1:{engine_metrics}/metrics",
                f"http://127.0.0.1:{frontend_metrics}/metrics",
            )
        finally:
            if frontend is not None:
                frontend.terminate()
            engine.terminate()


async def test_one_trace_from_client_through_frontend_to_engine(stack):
    collector, engine, frontend, _, _ = stack
    provider = TracerProvider()  # the test's own client side, never the global provider
    with provider.get_tracer("test-client").start_as_current_span("client call") as client_span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            responses = await generate(
                stub_of(channel),
                text="Once upon a time",
                request_id="obs-trace-1",
                params=PARAMS,
                metadata=tuple(carrier.items()),
            )
    usage = responses[-1].usage
    ctx = client_span.get_span_context()
    trace_id, client_span_id = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")

    spans = await asyncio.to_thread(collector.wait_for, trace_id, {FRONTEND_SPAN, ENGINE_SPAN})
    front, eng = spans[FRONTEND_SPAN], spans[ENGINE_SPAN]
    assert (front.service, eng.service) == ("tandem-frontend", "tandem-engine")
    assert front.parent_span_id == client_span_id
    assert eng.parent_span_id == front.span_id
    assert front.kind == eng.kind == OtlpSpan.SPAN_KIND_SERVER

    assert eng.event_names == ["queued", "scheduled", "first_token", "finished"]
    times = [t for _, t, _ in eng.events]
    assert times == sorted(times) and eng.start_ns <= times[0] and times[-1] <= eng.end_ns
    a = eng.attributes
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage.cached_tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["tandem.num_preemptions"] == 0

    f = front.attributes
    assert f["rpc.system"] == "grpc" and f["rpc.method"] == "Generate" and f["rpc.grpc.status_code"] == 0
    assert f["gen_ai.usage.output_tokens"] == 6 and f["gen_ai.response.finish_reasons"] == ["length"]
    assert f["tandem.request_id"] == "obs-trace-1" and f["tandem.engine.address"] == engine.address
    assert a["tandem.request_id"] in f["tandem.engine.request_ids"]

    # The request's log line, as JSON with its fields as keys, carries the same trace id.
    line = await asyncio.to_thread(_wait_log_line, frontend, "obs-trace-1")
    assert line["trace_id"] == trace_id


async def test_unary_calls_get_spans_with_their_status_code(stack):
    collector, _, frontend, _, _ = stack
    provider = TracerProvider()
    with provider.get_tracer("test-client").start_as_current_span("client call") as client_span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub_of(channel).Detokenize(
                    g.DetokenizeRequest(token_ids=[10**6]), metadata=tuple(carrier.items()), timeout=10
                )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    name = "tandem.generate.v1.GenerateService/Detokenize"
    trace_id = format(client_span.get_span_context().trace_id, "032x")
    span = (await asyncio.to_thread(collector.wait_for, trace_id, {name}))[name]
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert span.parent_span_id == format(client_span.get_span_context().span_id, "016x")


def _wait_log_line(frontend, request_id: str, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for text in frontend.log().splitlines():
            if text.startswith("{"):
                entry = json.loads(text)
                if entry.get("request_id") == request_id:
                    return entry
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line for {request_id}:\n{frontend.log()}")
        time.sleep(0.05)


def _scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url, timeout=5) as page:
        text = page.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_metrics_move_by_what_the_requests_did(stack):
    _, _, frontend, engine_url, frontend_url = stack
    engine_before, frontend_before = _scrape(engine_url), _scrape(frontend_url)
    prompt = "The quick brown fox jumps over the lazy dog and keeps running far away. " * 2
    usages = []
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        for _ in range(3):  # one after the other: the later ones hit the prefix cache
            usages.append((await generate(stub_of(channel), text=prompt, params=PARAMS))[-1].usage)
    num_prompt = sum(u.prompt_tokens for u in usages)
    num_cached = sum(u.cached_tokens for u in usages)
    assert [u.completion_tokens for u in usages] == [6, 6, 6]

    e, fr = _scrape(engine_url), _scrape(frontend_url)
    d = lambda name, **labels: _delta(engine_before, e, name, **labels)  # noqa: E731
    assert d("tandem_engine_generation_tokens_total") == 18
    assert d("tandem_engine_prompt_tokens_total") == num_prompt
    assert d("tandem_engine_prompt_tokens_cached_total") == num_cached > 0
    assert d("tandem_engine_requests_finished_total", finish_reason="length") == 3
    for histogram in ("request_queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert d(f"tandem_engine_{histogram}_count") == 3, histogram
    assert d("tandem_engine_request_generation_tokens_sum") == 18
    assert d("tandem_engine_step_duration_seconds_count") >= 6
    assert e[("tandem_engine_requests_running", ())] == 0

    d = lambda name, **labels: _delta(frontend_before, fr, name, **labels)  # noqa: E731
    assert d("tandem_frontend_requests_total", code="OK") == 3
    assert d("tandem_frontend_requests_finished_total", finish_reason="length") == 3
    assert d("tandem_frontend_generation_tokens_total") == 18
    assert d("tandem_frontend_prompt_tokens_total") == num_prompt
    assert d("tandem_frontend_time_to_first_token_seconds_count") == 3
    assert d("tandem_frontend_e2e_request_latency_seconds_count") == 3
    assert d("tandem_frontend_request_generation_tokens_sum") == 18
    assert 0 < d("tandem_frontend_inter_token_latency_seconds_count") <= 3 * 5
    assert fr[("tandem_frontend_requests_in_flight", ())] == 0
    assert fr[("tandem_frontend_engines_connected", ())] == 1


async def test_json_logs_carry_the_request_fields(stack):
    _, engine, frontend, _, _ = stack
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        responses = await generate(stub_of(channel), text="hello", request_id="obs-log-1", params=PARAMS)
    usage = responses[-1].usage
    entry = await asyncio.to_thread(_wait_log_line, frontend, "obs-log-1")
    assert entry["level"] == "INFO" and entry["message"].startswith("Generate obs-log-1 OK")
    assert entry["engine"] == engine.address and entry["code"] == "OK" and entry["finish_reason"] == "length"
    assert (entry["prompt_tokens"], entry["completion_tokens"], entry["cached_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
    )
    assert 0 < entry["ttft_s"] <= entry["total_s"]
    for proc in (engine, frontend):
        lines = [line for line in proc.log().splitlines() if line.startswith("{")]
        assert lines and all(isinstance(json.loads(line), dict) for line in lines)
        assert any(json.loads(line)["message"].startswith("listening on") for line in lines)
