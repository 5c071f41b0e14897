"""One generation request of the HTTP face: admitted, planned and streamed like a gRPC Generate call.

    HttpRun(generation, request) ── plan(GenerateInput) ──▶ Plan   (calls.enter, ready, check_sizes, Generation.plan)
                                 ── pieces(plan) ──▶ ChoiceOutput ...  (Generation.stream: routing, engines, text)
                                 ── end()                            (metrics, span, the request's log line)
    until_disconnect(request, run, collect(...))   a whole answer, cancelled if the client goes away

The figures, span and log line are GenerateStats', as for gRPC: the HTTP request's
``traceparent`` header continues the client's trace, and its final state is told with
the gRPC status code of the same meaning (OK, CANCELLED for a client that went away).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from starlette.requests import Request
from starlette.responses import StreamingResponse

from frontend_svc.service.flow import Call
from frontend_svc.service.generation import Generation
from frontend_svc.service.planning import GenerateInput, Plan, RequestSizes, check_sizes
from frontend_svc.service.request_stats import GenerateStats
from frontend_svc.types import CallError, EngineUnavailableError
from tandem_common.types import ErrorCode


class _CallContext:
    """What GenerateStats and the fair share read of a gRPC context, from an HTTP request:
    its headers as metadata (trace context, API key) and its peer (the client's address)."""

    def __init__(self, request: Request) -> None:
        self._pairs = list(request.headers.items())
        host, port = (request.client.host, request.client.port) if request.client else ("", 0)
        self._peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def invocation_metadata(self):
        return self._pairs

    def peer(self) -> str:
        return self._peer


class HttpRun:
    def __init__(self, generation: Generation, request: Request) -> None:
        self.generation = generation
        request_id = request.headers.get("x-request-id", "")
        self._context = _CallContext(request)
        self.stats = GenerateStats(generation.metrics, generation.tracer, self._context, request_id)
        if self.stats.span is not None:  # the Generate span, told apart from a gRPC call's
            self.stats.span.set_attributes({"http.request.method": request.method, "http.route": request.url.path})
        self.code, self.message = grpc.StatusCode.CANCELLED, ""
        self._call: Call | None = None
        self._ended = False

    async def plan(self, gen: GenerateInput, operation: str) -> Plan:
        """The checked plan, or CallError (the run is ended then)."""
        g = self.generation
        try:
            self._call = g.calls.enter(self._context)
            tokenizer, info = g.ready()
            check_sizes(_sizes(gen), g.limits, info)
            plan = await g.plan(gen, tokenizer, info, _input_chars(gen))
        except CallError as e:
            self.failed(e)
            self.end()
            raise
        self.stats.planned(plan.prompt_token_ids, plan.n, plan.params, plan.text.stop, operation)
        return plan

    def pieces(self, plan: Plan):
        return self.generation.stream(plan, self.stats)

    def ok(self) -> None:
        self.code, self.message = grpc.StatusCode.OK, ""

    def failed(self, error: Exception) -> None:
        code = getattr(error, "code", None)
        self.code = grpc.StatusCode[code.value] if code is not None else grpc.StatusCode.UNAVAILABLE
        self.message = str(error)

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._call is not None:
            self.generation.calls.leave(self._call)
        self.stats.end(self.code, self.message)


def _sizes(gen: GenerateInput) -> RequestSizes:
    p = gen.params
    return RequestSizes(
        input=gen.input,
        num_token_ids=len(gen.token_ids),
        num_messages=len(gen.chat.messages) if gen.chat is not None else 0,
        num_stop=len(gen.stop),
        num_stop_token_ids=len(p.stop_token_ids),
        num_logit_bias=len(p.logit_bias),
    )


def _input_chars(gen: GenerateInput) -> int:
    if gen.chat is not None:
        return sum(len(m["content"]) for m in gen.chat.messages)
    return len(gen.text) + 4 * len(gen.token_ids)


def as_call_error(e: Exception) -> CallError:
    return e if isinstance(e, CallError) else CallError(ErrorCode.UNAVAILABLE, str(e))


async def collect(run: HttpRun, pieces, add) -> None:
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            add(piece)


async def until_disconnect(request: Request, run: HttpRun, work) -> CallError | None:
    """Runs ``work`` (a whole non-streamed answer) unless the client disconnects first,
    which cancels it and so aborts its engine requests at once. Returns the request's
    error, if any; the run is ended either way."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
        try:
            await task
            run.ok()
            return None
        except (CallError, EngineUnavailableError) as e:
            run.failed(e)
            return as_call_error(e)
        except asyncio.CancelledError:
            if not watch.done():
                raise  # this handler itself was cancelled (shutdown)
            # The client went away: the answer reaches nobody; the run ends CANCELLED.
            return CallError(ErrorCode.UNAVAILABLE, "the client disconnected")
    finally:
        watch.cancel()
        task.cancel()
        run.end()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RunStream(StreamingResponse):
    """An SSE response that ends its run however the response ends: a client that goes
    away before the first chunk leaves the body generator unstarted, and its finally
    (which ends the run) never runs; this one's does."""

    def __init__(self, content, run: HttpRun, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.run = run
        self._content = content  # an async generator

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()  # a stream cut mid-way: its engine requests are aborted now
            self.run.end()
