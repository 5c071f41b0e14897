"""The public API, tandem.generate.v1.GenerateService: each call planned, routed, streamed.

    GenerateRequest ── _call_input() ──▶ CallInput ── GenerateCall.plan() ──▶ Plan
                       (service/generate_call.py: admission, sizes, model name, planning)
    Plan ── GenerateCall.pieces() ──▶ ChoiceOutput ... (service/generation.py: routing, engines, text)
         ── convert ──▶ GenerateResponse ── GenerateCall.write() ──▶ client
    the call's Outcome ──▶ its gRPC status (OK, or context.abort with the code of that name)

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
import time
from functools import partial

import grpc

from frontend_svc.engine.router import EngineRouter
from frontend_svc.service import convert
from frontend_svc.service.caller import Caller, Outcome
from frontend_svc.service.flow import InFlightCalls, call_over
from frontend_svc.service.generate_call import CallInput, GenerateCall
from frontend_svc.service.generation import Generation
from frontend_svc.service.message_plan import OutputParsers
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.planning import (
    MAX_DETOKENIZE_IDS,
    RequestLimits,
    check_ids,
    check_num_messages,
    encode_prompt,
    invalid,
)
from frontend_svc.service.tracing import traced
from frontend_svc.text.chat_template.renderer import ChatRenderer
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.types import CallError, EngineUnavailableError
from tandem_common.types import ErrorCode
from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)


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
        # The face-neutral part; the HTTP face (service/http/) runs its requests on the same one.
        self.generation = Generation(
            router,
            limits=limits,
            calls=calls,
            stream_interval=stream_interval,
            metrics=metrics,
            tracer=tracer,
            parsers=parsers,
        )
        self.router = router
        self.limits = self.generation.limits
        self.calls = self.generation.calls
        self.metrics = self.generation.metrics
        self.tracer = tracer  # None: tracing is off and no span is ever made (read by @traced)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.generation.tokenizer

    @property
    def tokenizer_problem(self) -> str | None:
        return self.generation.tokenizer_problem

    @tokenizer_problem.setter
    def tokenizer_problem(self, problem: str | None) -> None:
        self.generation.tokenizer_problem = problem

    def set_tokenizer(self, tokenizer: Tokenizer, renderer: ChatRenderer | None = None) -> None:
        self.generation.set_tokenizer(tokenizer, renderer)

    # -- Generate ---------------------------------------------------------------------------

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        call = GenerateCall(self.generation, _caller(context), request.request_id)
        try:
            plan = await call.plan(_call_input(request))
            pieces = call.pieces(plan, context.add_done_callback)
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    await call.write(context, convert.generate_response(piece, plan.text.return_token_ids))
        except (CallError, EngineUnavailableError):
            pass  # the call ended with its outcome
        except asyncio.CancelledError:
            if not call.stalled:  # the client ended the call: nothing is left to tell it
                raise
        if call.outcome is not Outcome.OK:
            try:
                await context.abort(grpc.StatusCode[call.outcome.name], call.message)
            except grpc.aio.InternalError as e:
                raise call_over(e) from e

    # -- unary RPCs ---------------------------------------------------------------------------

    @traced("Tokenize")
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            texts = self.generation.token_texts()
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
                chat = await self._off_loop(request, convert.chat, request.messages)
                ids = await self.generation.chat_token_ids(chat, tokenizer, max_model_len, request.ByteSize())
            else:
                raise invalid("input", "set text or messages")
        except CallError as e:
            await context.abort(_status(e.code), str(e))
        tokens = await self._off_loop(request, lambda: [texts(t) for t in ids])
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    @traced("Detokenize")
    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            tokenizer = self.generation.loaded_tokenizer()
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
                lora_adapters=self.router.lora_adapters,
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine is connected yet; retry later")

    async def _off_loop(self, request, fn, *args):
        """``fn(*args)`` on a worker thread when the request is large (generation.OFF_LOOP_BYTES)."""
        return await self.generation.off_loop(request.ByteSize(), fn, *args)


def _caller(context: grpc.aio.ServicerContext) -> Caller:
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    return Caller(tuple(context.invocation_metadata() or ()), context.peer(), deadline)


def _call_input(request: generate_pb2.GenerateRequest) -> CallInput:
    return CallInput(
        request.model, convert.request_sizes(request), request.ByteSize(), partial(convert.generate_input, request)
    )


SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


def add_to_server(servicer: GenerateServiceServicer, server: grpc.aio.Server) -> None:
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
