"""With tracing off (no --otlp-endpoint, no OTEL_EXPORTER_OTLP_*ENDPOINT) nothing is traced:
no span object of any kind is created, the global tracer provider is never set, and
neither service attaches a tracer. Both services run in this process to count spans."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.trace.span import NonRecordingSpan

from engine_svc.config import EngineConfig
from engine_svc.service.server import EngineServer
from frontend_svc.config import FrontendConfig
from frontend_svc.service.server import FrontendServer
from tandem_common.tracing import ENDPOINT_VARIABLES, EXPORTER_VARIABLE
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.frontend_calls import generate, stub_of


@pytest.fixture
def span_count(monkeypatch):
    """Counts spans made in this process: constructions, and starts on any kind of tracer
    (a no-op tracer hands out one shared invalid span without constructing it)."""
    count = [0]

    def counted(cls, name):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counted(NonRecordingSpan, "__init__")
    counted(sdk_trace.Span, "__init__")
    for tracer_class in (trace.ProxyTracer, trace.NoOpTracer, sdk_trace.Tracer):
        counted(tracer_class, "start_span")
        counted(tracer_class, "start_as_current_span")
    return count


def test_the_span_counter_sees_no_op_spans(span_count):
    trace.get_tracer("probe").start_span("probe").end()
    assert span_count[0] > 0


async def test_no_span_is_created_when_tracing_is_off(demo_model_dir, span_count, monkeypatch):
    for name in (*ENDPOINT_VARIABLES, EXPORTER_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    engine = EngineServer(EngineConfig(model=str(demo_model_dir), port=0, num_kv_blocks=64))
    frontend = None
    try:
        await engine.start()
        await engine.load()
        frontend = FrontendServer(FrontendConfig(engines=[f"127.0.0.1:{engine.port}"], port=0, shutdown_timeout=1))
        await frontend.start()
        for _ in range(400):
            if frontend.router.healthy and frontend.servicer.tokenizer is not None:
                break
            await asyncio.sleep(0.05)
        traceparent = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
            stub = stub_of(channel)
            responses = await generate(
                stub, text="hello", metadata=traceparent, params=dict(max_tokens=4, ignore_eos=True, n=2)
            )
            assert sum(r.usage.completion_tokens for r in responses if r.HasField("usage")) == 8
            await stub.Tokenize(g.TokenizeRequest(text="hello"), metadata=traceparent, timeout=10)

        assert span_count[0] == 0
        assert frontend.servicer.tracer is None and frontend.tracer_provider is None
        assert engine.tracer_provider is None
        assert engine.engine.events is None and engine.engine.core.scheduler.observer is None
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    finally:
        if frontend is not None:
            await frontend.stop()
        await engine.drain_and_stop()
