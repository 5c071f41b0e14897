"""One OpenTelemetry span per engine request, built from lifecycle events.

The span ``tandem.engine.request`` is a child of the frontend's span, whose W3C trace
context arrives in ``Add.trace_context``. Its events, in order::

    queued ─ scheduled ─ first_token ─ [preempted ...] ─ finished

Attributes use the OpenTelemetry GenAI names where they exist (``gen_ai.request.*``,
``gen_ai.usage.*``, ``gen_ai.response.finish_reasons``) and ``tandem.*`` otherwise.
Everything here runs on the engine thread at lifecycle events only, and only when
tracing is on (``tandem_common.tracing.setup_tracing`` returned a provider).
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine_svc.outputs import EngineOutput
from engine_svc.service.lifecycle import RequestListener, RequestTimeline
from engine_svc.types import FinishReason
from tandem_common.logs import printable

SPAN_NAME = "tandem.engine.request"


def request_attributes(timeline: RequestTimeline, model_name: str) -> dict:
    request = timeline.request
    p = request.sampling_params
    attributes = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": model_name,
        "gen_ai.request.max_tokens": p.max_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.top_k": p.top_k,
        "gen_ai.request.presence_penalty": p.presence_penalty,
        "gen_ai.request.frequency_penalty": p.frequency_penalty,
        "gen_ai.usage.input_tokens": request.num_prompt_tokens,
        "tandem.request_id": printable(request.client_request_id),  # client-chosen: escaped, bounded
        "tandem.engine.request_id": request.request_id,
        "tandem.request.priority": request.priority,
        "tandem.request.min_tokens": p.min_tokens,
    }
    if p.seed is not None:
        attributes["gen_ai.request.seed"] = p.seed
    return attributes


class RequestTracer(RequestListener):
    def __init__(self, tracer: trace.Tracer, model_name: str) -> None:
        self.tracer = tracer
        self.model_name = model_name

    def on_queued(self, timeline: RequestTimeline) -> None:
        carrier = timeline.request.trace_context
        parent = propagate.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=timeline.queued_ns,
            attributes=request_attributes(timeline, self.model_name),
        )
        span.add_event("queued", timestamp=timeline.queued_ns)
        timeline.span = span

    def on_scheduled(self, timeline: RequestTimeline) -> None:
        request = timeline.request
        timeline.span.add_event(
            "scheduled", {"tandem.cached_tokens": max(0, request.num_cached_tokens)}, timestamp=timeline.scheduled_ns
        )

    def on_first_token(self, timeline: RequestTimeline) -> None:
        timeline.span.add_event("first_token", timestamp=timeline.first_token_ns)

    def on_preempted(self, timeline: RequestTimeline, now_ns: int) -> None:
        timeline.span.add_event(
            "preempted", {"tandem.output_tokens": timeline.request.num_output_tokens}, timestamp=now_ns
        )

    def on_finished(self, timeline: RequestTimeline, output: EngineOutput) -> None:
        span, request = timeline.span, timeline.request
        reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
        span.set_attributes(
            {
                "gen_ai.usage.output_tokens": request.num_output_tokens,
                "gen_ai.usage.cache_read.input_tokens": output.num_cached_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "tandem.num_preemptions": request.num_preemptions,
            }
        )
        if timeline.scheduled_ns:
            span.set_attribute("tandem.queue_time_s", timeline.queue_time_s)
        if timeline.first_token_ns:
            span.set_attribute("tandem.time_to_first_token_s", timeline.time_to_first_token_s)
        span.add_event("finished", {"gen_ai.response.finish_reasons": [reason]}, timestamp=timeline.finished_ns)
        if output.finish_reason is FinishReason.ERROR and output.error is not None:
            span.set_attribute("error.type", output.error.code.value)
            span.set_status(Status(StatusCode.ERROR, output.error.message))
        span.end(end_time=timeline.finished_ns)
