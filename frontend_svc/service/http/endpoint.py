"""Every HTTP endpoint behind one wrapper; every generation endpoint a converter, an answer builder and one route.

    Endpoints.route(path, dialect, handler)     the body read (at most max_body_bytes: 413) and parsed,
                                                handler(request, body) ──▶ Response; an HttpError,
                                                CallError or EngineUnavailableError answered in the dialect
    Endpoints.generate(path, dialect, convert, answer)
        body ── convert ──▶ request (.input: GenerateInput, .model, .stream)
             ── GenerateCall.plan ──▶ Plan           (service/generate_call.py, as for gRPC)
             ── answer(request, model, plan) ──▶ Answer
        (a completions request with several prompts: a call per prompt, one answer; prompts.py)
        stream: false   the pieces added to the answer, cancelled if the client goes away; one JSON body
        stream: true    the first piece awaited (up to HOLD_S) before any byte, so that an error found
                        before the first token is answered with its status; then server-sent events:
                        the answer's start events, its events per piece (paced, pinged while none
                        comes), its end events; a later error as the dialect's error event; the
                        dialect's end of stream last

The call's figures, span and log line are the lifecycle's, as for gRPC: the request's
headers are its metadata (``traceparent`` continues the client's trace, the API key names
the client for its share). Its request id is the ``X-Request-Id`` header (else the body's
``request_id``, else a new one), echoed in the response's ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from frontend_svc.service.caller import Caller
from frontend_svc.service.generate_call import CallInput, GenerateCall
from frontend_svc.service.generation import Generation
from frontend_svc.service.http import sse
from frontend_svc.service.http.dialect import Dialect
from frontend_svc.service.http.errors import HttpError, bad_request
from frontend_svc.service.http.fields import unencodable_field
from frontend_svc.service.http.pacing import Pacer, paced
from frontend_svc.service.http.prompts import PromptCalls
from frontend_svc.service.planning import GenerateInput, RequestSizes
from frontend_svc.text.output_processor import ChoiceOutput
from frontend_svc.types import CallError, EngineUnavailableError
from tandem_common.types import ErrorCode

REQUEST_ID_HEADER = "x-request-id"
HOLD_S = sse.PING_S  # a stream's headers wait this long for its first piece (first_piece)
MAX_REQUEST_ID_CHARS = 256  # a client's request id, echoed in X-Request-Id


class Converted(Protocol):
    """A generation request as its converter made it."""

    input: GenerateInput
    model: str | None
    stream: bool


class Answer(Protocol):
    """An endpoint's answer, built from the call's pieces: whole, or as (event name, data) pairs."""

    def add(self, piece: ChoiceOutput) -> None: ...
    def response(self) -> dict: ...
    def start_events(self) -> list[tuple[str, dict]]: ...
    def events(self, piece: ChoiceOutput) -> list[tuple[str, dict]]: ...
    def end_events(self) -> list[tuple[str, dict]]: ...


@runtime_checkable
class FailingAnswer(Protocol):
    """An answer that says a stream's failure in its own events (the Responses API's
    numbered ``error`` and ``response.failed``); any other gets the dialect's error event."""

    def failed_events(self, error: HttpError) -> list[tuple[str, dict]]: ...


