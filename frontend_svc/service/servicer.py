"""The public API, tandem.generate.v1.GenerateService: each call planned, routed, streamed.

    GenerateRequest ── sizes checked ── convert ──▶ GenerateInput ── planning ──▶ Plan
                    ── router.route(), add() ──▶ engine
    engine ──▶ RequestHandle.take() ──▶ EngineOutput ── ChoiceProcessor (one per choice) ──▶ ChoiceOutput
           ── convert ──▶ GenerateResponse ── Call.write() ──▶ client

Errors follow the proto's contract: a CallError ends the call with the gRPC status its
ErrorCode names (INVALID_ARGUMENT names the field), UNAVAILABLE when no engine can serve
or the serving one went away; engine in-band errors pass through with their own code. An
engine that refuses (draining) or fails (dies, hangs) before anything was streamed to the
client gets the call retried once on another engine: the client cannot tell.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

import grpc

from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.handle import RequestHandle
from frontend_svc.engine.router import EngineRouter, PromptBlocks, Route
from frontend_svc.service import convert
from frontend_svc.service.flow import Call, InFlightCalls
from frontend_svc.service.message_plan import OutputParsers
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.planning import (
    MAX_DETOKENIZE_IDS,
    Plan,
    RequestLimits,
    check_ids,
    check_num_messages,
    check_sizes,
    encode_prompt,
    invalid,
    plan_generate,
    render_chat,
)
from frontend_svc.service.request_stats import GenerateStats
from frontend_svc.service.tracing import traced
from frontend_svc.text.output_processor import ChoiceProcessor, TokenTexts
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.types import (
    CallError,
    EngineRequestTooLargeError,
    EngineUnavailableError,
    ModelInfo,
    RequestError,
)
from tandem_common.types import ErrorCode
from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)


class EngineRefused(CallError):
    """An engine refused the request because it is draining (in-band UNAVAILABLE)."""


def _status(code: ErrorCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.value]  # ErrorCode values are the gRPC status names


class GenerateServiceServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        router: EngineRouter,
        *,
        limits: RequestLimits | None = None,
        calls: InFlightCalls | None = None,
        stream_interval: int = 0,
        metrics: FrontendMetrics | None = None,
        tracer=None,
        parsers: OutputParsers | None = None,
    ) -> None:
        self.router = router
        self.parsers = parsers or OutputParsers()
        self.stream_interval = stream_interval
        self.limits = limits if limits is not None else RequestLimits()
        self.calls = calls if calls is not None else InFlightCalls()
        self.metrics = metrics or FrontendMetrics()
        self.tracer = tracer  # None: tracing is off and no span is ever made
        self.tokenizer_problem: str | None = None  # why there is no tokenizer, when it is for good
        # The tokenizer with its cache of single-token texts, one value: None until it is loaded.
        self._texts: TokenTexts | None = None
        # Long tokenizations run on worker threads, at most one per core at once: more would
        # not finish sooner, and each holds ~100 bytes of memory per character of text.
        self._heavy = asyncio.Semaphore(os.cpu_count() or 1)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return None if self._texts is None else self._texts.tokenizer

    def set_tokenizer(self, tokenizer: Tokenizer) -> None:
        self._texts = TokenTexts(tokenizer)

    # -- Generate ---------------------------------------------------------------------------

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        stats = GenerateStats(self.metrics, self.tracer, context, request.request_id)
        code, message = grpc.StatusCode.CANCELLED, ""
        call: Call | None = None
        try:
            call = self.calls.enter(context)
            tokenizer, info = self._ready()
            check_sizes(convert.request_sizes(request), self.limits, info)
            plan = await self._off_loop(request, self._plan, request, tokenizer, info)
            operation = "chat" if request.WhichOneof("input") == "messages" else "text_completion"
            stats.planned(plan.prompt_token_ids, plan.n, plan.params, plan.text.stop, operation)
            await self._serve(plan, call, request, context, stats)
            code = grpc.StatusCode.OK
        except CallError as e:
            code, message = _status(e.code), str(e)
        except EngineUnavailableError as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        except asyncio.CancelledError:
            if call is None or not call.stalled:
                code = _ended_by_client(context)
                raise
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, self.calls.stalled_message()
        finally:
            if call is not None:
                self.calls.leave(call)
            stats.end(code, message)  # metrics, span, the request's log line
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)

    def _plan(self, request: generate_pb2.GenerateRequest, tokenizer: Tokenizer, info: ModelInfo) -> Plan:
        return plan_generate(convert.generate_input(request), tokenizer, info, self.limits, self.parsers)

    async def _serve(self, plan: Plan, call: Call, request, context, stats: GenerateStats) -> None:
        """Streams the plan's responses from one engine, or from a second one when the first
        refuses or fails before anything was written to the client."""
        # Choices 1..n-1 never ask for prompt logprobs: with n > 1 some choice can hit.
        prompt = PromptBlocks(plan.prompt_token_ids, prompt_logprobs=plan.n == 1 and plan.text.prompt_logprobs)
        sent = False
        tried: list[EngineClient] = []
        failure: Exception | None = None
        while True:
            try:
                route = await self.router.route(prompt, exclude=tried)
                client = route.client
            except EngineUnavailableError:
                if failure is not None:  # the retry found no engine: the first failure says more
                    raise failure from None
                raise
            try:
                async with contextlib.aclosing(self._stream(plan, route, request, context, stats)) as responses:
                    async for response in responses:
                        sent = True
                        await call.write(context, response)
                return
            except (EngineRefused, EngineUnavailableError) as e:
                if sent or tried:
                    raise
                logger.info(
                    "engine %s failed %s before anything was streamed (%s); trying another engine",
                    client.address,
                    stats.request_id or "-",
                    e,
                )
                tried.append(client)
                failure = e

    async def _stream(self, plan: Plan, route: Route, request, context, stats: GenerateStats):
        client = route.client
        wakeup = asyncio.Event()
        handles: list[RequestHandle] = []
        texts = self._token_texts()
        choices = [
            ChoiceProcessor(i, texts.tokenizer, plan.prompt_token_ids, plan.text_params(i), texts)
            for i in range(plan.n)
        ]

        def abort_unfinished(_context=None) -> None:
            live = [h.request_id for h in handles if not h.finished and not h.aborted]
            if live:
                client.abort(live)

        context.add_done_callback(abort_unfinished)
        try:
            arrival = time.time()
            rids = [uuid.uuid4().hex for _ in range(plan.n)]
            trace_context = stats.routed(client.address, rids, route.reason.value, route.predicted_cached_tokens)
            num_prefill_tokens = len(plan.prompt_token_ids) - (route.predicted_cached_tokens or 0)
            for i, rid in enumerate(rids):
                handles.append(
                    client.add(
                        rid,
                        plan.prompt_token_ids,
                        plan.engine_params(i),
                        priority=plan.priority,
                        trace_context=trace_context,
                        arrival_time=arrival,
                        wakeup=wakeup,
                        stream_interval=self.stream_interval,
                        num_prefill_tokens=num_prefill_tokens,
                    )
                )
            logger.debug(
                "Generate %s -> engine %s as %s",
                stats.request_id,
                client.address,
                ",".join(h.request_id for h in handles),
            )
            unfinished = set(range(plan.n))
            while unfinished:
                await wakeup.wait()
                wakeup.clear()
                # Everything that arrived while the client was slow is merged into one piece.
                for i in sorted(unfinished):
                    merged = handles[i].take()
                    if merged is None:
                        continue
                    # --stream-interval 1: one message per token, however the tokens came.
                    for out in merged.split() if self.stream_interval == 1 else (merged,):
                        if out.error is not None:
                            raise _engine_error(out.error)
                        piece = choices[i].process(out)
                        if piece is None:
                            continue
                        if piece.abort_engine:  # a stop string ended it: the engine counts a stop
                            client.abort([handles[i].request_id], stop_string=True)
                        if piece.finished:
                            unfinished.discard(i)
                        stats.piece(piece)
                        yield convert.generate_response(piece, plan.text.return_token_ids)
        except EngineRequestTooLargeError as e:
            raise CallError(ErrorCode.RESOURCE_EXHAUSTED, str(e)) from None
        finally:
            abort_unfinished()
            stats.generated(sum(c.num_output_tokens for c in choices))

    def _ready(self) -> tuple[Tokenizer, ModelInfo]:
        info = self.router.model_info
        if info is None:
            raise CallError(ErrorCode.UNAVAILABLE, "no engine is connected yet; retry later")
        return self._tokenizer(), info

    # -- unary RPCs ---------------------------------------------------------------------------

    @traced("Tokenize")
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            texts = self._token_texts()
            tokenizer = texts.tokenizer
            info = self.router.model_info
            max_model_len = info.max_model_len if info is not None else None
            which = request.WhichOneof("input")
            if which == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self._off_loop(
                    request, encode_prompt, "text", request.text, tokenizer, max_model_len, add_special
                )
            elif which == "messages":
                check_num_messages("messages.messages", len(request.messages.messages))
                ids = await self._off_loop(
                    request, lambda: render_chat(convert.chat(request.messages), tokenizer, max_model_len)
                )
            else:
                raise invalid("input", "set text or messages")
        except CallError as e:
            await context.abort(_status(e.code), str(e))
        tokens = await self._off_loop(request, lambda: [texts(t) for t in ids])
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    @traced("Detokenize")
    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            tokenizer = self._tokenizer()
            if len(request.token_ids) > MAX_DETOKENIZE_IDS:
                raise invalid(
                    "token_ids", f"at most {MAX_DETOKENIZE_IDS} ids are allowed, got {len(request.token_ids)}"
                )
            await self._off_loop(request, check_ids, "token_ids", request.token_ids, tokenizer.vocab_size)
        except CallError as e:
            await context.abort(_status(e.code), str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self._off_loop(request, tokenizer.decode, list(request.token_ids), skip)
        return generate_pb2.DetokenizeResponse(text=text)

    @traced("GetModelInfo")
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        info = self.router.model_info
        if info is not None:
            return convert.model_info_response(
                info,
                has_chat_template=self.tokenizer is not None and self.tokenizer.has_chat_template,
                num_engines=self.router.num_connected,
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine is connected yet; retry later")

    def _token_texts(self) -> TokenTexts:
        if self._texts is None:
            if self.tokenizer_problem is not None:
                raise CallError(ErrorCode.FAILED_PRECONDITION, self.tokenizer_problem)
            raise CallError(ErrorCode.UNAVAILABLE, "the tokenizer is not loaded yet; retry later")
        return self._texts

    def _tokenizer(self) -> Tokenizer:
        return self._token_texts().tokenizer

    async def _off_loop(self, request, fn, *args):
        """``fn(*args)`` on a worker thread when the request is large (see _OFF_LOOP_BYTES)."""
        if request.ByteSize() <= _OFF_LOOP_BYTES:
            return fn(*args)
        async with self._heavy:
            return await asyncio.to_thread(fn, *args)


# Requests larger than this (serialized) are tokenized on a worker thread, where inputs
# this long release the GIL (text/tokenizer.py, _LONG_INPUT): one long prompt must not
# stall the event loop, and with it every other call, stream and health check. Below it
# tokenizing takes well under a millisecond.
_OFF_LOOP_BYTES = 4096


def _engine_error(error: RequestError) -> CallError:
    """An engine's in-band error as the call's error (EngineRefused: it is draining)."""
    message = error.message
    if error.field and error.field not in message:
        message = f"{error.field}: {message}"
    return (EngineRefused if error.code is ErrorCode.UNAVAILABLE else CallError)(error.code, message)


def _ended_by_client(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """How a call that the client ended did end: its deadline passed (gRPC cancels the
    handler then, as for a cancel), or it was cancelled."""
    remaining = context.time_remaining()
    if remaining is not None and remaining < _DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


_DEADLINE_SLACK_S = 0.05  # gRPC's deadline timer and the clock time_remaining() reads may disagree a little


SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


def add_to_server(servicer: GenerateServiceServicer, server: grpc.aio.Server) -> None:
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
