"""Server spans of the public RPCs, continuing the client's W3C trace context.

With tracing off the servicer holds ``tracer = None`` and none of this is called. With
it on, each RPC gets a SERVER span named ``tandem.generate.v1.GenerateService/METHOD``
(the RPC semantic conventions' name) whose parent is the ``traceparent`` metadata of
the call, if any. Generate passes its span's context to the engine inside the ``add``
message (``trace_context``), because the engine stream is shared by many calls and its
metadata cannot carry one context per request.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from frontend_svc.service.caller import Outcome

RPC_SERVICE = "tandem.generate.v1.GenerateService"
_PROPAGATED = ("traceparent", "tracestate", "baggage")
# Server-side span errors per the RPC semantic conventions; client mistakes are not errors.
_SERVER_ERRORS = {
    Outcome.UNKNOWN,
    Outcome.DEADLINE_EXCEEDED,
    Outcome.UNIMPLEMENTED,
    Outcome.INTERNAL,
    Outcome.UNAVAILABLE,
    Outcome.DATA_LOSS,
}


def start_rpc_span(tracer: trace.Tracer, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> trace.Span:
    """``metadata``: the call's metadata (an HTTP request's headers), which may continue a trace."""
    carrier = {k: v for k, v in (metadata or ()) if k in _PROPAGATED}
    parent = propagate.extract(carrier) if carrier else None
    return tracer.start_span(
        f"{RPC_SERVICE}/{method}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": RPC_SERVICE, "rpc.method": method},
    )


def end_rpc_span(span: trace.Span, outcome: Outcome, message: str = "") -> None:
    span.set_attribute("rpc.grpc.status_code", outcome.value)
    if outcome is not Outcome.OK:
        span.set_attribute("error.type", outcome.name)
    if outcome in _SERVER_ERRORS:
        span.set_status(Status(StatusCode.ERROR, f"{outcome.name}: {message}"))
    span.end()


def trace_context_of(span: trace.Span) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) that make a child of ``span`` elsewhere."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def traced(method: str):
    """Decorator for a unary servicer method: a span per call when ``self.tracer`` is set."""

    def wrap(fn):
        @functools.wraps(fn)
        async def wrapper(self, request, context):
            if self.tracer is None:
                return await fn(self, request, context)
            span = start_rpc_span(self.tracer, method, context.invocation_metadata())
            outcome = Outcome.OK
            try:
                return await fn(self, request, context)
            except BaseException:
                outcome = _outcome(context)
                raise
            finally:
                end_rpc_span(span, outcome)

        return wrapper

    return wrap


def _outcome(context: grpc.aio.ServicerContext) -> Outcome:
    """The code an abort() set, if this grpc version tells; else UNKNOWN."""
    try:
        code = context.code()
    except (AttributeError, NotImplementedError):
        return Outcome.UNKNOWN
    if isinstance(code, grpc.StatusCode):
        code = code.value[0]
    try:
        return Outcome(code)
    except ValueError:
        return Outcome.UNKNOWN