class Endpoints:
    def __init__(self, generation: Generation, max_body_bytes: int) -> None:
        self.generation = generation
        self.max_body_bytes = max_body_bytes
        self.pacer = Pacer()  # streamed calls coalesce while the frontend is busy (pacing.py)

    def route(
        self,
        path: str,
        dialect: Dialect,
        handler: Callable[..., Awaitable[Response]],
        *,
        method: str = "POST",
        body: bool | None = None,
    ) -> Route:
        """``handler(request, body)`` (without a body, a GET's or DELETE's unless ``body``:
        ``handler(request)``), its errors in ``dialect``."""
        reads_body = method == "POST" if body is None else body

        async def endpoint(request: Request) -> Response:
            try:
                if not reads_body:
                    return await handler(request)
                return await handler(request, await read_body(request, self.max_body_bytes))
            except (HttpError, CallError, EngineUnavailableError) as e:
                return dialect.response(e)

        return Route(path, endpoint, methods=[method])

    def generate(
        self,
        path: str,
        dialect: Dialect,
        convert: Callable[[Any], Converted],
        answer: Callable[[Any, str, Any], Answer],  # its plan: a Plan, or Plans for several prompts
    ) -> Route:
        async def handler(request: Request, body: Any) -> Response:
            request_id = call_request_id(request, body)
            echo = {REQUEST_ID_HEADER: request_id}
            req: Converted | None = None
            try:
                req = convert(body)
                attributes = {"http.request.method": request.method, "http.route": request.url.path}

                def new_call() -> GenerateCall:
                    return GenerateCall(self.generation, caller_of(request), request_id, attributes)

                # Several prompts (completions): a call each, one answer (prompts.py).
                gens = getattr(req, "prompts", None) or [req.input]
                inputs = [call_input(gen, req.model, request_id) for gen in gens]
                call: GenerateCall | PromptCalls = new_call() if len(gens) == 1 else PromptCalls(new_call, len(gens))
                try:
                    plan: Any = await (call.plan(inputs) if isinstance(call, PromptCalls) else call.plan(inputs[0]))
                    reply = answer(req, call.model, plan)
                    if not req.stream:
                        await until_disconnect(request, _collect(call.pieces(plan), reply))
                        return Response(sse.dumps(reply.response()), media_type="application/json", headers=echo)
                    pieces = call.pieces(plan)
                    first = await first_piece(pieces)
                except BaseException:
                    call.end()  # a call whose pieces never ran ends here
                    raise
            except (HttpError, CallError, EngineUnavailableError) as e:
                response = dialect.response(e, getattr(req, "param_name", None))
                response.headers[REQUEST_ID_HEADER] = request_id
                return response
            events = self._events(_primed(first, pieces), reply, dialect)
            return CallStream(events, call, request_id, lambda: _close(first, pieces))

        return self.route(path, dialect, handler)

    async def _events(
        self, pieces: AsyncGenerator[ChoiceOutput, None], answer: Answer, dialect: Dialect
    ) -> AsyncGenerator[bytes, None]:
        try:
            for name, obj in answer.start_events():
                yield dialect.event(name, obj)
            async with contextlib.aclosing(pieces):
                async for piece in sse.with_pings(paced(pieces, self.pacer)):
                    if piece is None:
                        yield dialect.ping
                        continue
                    for name, obj in answer.events(piece):
                        yield dialect.event(name, obj)
            for name, obj in answer.end_events():
                yield dialect.event(name, obj)
        except (CallError, EngineUnavailableError) as e:
            if isinstance(answer, FailingAnswer):
                for name, obj in answer.failed_events(dialect.error(e)):
                    yield dialect.event(name, obj)
            else:
                yield dialect.stream_error(e)
        if dialect.done:
            yield dialect.done


def caller_of(request: Request) -> Caller:
    host, port = (request.client.host, request.client.port) if request.client else ("", 0)
    peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"  # as gRPC writes a peer
    return Caller(tuple(request.headers.items()), peer)


def call_request_id(request: Request, body: Any) -> str:
    """The call's request id: the client's X-Request-Id header, else vLLM's ``request_id``
    body field, else a new one; the logs, the span and the response's X-Request-Id carry it."""
    given = request.headers.get(REQUEST_ID_HEADER)  # a header's value: latin-1 already
    if not given and isinstance(body, dict) and isinstance(body.get("request_id"), str):
        given = body["request_id"]
        # Echoed in a header: printable ASCII only, as a header's value can carry it.
        if len(given) > MAX_REQUEST_ID_CHARS or not (given.isascii() and given.isprintable()):
            raise bad_request("request_id", f"must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters")
    return given or uuid.uuid4().hex


def call_input(gen: GenerateInput, model: str | None, request_id: str = "") -> CallInput:
    p = gen.params
    sizes = RequestSizes(
        request_id_chars=len(request_id),
        input=gen.input,
        num_token_ids=len(gen.token_ids),
        num_messages=len(gen.chat.messages) if gen.chat is not None else 0,
        num_stop=len(gen.stop),
        num_stop_token_ids=len(p.stop_token_ids),
        num_logit_bias=len(p.logit_bias),
    )
    return CallInput(model, sizes, input_chars(gen), gen)


