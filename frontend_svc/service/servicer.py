"""The public API, tandem.generate.v1.GenerateService.

This is the only frontend module that knows the public protobuf types: requests are
checked and turned into plain values here (``Plan``), responses are built here from
``ChoiceOutput``. Errors follow the proto's contract: INVALID_ARGUMENT names the field,
UNAVAILABLE when no engine can serve (or the serving one went away), engine in-band
errors pass through with their own code.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace

import grpc

from frontend_svc.engine.router import EngineRouter
from frontend_svc.engine.types import EngineUnavailableError, ModelInfo
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.request_stats import GenerateStats
from frontend_svc.service.tracing import traced
from frontend_svc.text.output_processor import ChoiceOutput, ChoiceProcessor, LogprobText, TextParams, TokenTexts
from frontend_svc.text.tokenizer import Tokenizer
from tandem_common.sampling import DEFAULT_MAX_TOKENS, SamplingParams, check_sampling_params
from tandem_common.types import ErrorCode, FinishReason
from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

_U64 = 1 << 64

_GRPC_CODE = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
_FINISH = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
}


class Rejected(Exception):
    """Ends a call with ``code`` and a message that says what to fix."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Refused(Rejected):
    """An engine refused the request because it is draining (in-band UNAVAILABLE)."""


def _invalid(field: str, message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


@dataclass
class Plan:
    """A checked Generate request in plain values."""

    prompt_token_ids: list[int]
    n: int
    params: SamplingParams  # choice 0's; choice i gets seed + i and no prompt logprobs
    text: TextParams
    priority: int

    def engine_params(self, i: int) -> SamplingParams:
        if i == 0:
            return self.params
        seed = None if self.params.seed is None else (self.params.seed + i) % _U64
        return replace(self.params, seed=seed, prompt_logprobs=None)

    def text_params(self, i: int) -> TextParams:
        return self.text if i == 0 else replace(self.text, prompt_logprobs=False)


class GenerateServiceServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, router: EngineRouter, *, max_n: int = 16, max_stop_strings: int = 16,
                 stream_interval: int = 1, metrics: FrontendMetrics | None = None, tracer=None) -> None:
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
            sent, tried = False, []
            while True:
                client = self.router.pick(exclude=tried)
                try:
                    async for response in self._stream(plan, client, request, context, stats):
                        sent = True
                        yield response
                    break
                except Refused as e:
                    # A draining engine refused before anything was sent: try another one once.
                    if sent or tried:
                        raise
                    logger.info("engine %s refused %s (%s); trying another engine", client.address,
                                request.request_id or "-", e)
                    tried.append(client)
            code = grpc.StatusCode.OK
        except Rejected as e:
            code, message = e.code, str(e)
        except EngineUnavailableError as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        finally:
            stats.end(code, message)  # metrics, span, the request's log line
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            await context.abort(code, message)

    async def _stream(self, plan: Plan, client, request, context, stats: GenerateStats):
        wakeup = asyncio.Event()
        handles = []
        choices = [ChoiceProcessor(i, self.tokenizer, plan.prompt_token_ids, plan.text_params(i), self._texts)
                   for i in range(plan.n)]

        def abort_unfinished(_context=None) -> None:
            live = [h.request_id for h in handles if not h.finished and not h.aborted]
            if live:
                client.abort(live)

        context.add_done_callback(abort_unfinished)
        try:
            arrival = time.time()
            rids = [uuid.uuid4().hex for _ in range(plan.n)]
            trace_context = stats.routed(client.address, rids)
            for i, rid in enumerate(rids):
                handles.append(client.add(rid, plan.prompt_token_ids, plan.engine_params(i),
                                          priority=plan.priority, trace_context=trace_context,
                                          arrival_time=arrival, wakeup=wakeup,
                                          stream_interval=self.stream_interval))
            logger.debug("Generate %s -> engine %s as %s", request.request_id or "-", client.address,
                         ",".join(h.request_id for h in handles))
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
                        error = Refused if out.error.code is ErrorCode.UNAVAILABLE else Rejected
                        raise error(_GRPC_CODE[out.error.code], message)
                    piece = choices[i].process(out)
                    if piece is None:
                        continue
                    if piece.abort_engine:
                        handles[i].abort()
                    if piece.finished:
                        unfinished.discard(i)
                    stats.piece(piece)
                    yield _response(piece, plan.text.return_token_ids)
        finally:
            abort_unfinished()

    def _ready(self) -> tuple[Tokenizer, ModelInfo]:
        info = self.router.model_info
        if info is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "no engine is connected yet; retry later")
        if self.tokenizer is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the tokenizer is not loaded yet; retry later")
        return self.tokenizer, info

    def _plan(self, request: generate_pb2.GenerateRequest, tokenizer: Tokenizer, info: ModelInfo) -> Plan:
        which = request.WhichOneof("input")
        if which is None:
            raise _invalid("input", "set one of text, token_ids or messages")
        if which == "text":
            if not request.text:
                raise _invalid("text", "the prompt text is empty")
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            prompt = tokenizer.encode(request.text, add_special_tokens=add_special)
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
            if not prompt:
                raise _invalid("token_ids.ids", "the prompt has no token ids")
            _check_ids("token_ids.ids", prompt, info.vocab_size)
        else:
            prompt = _render(request.messages, tokenizer)
        if not prompt:
            raise _invalid(which, "the prompt is empty after tokenization")
        if len(prompt) >= info.max_model_len:
            raise _invalid(which, f"the prompt has {len(prompt)} tokens but the model's context is "
                           f"{info.max_model_len} tokens; shorten it to at most {info.max_model_len - 1}")

        sp = request.sampling_params
        room = info.max_model_len - len(prompt)
        if sp.HasField("max_tokens"):
            max_tokens = sp.max_tokens  # below 1: check_sampling_params says so
            if len(prompt) + max_tokens > info.max_model_len:
                raise _invalid("sampling_params.max_tokens", (
                    f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}, together "
                    f"{len(prompt) + max_tokens}, more than the model's context of {info.max_model_len} "
                    f"tokens; ask for at most {room}"))
        else:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        n = sp.n if sp.HasField("n") else 1
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=sp.min_tokens,
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=sp.top_k, min_p=sp.min_p, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            logit_bias=dict(sp.logit_bias),
        )
        self._check_params(params, n, list(sp.stop), info.vocab_size)
        text = TextParams(
            stop=list(sp.stop), include_stop_str_in_output=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
            min_tokens=sp.min_tokens, return_token_ids=request.return_token_ids,
            prompt_logprobs=params.prompt_logprobs is not None,
        )
        return Plan(prompt, n, params, text, request.priority)

    def _check_params(self, p: SamplingParams, n: int, stop: list[str], vocab_size: int) -> None:
        """n, then the limits both services share (tandem_common.sampling), then the stop strings."""
        if not 1 <= n <= self.max_n:
            raise _invalid("sampling_params.n", f"must be in [1, {self.max_n}], got {n}")
        error = check_sampling_params(p, vocab_size)
        if error is not None:
            raise _invalid(f"sampling_params.{error.name}", error.message)
        if len(stop) > self.max_stop_strings:
            raise _invalid("sampling_params.stop",
                           f"at most {self.max_stop_strings} stop strings are allowed, got {len(stop)}")
        for i, s in enumerate(stop):
            if not s:
                raise _invalid(f"sampling_params.stop[{i}]", "stop strings must not be empty")

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
                ids = await _off_loop(request, _render, request.messages, tokenizer)
            else:
                raise _invalid("input", "set text or messages")
        except Rejected as e:
            await context.abort(e.code, str(e))
        tokens = await _off_loop(request, lambda: [self._texts(t) for t in ids])
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    @traced("Detokenize")
    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            tokenizer = self._tokenizer()
            await _off_loop(request, _check_ids, "token_ids", request.token_ids, tokenizer.vocab_size)
        except Rejected as e:
            await context.abort(e.code, str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await _off_loop(request, tokenizer.decode, list(request.token_ids), skip)
        return generate_pb2.DetokenizeResponse(text=text)

    @traced("GetModelInfo")
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        info = self.router.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine is connected yet; retry later")
        response = generate_pb2.GetModelInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            has_chat_template=self.tokenizer is not None and self.tokenizer.has_chat_template,
            num_engines=self.router.num_connected,
        )
        if info.bos_token_id is not None:
            response.bos_token_id = info.bos_token_id
        return response

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the tokenizer is not loaded yet; retry later")
        return self.tokenizer


