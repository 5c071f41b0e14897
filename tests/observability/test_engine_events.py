"""Engine request spans from lifecycle events, in process, with an in-memory exporter:
event order under preemption, the parent from ``trace_context``, refusals and aborts."""

from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.service.engine_loop import AddCommand, EngineLoop
from engine_svc.service.tracing import RequestTracer
from engine_svc.types import SamplingParams

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def core(demo_model_dir):
    # 4 blocks of 16 tokens: two requests of 20 + 30 tokens cannot both fit, so one is preempted.
    return EngineCore(
        EngineConfig(model=str(demo_model_dir), num_kv_blocks=4, block_size=16, max_num_batched_tokens=64)
    )


@pytest.fixture
def traced(core):
    """(loop, exporter): an EngineLoop whose requests are traced into memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop = EngineLoop(core)
    loop.add_listener(RequestTracer(provider.get_tracer("test"), core.model_name))
    loop.start()
    yield loop, exporter
    loop.stop()
    core.scheduler.observer = None


def run(loop: EngineLoop, commands: list[AddCommand], timeout: float = 60.0) -> list:
    """Adds ``commands`` on one stream and waits until all of them finished."""
    done, outputs = threading.Event(), []

    def sink(outs, load):
        if outs is None:
            done.set()
        else:
            outputs.extend(outs)

    sid = loop.open_stream(sink)
    for cmd in commands:
        loop.add(sid, cmd)
    loop.half_close(sid)
    assert done.wait(timeout), "requests did not finish"
    return outputs


def test_events_in_order_with_preemptions_and_the_frontend_as_parent(traced, core):
    loop, exporter = traced
    preemptions_before = core.scheduler.num_preemptions
    context = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    run(loop, [AddCommand(f"r{i}", list(range(1, 21)), LONG, trace_context=context) for i in range(2)])

    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.attributes["tandem.request_id"])
    assert [s.name for s in spans] == ["tandem.engine.request"] * 2
    num_preempted = 0
    for span in spans:
        names = [e.name for e in span.events]
        assert names[:2] == ["queued", "scheduled"] and names[-1] == "finished", names
        assert names.count("first_token") == 1 and set(names) <= {
            "queued",
            "scheduled",
            "first_token",
            "preempted",
            "finished",
        }
        times = [e.timestamp for e in span.events]
        assert times == sorted(times)
        num_preempted += names.count("preempted")
        assert names.count("preempted") == span.attributes["tandem.num_preemptions"]
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_ID and span.parent.is_remote
        a = span.attributes
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (20, 30)
        assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.request.max_tokens"] == 30
    assert num_preempted == core.scheduler.num_preemptions - preemptions_before > 0


def test_a_refused_request_still_gets_a_span_with_an_error(traced, core):
    loop, exporter = traced
    (out,) = run(loop, [AddCommand("bad", [core.vocab_size + 5], LONG)])
    assert out.error is not None
    (span,) = exporter.get_finished_spans()
    assert [e.name for e in span.events] == ["queued", "finished"]
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert span.parent is None  # no trace context: a root span


def test_closing_the_stream_ends_the_spans_as_aborted(traced):
    loop, exporter = traced
    first_output = threading.Event()

    def sink(outs, load) -> None:
        if not first_output.is_set():  # close on the first output: applied before the next step
            first_output.set()
            loop.close_stream(sid)

    sid = loop.open_stream(sink)
    # 10 + 54 tokens: as many as the 4 blocks of 16 hold, so it is admitted.
    loop.add(sid, AddCommand("long", list(range(1, 11)), SamplingParams(max_tokens=54, ignore_eos=True)))
    assert first_output.wait(30)
    for _ in range(200):
        if exporter.get_finished_spans():
            break
        threading.Event().wait(0.05)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert [e.name for e in span.events][-1] == "finished"