def input_chars(gen: GenerateInput) -> int:
    """What planning will read, in characters: it decides whether planning leaves the event
    loop, so the tools' schemas (each compiled while planning) count too."""
    tools = sum(len(t.parameters) + len(t.description) for t in gen.tools.tools) if gen.tools is not None else 0
    if gen.chat is not None:
        return sum(len(m["content"]) for m in gen.chat.messages) + tools
    return len(gen.text) + 4 * len(gen.token_ids) + tools


async def first_piece(pieces: AsyncGenerator[ChoiceOutput, None]) -> asyncio.Future:
    """The stream's first piece, as a task awaited up to HOLD_S before any byte is sent: an
    error the engines find before the first token (a regex or grammar that does not compile,
    a prompt too long for the engine) raises here, so that it is answered with its own status
    (400) instead of 200 and an error event. Past HOLD_S (a long prompt prefilling) the stream
    starts, and pings keep it open while the task goes on."""
    first = asyncio.ensure_future(anext(pieces))
    try:
        await asyncio.wait({first}, timeout=HOLD_S)
    except BaseException:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        raise
    if first.done() and not first.cancelled():
        error = first.exception()
        if error is not None and not isinstance(error, StopAsyncIteration):
            raise error
    return first


async def _primed(
    first: asyncio.Future, pieces: AsyncGenerator[ChoiceOutput, None]
) -> AsyncGenerator[ChoiceOutput, None]:
    """``first``'s piece, then the rest of ``pieces``; closing it closes ``pieces``."""
    try:
        try:
            piece = await first
        except StopAsyncIteration:
            return
        yield piece
        async for piece in pieces:
            yield piece
    finally:
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        await pieces.aclose()


async def _close(first: asyncio.Future, pieces: AsyncGenerator[ChoiceOutput, None]) -> None:
    """The call's pieces closed (its engine requests aborted) when the stream that would have
    read them never started: ``first`` stopped before ``pieces`` is closed, since a generator
    cannot be closed while a task runs it. Nothing to do after a stream that ran."""
    if not first.done():
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await pieces.aclose()


async def _collect(pieces: AsyncGenerator[ChoiceOutput, None], answer: Answer) -> None:
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            answer.add(piece)


async def until_disconnect(request: Request, work: Awaitable[None]) -> None:
    """Runs ``work`` (a whole answer) unless the client disconnects first, which cancels it
    and so aborts its engine requests at once; raises what ``work`` raises."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not watch.done():
                raise  # this handler itself was cancelled (shutdown)
            # The client went away: the answer reaches nobody; the call ended CANCELLED.
            raise CallError(ErrorCode.UNAVAILABLE, "the client disconnected") from None
    finally:
        watch.cancel()
        task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class CallStream(StreamingResponse):
    """An SSE response that ends its call however the response ends: a client that goes
    away before the first chunk leaves the body generator unstarted, and the call's pieces
    (already started: the first one was awaited before the headers) are closed by
    ``close`` and the call ended here."""

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        call: GenerateCall | PromptCalls,
        request_id: str,
        close: Callable[[], Awaitable[None]],
    ) -> None:
        headers = {**sse.HEADERS, REQUEST_ID_HEADER: request_id}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.call = call
        self._content = content  # an async generator
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # a stream cut mid-way: its engine requests are aborted now
                await self._close()
            finally:
                self.call.end()  # the call's admission slot, whatever closing raised


async def read_body(request: Request, max_bytes: int) -> Any:
    """The request's JSON body: at most ``max_bytes`` (413), valid JSON, every string text (400)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise HttpError(400, "the client went away before the body was read") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"the request body is not valid JSON: {e}") from None
    field = unencodable_field(raw, body)
    if field is not None:
        raise bad_request(
            field, "holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair), which is not text"
        )
    return body


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the request body is larger than this server's limit of {limit} bytes")
