"""The public API, tandem.generate.v1.GenerateService: each call planned, routed, streamed.

    GenerateRequest ── convert ──▶ GenerateInput ── planning ──▶ Plan ── router.route(), add() ──▶ engine
    engine ──▶ RequestHandle.take() ──▶ EngineOutput ── ChoiceProcessor (one per choice) ──▶ ChoiceOutput
           ── convert ──▶ GenerateResponse (streamed)

Errors follow the proto's contract: a RequestError ends the call with the gRPC status its
ErrorCode names (INVALID_ARGUMENT names the field), UNAVAILABLE when no engine can serve
or the serving one went away; engine in-band errors pass through with their own code. A
draining engine that refuses before anything was sent is retried once on another engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from frontend_svc.engine.router import EngineRouter, PromptBlocks, Route
from frontend_svc.engine.types import EngineUnavailableError, ModelInfo
from frontend_svc.service import convert
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.planning import Plan, RequestError, check_ids, invalid, plan_generate, render_chat
from frontend_svc.service.request_stats import GenerateStats
from frontend_svc.service.tracing import traced
from frontend_svc.text.output_processor import ChoiceProcessor, TokenTexts
from frontend_svc.text.tokenizer import Tokenizer
from tandem_common.types import ErrorCode
from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)


class EngineRefused(RequestError):
    """An engine refused the request because it is draining (in-band UNAVAILABLE)."""


def _status(code: ErrorCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.value]  # ErrorCode values are the gRPC status names


class GenerateServiceServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        router: EngineRouter,
        *,
        max_n: int = 16,
        max_stop_strings: int = 16,
        stream_interval: int = 1,
        metrics: FrontendMetrics | None = None,
        tracer=None,
    ) -> None:
        self.router = router
        self.stream_interval = stream_interval
        self.max_n = max_n
        self.max_stop_strings = max_stop_strings
        self.metrics = metrics or FrontendMetrics()
        self.tracer = tracer  # None: tracing is off and no span is ever made
        self.tokenizer: Tokenizer | None = None
        self._texts: TokenTexts | None = None

    def set_tokenizer(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts = TokenTexts(tokenizer)

    # -- Generate ---------------------------------------------------------------------------

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        stats = GenerateStats(self.metrics, self.tracer, context, request.request_id)
        code, message = grpc.StatusCode.CANCELLED, ""
        try:
            tokenizer, info = self._ready()
            plan = await _off_loop(request, self._plan, request, tokenizer, info)
            operation = "chat" if request.WhichOneof("input") == "messages" else "text_completion"
            stats.planned(plan.prompt_token_ids, plan.n, plan.params, plan.text.stop, operation)
            # Choices 1..n-1 never ask for prompt logprobs: with n > 1 some choice can hit.
            prompt = PromptBlocks(plan.prompt_token_ids, prompt_logprobs=plan.n == 1 and plan.text.prompt_logprobs)
            sent, tried = False, []
            while True:
                route = await self.router.route(prompt, exclude=tried)
                client = route.client
                try:
                    async for response in self._stream(plan, route, request, context, stats):
                        sent = True
                        yield response
                    break
                except EngineRefused as e:
                    # A draining engine refused before anything was sent: try another one once.
                    if sent or tried:
                        raise
                    logger.info(
                        "engine %s refused %s (%s); trying another engine", client.address, request.request_id or "-", e
                    )
                    tried.append(client)
            code = grpc.StatusCode.OK
        except RequestError as e:
            code, message = _status(e.code), str(e)
        except EngineUnavailableError as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        finally:
            stats.end(code, message)  # metrics, span, the request's log line
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            await context.abort(code, message)

    def _plan(self, request: generate_pb2.GenerateRequest, tokenizer: Tokenizer, info: ModelInfo) -> Plan:
        return plan_generate(
            convert.generate_input(request), tokenizer, info, max_n=self.max_n, max_stop_strings=self.max_stop_strings
        )

    async def _stream(self, plan: Plan, route: Route, request, context, stats: GenerateStats):
        client = route.client
        wakeup = asyncio.Event()
        handles = []
        choices = [
            ChoiceProcessor(i, self.tokenizer, plan.prompt_token_ids, plan.text_params(i), self._texts)
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
                request.request_id or "-",
                client.address,
                ",".join(h.request_id for h in handles),
            )
            unfinished = set(range(plan.n))
            while unfinished:
                await wakeup.wait()
                wakeup.clear()
                # Everything that arrived while the client was slow is merged into one piece.
                for i in sorted(unfinished):
                    out = handles[i].take()
                    if out is None:
                        continue
                    if out.error is not None:
                        message = out.error.message
                        if out.error.field and out.error.field not in message:
                            message = f"{out.error.field}: {message}"
                        error = EngineRefused if out.error.code is ErrorCode.UNAVAILABLE else RequestError
                        raise error(out.error.code, message)
                    piece = choices[i].process(out)
                    if piece is None:
                        continue
                    if piece.abort_engine:
                        handles[i].abort()
                    if piece.finished:
                        unfinished.discard(i)
                    stats.piece(piece)
                    yield convert.generate_response(piece, plan.text.return_token_ids)
        finally:
            abort_unfinished()

    def _ready(self) -> tuple[Tokenizer, ModelInfo]:
        info = self.router.model_info
        if info is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "no engine is connected yet; retry later")
        return self._tokenizer(), info

    # -- unary RPCs ---------------------------------------------------------------------------

    @traced("Tokenize")
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            tokenizer = self._tokenizer()
            which = request.WhichOneof("input")
            if which == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await _off_loop(request, tokenizer.encode, request.text, add_special)
            elif which == "messages":
                ids = await _off_loop(request, lambda: render_chat(convert.chat(request.messages), tokenizer))
            else:
                raise invalid("input", "set text or messages")
        except RequestError as e:
            await context.abort(_status(e.code), str(e))
        tokens = await _off_loop(request, lambda: [self._texts(t) for t in ids])
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    @traced("Detokenize")
    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            tokenizer = self._tokenizer()
            await _off_loop(request, check_ids, "token_ids", request.token_ids, tokenizer.vocab_size)
        except RequestError as e:
            await context.abort(_status(e.code), str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await _off_loop(request, tokenizer.decode, list(request.token_ids), skip)
        return generate_pb2.DetokenizeResponse(text=text)

    @traced("GetModelInfo")
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        info = self.router.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine is connected yet; retry later")
        return convert.model_info_response(
            info,
            has_chat_template=self.tokenizer is not None and self.tokenizer.has_chat_template,
            num_engines=self.router.num_connected,
        )

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "the tokenizer is not loaded yet; retry later")
        return self.tokenizer


# Requests larger than this (serialized) are tokenized on a worker thread, where long
# inputs release the GIL (see text/tokenizer.py): one huge prompt must not stall the event
# loop, and with it every other call, stream and health check, for seconds.
_OFF_LOOP_BYTES = 64 * 1024


async def _off_loop(request, fn, *args):
    if request.ByteSize() > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


def add_to_server(servicer: GenerateServiceServicer, server: grpc.aio.Server) -> None:
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
