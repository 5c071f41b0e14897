"""OTEL_TRACES_EXPORTER=console prints both services' spans on standard output (issue 18,
item 16): a look at traces without running a collector."""

from __future__ import annotations

import json

import grpc

from tests.rpc.frontend_calls import generate, stub_of
from tests.services import running_pair

CONSOLE = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _spans(stdout: str) -> list[dict]:
    """The ConsoleSpanExporter writes one indented JSON object per span."""
    decoder, spans, pos = json.JSONDecoder(), [], 0
    while (start := stdout.find("{", pos)) >= 0:
        span, pos = decoder.raw_decode(stdout, start)
        spans.append(span)
    return spans


async def test_console_exporter_on_both_services(demo_model_dir):
    with running_pair(demo_model_dir, env=CONSOLE, capture_stdout=True) as (engine, frontend):
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            await generate(stub_of(channel), text="hello", params=dict(max_tokens=3, ignore_eos=True))
    # Stopped: each provider flushed its last spans on the way out.
    engine_spans = [s["name"] for s in _spans(engine.stdout())]
    frontend_spans = [s["name"] for s in _spans(frontend.stdout())]
    assert "tandem.engine.request" in engine_spans, engine.stdout()[-2000:]
    assert "tandem.generate.v1.GenerateService/Generate" in frontend_spans, frontend.stdout()[-2000:]
    assert "tracing to standard output" in engine.log() and "tracing to standard output" in frontend.log()
