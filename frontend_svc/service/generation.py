"""A planned Generate request run on the engines, in plain values: the part both public faces share.

    Plan ── Generation.stream(plan, stats) ──▶ router.route(), add() ──▶ engine
    engine ──▶ RequestHandle.take() ──▶ EngineOutput ── ChoiceProcessor (one per choice) ──▶ ChoiceOutput

Each call runs through its lifecycle (service/generate_call.py: admission, sizes, the
model name, planning with service/planning.py, then this stream), the same for the gRPC
servicer and the HTTP face, which turn the ChoiceOutputs into their own wire format;
nothing here knows either wire.

An engine that refuses (draining) or fails (dies, hangs) before anything was yielded gets
the request retried once on another engine: the client cannot tell. Closing the stream
(the client went away, a stop string ended the last choice) aborts every engine request
still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable

from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.handle import RequestHandle
from frontend_svc.engine.router import EngineRouter, PromptBlocks, Route
from frontend_svc.service.flow import InFlightCalls
from frontend_svc.service.message_plan import OutputParsers
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.planning import (
    Chat,
    ChatPrompt,
    GenerateInput,
    Plan,
    RequestLimits,
    encode_prompt,
    invalid,
    plan_generate,
    prepare_generate,
)
from frontend_svc.service.request_stats import GenerateStats
from frontend_svc.text.chat_template.renderer import ChatRenderer, NoChatTemplate, RenderError, RenderUnavailable
from frontend_svc.text.output_processor import ChoiceOutput, ChoiceProcessor, TokenTexts
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools.spec import ToolRequest
from frontend_svc.types import CallError, EngineRequestTooLargeError, EngineUnavailableError, ModelInfo, RequestError
from tandem_common.types import ErrorCode

logger = logging.getLogger(__name__)

# Inputs larger than this (serialized bytes, or characters of JSON) are tokenized on a
# worker thread, where inputs this long release the GIL (text/tokenizer.py, _LONG_INPUT):
# one long prompt must not stall the event loop, and with it every other call, stream and
# health check. Below it tokenizing takes well under a millisecond.
OFF_LOOP_BYTES = 4096


class EngineRefused(CallError):
    """An engine refused the request because it is draining (in-band UNAVAILABLE)."""


class Generation:
    """The frontend's shared state for running requests: router, limits, calls in flight,
    metrics, tracer, the output parsers (--tool-call-parser, --reasoning-parser), and the
    tokenizer with its chat template's renderer (set once they are loaded)."""

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
        self.texts: TokenTexts | None = None
        self.renderer: ChatRenderer = NoChatTemplate()  # every chat is rendered here (text/chat_template/)
        # Long tokenizations run on worker threads, at most one per core at once: more would
        # not finish sooner, and each holds ~100 bytes of memory per character of text.
        self._heavy = asyncio.Semaphore(os.cpu_count() or 1)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return None if self.texts is None else self.texts.tokenizer

    def set_tokenizer(self, tokenizer: Tokenizer, renderer: ChatRenderer | None = None) -> None:
        self.renderer = renderer or NoChatTemplate()
        self.texts = TokenTexts(tokenizer)

    def ready(self) -> tuple[Tokenizer, ModelInfo]:
        info = self.router.model_info
        if info is None:
            raise CallError(ErrorCode.UNAVAILABLE, "no engine is connected yet; retry later")
        return self.loaded_tokenizer(), info

    async def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a client's model name asks for: None for no name or the served
        model's; CallError NOT_FOUND for a name no engine serves."""
        info = self.router.model_info
        if not model or (info is not None and model == info.model_name):
            return None
        await self.router.check_lora(model)
        return model

    def token_texts(self) -> TokenTexts:
        if self.texts is None:
            if self.tokenizer_problem is not None:
                raise CallError(ErrorCode.FAILED_PRECONDITION, self.tokenizer_problem)
            raise CallError(ErrorCode.UNAVAILABLE, "the tokenizer is not loaded yet; retry later")
        return self.texts

    def loaded_tokenizer(self) -> Tokenizer:
        return self.token_texts().tokenizer

    async def off_loop(self, size: int, fn, *args):
        """``fn(*args)`` on a worker thread when the input is large (``size`` > OFF_LOOP_BYTES)."""
        if size <= OFF_LOOP_BYTES:
            return fn(*args)
        async with self._heavy:
            return await asyncio.to_thread(fn, *args)

    async def plan(self, request: GenerateInput, tokenizer: Tokenizer, info: ModelInfo, size: int) -> Plan:
        """The checked plan of a request whose sizes are checked (``size``: its bytes or
        characters, for off_loop); CallError for the first problem."""
        prepared = await self.off_loop(size, prepare_generate, request, tokenizer, self.parsers)
        text = "" if prepared.prompt is None else await self.render(prepared.prompt, size)
        return await self.off_loop(
            size, plan_generate, request, tokenizer, info, self.limits, self.parsers, prepared, text
        )

    async def chat_token_ids(
        self,
        chat: Chat,
        tokenizer: Tokenizer,
        max_model_len: int | None,
        size: int,
        tools: ToolRequest | None = None,
    ) -> list[int]:
        """Token ids of ``chat`` rendered with the model's chat template (Tokenize, count_tokens):
        the prompt a Generate call with these messages and ``tools`` renders, tools and
        earlier calls as the template (or the generic tools prompt) shows them."""
        request = GenerateInput(input="messages", chat=chat, tools=tools or ToolRequest())
        prepared = await self.off_loop(size, prepare_generate, request, tokenizer, self.parsers)
        assert prepared.prompt is not None  # a chat always renders one
        text = await self.render(prepared.prompt, size)
        # The template writes the special tokens (BOS) itself.
        return await self.off_loop(size, encode_prompt, "messages", text, tokenizer, max_model_len, False)

    async def render(self, prompt: ChatPrompt, size: int) -> str:
        """The chat template's text, rendered off the loop within its budget; a failure is
        the request's own: INVALID_ARGUMENT on "messages" (UNAVAILABLE when no render process runs)."""
        try:
            return await self.renderer.render(prompt.messages, prompt.add_generation_prompt, prompt.variables, size)
        except RenderError as e:
            raise invalid("messages", str(e)) from None
        except RenderUnavailable as e:
            raise CallError(ErrorCode.UNAVAILABLE, str(e)) from None

    async def stream(
        self, plan: Plan, stats: GenerateStats, on_done: Callable[[Callable[..., None]], None] | None = None
    ) -> AsyncGenerator[ChoiceOutput, None]:
        """The plan's pieces from one engine, or from a second one when the first refuses or
        fails before anything was yielded. ``on_done`` registers a callback to run when the
        caller's call ends (gRPC: ``context.add_done_callback``); it aborts what still runs."""
        # Choices 1..n-1 ask for prompt logprobs only when each choice does: else some choice can hit.
        prompt = PromptBlocks(
            plan.prompt_token_ids, prompt_logprobs=plan.every_choice_misses, cache_salt=plan.cache_salt
        )
        sent = False
        tried: list[EngineClient] = []
        failure: Exception | None = None
        while True:
            try:
                route = await self.router.route(prompt, exclude=tried, lora_name=plan.lora_name)
                client = route.client
            except EngineUnavailableError:
                if failure is not None:  # the retry found no engine: the first failure says more
                    raise failure from None
                raise
            try:
                async with contextlib.aclosing(self._stream(plan, route, stats, on_done)) as pieces:
                    async for piece in pieces:
                        sent = True
                        yield piece
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

    async def _stream(
        self, plan: Plan, route: Route, stats: GenerateStats, on_done
    ) -> AsyncGenerator[ChoiceOutput, None]:
        client = route.client
        wakeup = asyncio.Event()
        handles: list[RequestHandle] = []
        texts = self.token_texts()
        choices = [
            ChoiceProcessor(i, texts.tokenizer, plan.prompt_token_ids, plan.text_params(i), texts)
            for i in range(plan.n)
        ]

        def abort_unfinished(_context=None) -> None:
            live = [h.request_id for h in handles if not h.finished and not h.aborted]
            if live:
                client.abort(live)

        if on_done is not None:
            on_done(abort_unfinished)
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
                        lora_name=plan.lora_name,
                        cache_salt=plan.cache_salt,
                        max_pending_bytes=self.calls.pending_share(plan.n),
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
                    if handles[i].paused:  # held for its unread output, which is taken now
                        client.resume(handles[i])
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
                        yield piece
        except EngineRequestTooLargeError as e:
            raise CallError(ErrorCode.RESOURCE_EXHAUSTED, str(e)) from None
        finally:
            abort_unfinished()
            stats.generated(sum(c.num_output_tokens for c in choices))


def _engine_error(error: RequestError) -> CallError:
    """An engine's in-band error as the call's error (EngineRefused: it is draining)."""
    message = error.message
    if error.field and error.field not in message:
        message = f"{error.field}: {message}"
    return (EngineRefused if error.code is ErrorCode.UNAVAILABLE else CallError)(error.code, message)
