"""A W3C traceparent on an HTTP request continues the client's trace through the frontend to the engine."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tests.observability.collector import Collector
from tests.rpc.http_face import http_base
from tests.services import start_engine, start_frontend

FRONTEND_SPAN = "tandem.generate.v1.GenerateService/Generate"
ENGINE_SPAN = "tandem.engine.request"


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    with Collector() as collector:
        fast_export = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": ""}
        env = {**fast_export, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{collector.address}"}
        engine = start_engine(demo_model_dir, "--num-kv-blocks", "256", env=env)
        frontend = None
        try:
            engine.wait_serving()
            extra = ("--otlp-endpoint", collector.address, "--http-port", "0")
            frontend = start_frontend(engine.address, env=fast_export, extra=extra)
            yield collector, engine, http_base(frontend)
        finally:
            if frontend is not None:
                frontend.terminate()
            engine.terminate()


def test_an_http_request_joins_the_clients_trace(stack):
    collector, _, base = stack
    provider = TracerProvider()  # the test's own client side, never the global provider
    with provider.get_tracer("test-client").start_as_current_span("client call") as client_span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        body = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(base + "/v1/completions", json=body, headers={**carrier, "x-request-id": "http-1"})
    assert response.status_code == 200
    ctx = client_span.get_span_context()
    trace_id, client_span_id = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
    spans = collector.wait_for(trace_id, {FRONTEND_SPAN, ENGINE_SPAN})
    front, engine = spans[FRONTEND_SPAN], spans[ENGINE_SPAN]
    assert front.parent_span_id == client_span_id and engine.parent_span_id == front.span_id
    assert front.attributes["http.route"] == "/v1/completions" and front.attributes["tandem.request_id"] == "http-1"
    assert front.attributes["gen_ai.usage.output_tokens"] == 4