# Requests larger than this (serialized) are tokenized on a worker thread, where long
# inputs release the GIL (see text/tokenizer.py): one huge prompt must not stall the event
# loop, and with it every other call, stream and health check, for seconds.
_OFF_LOOP_BYTES = 64 * 1024


async def _off_loop(request, fn, *args):
    if request.ByteSize() > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _check_ids(field: str, ids, vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise _invalid(field, f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def _render(chat: generate_pb2.ChatMessages, tokenizer: Tokenizer) -> list[int]:
    if not tokenizer.has_chat_template:
        raise _invalid("messages", "the model has no chat template; send text or token_ids instead")
    if not chat.messages:
        raise _invalid("messages.messages", "the conversation has no messages")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise _invalid("messages", str(e)) from e
    # The template writes the special tokens (BOS) itself.
    return tokenizer.encode(text, add_special_tokens=False)


def _logprob(lp: LogprobText) -> generate_pb2.Logprob:
    return generate_pb2.Logprob(
        token_id=lp.token_id, token=lp.token, logprob=lp.logprob, rank=lp.rank,
        top=[generate_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in lp.top],
    )


def _response(piece: ChoiceOutput, return_token_ids: bool) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(index=piece.index, text=piece.text)
    # Sent once per token per stream: fields that are empty are not touched at all.
    if return_token_ids and piece.token_ids:
        response.token_ids.extend(piece.token_ids)
    if piece.logprobs:
        response.logprobs.extend(_logprob(lp) for lp in piece.logprobs)
    if piece.prompt_logprobs:
        response.prompt_logprobs.extend(_logprob(lp) for lp in piece.prompt_logprobs)
    if piece.finish_reason is not None:
        response.finish_reason = _FINISH[piece.finish_reason]
        if piece.stop_str is not None:
            response.stop_str = piece.stop_str
        elif piece.stop_token_id is not None:
            response.stop_token_id = piece.stop_token_id
        u = piece.usage
        response.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens))
    return response


SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


def add_to_server(servicer: GenerateServiceServicer, server: grpc.aio.Server) -> None:
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
