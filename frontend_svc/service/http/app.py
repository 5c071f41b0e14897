"""The HTTP face's routes (Starlette): OpenAI-compatible and Anthropic Messages, beside gRPC.

    GET  /health                    200 while the frontend serves, else 503 (never needs a key)
    GET  /v1/models                 the engines' model
    POST /v1/completions            OpenAI completions, streaming (SSE) or not
    POST /v1/chat/completions       OpenAI chat completions, streaming (SSE) or not
    POST /v1/messages               Anthropic Messages, streaming (SSE events) or not
    POST /v1/messages/count_tokens  Anthropic: the prompt's token count
    POST /tokenize, /detokenize     vLLM's shapes

Every request body is read up to ``max_body_bytes`` (413 past it) and parsed here; the
faces' converters (openai_requests, anthropic_api) make the plain values that planning
checks, and the answer is built from the same ChoiceOutputs the gRPC servicer streams.
Errors are OpenAI's nested JSON, or Anthropic's on /v1/messages; nothing a client sends
reaches a 500 (an unexpected exception is logged and answered as one, without a traceback).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend_svc.service.generation import Generation
from frontend_svc.service.http import anthropic_api, openai_requests, sse
from frontend_svc.service.http.errors import HttpError, bad_request, from_call_error
from frontend_svc.service.http.fields import Fields, unencodable_field
from frontend_svc.service.http.openai_responses import OpenAIAnswer
from frontend_svc.service.http.pacing import Pacer, paced
from frontend_svc.service.http.run import HttpRun, RunStream, as_call_error, collect, until_disconnect
from frontend_svc.service.planning import MAX_DETOKENIZE_IDS, GenerateInput, check_ids, encode_prompt
from frontend_svc.types import CallError, EngineUnavailableError

logger = logging.getLogger(__name__)


class HttpFace:
    def __init__(self, generation: Generation, *, serving: Callable[[], bool], max_body_bytes: int) -> None:
        self.generation = generation
        self.serving = serving
        self.max_body_bytes = max_body_bytes
        self.pacer = Pacer()  # streamed calls coalesce while the frontend is busy (pacing.py)
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
            ],
            exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal},
        )

    # -- plain routes -------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.serving() else 503)

    async def models(self, request: Request) -> Response:
        info = self.generation.router.model_info
        if info is None:
            return _error(HttpError(503, "no engine is connected yet; retry later", retryable=True))
        model = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "tandem"}
        model["max_model_len"] = info.max_model_len
        adapters = [
            {"id": name, "object": "model", "created": 0, "owned_by": "tandem", "parent": info.model_name}
            | {"max_model_len": info.max_model_len}
            for name in self.generation.router.lora_adapters
        ]
        return JSONResponse({"object": "list", "data": [model, *adapters]})

    # -- OpenAI -------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, chat=True)

    async def _openai(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self._body(request)
            req = openai_requests.chat_request(body) if chat else openai_requests.completion_request(body)
            model = await self._model(req.model, req.input)
            run = HttpRun(self.generation, request)
            try:
                plan = await run.plan(req.input, "chat" if chat else "text_completion")
            except CallError as e:
                raise from_call_error(e, openai_requests.param_name) from None
        except HttpError as e:
            return _error(e)
        echo = ""
        if req.echo:  # the prompt as text: as sent, or its token ids decoded
            echo = req.input.text if req.input.input == "text" else self._decode(req.input.token_ids)
        answer = OpenAIAnswer(
            chat=chat,
            model=model,
            n=plan.n,
            num_prompt_tokens=len(plan.prompt_token_ids),
            logprobs=req.logprobs,
            echo=echo,
        )
        if not req.stream:
            error = await until_disconnect(request, run, collect(run, run.pieces(plan), answer.add))
            if error is not None:
                return _error(from_call_error(error, openai_requests.param_name))
            return Response(sse.dumps(answer.response()), media_type="application/json")
        usage = True if req.continuous_usage else False if req.include_usage else None

        async def stream():
            try:
                pieces = run.pieces(plan)
                async with contextlib.aclosing(pieces):
                    async for piece in sse.with_pings(paced(pieces, self.pacer)):
                        yield sse.PING if piece is None else sse.data(answer.chunk(piece, usage=usage))
                if req.include_usage:
                    yield sse.data(answer.usage_chunk())
                run.ok()
            except (CallError, EngineUnavailableError) as e:
                run.failed(e)
                yield sse.data(from_call_error(as_call_error(e), openai_requests.param_name).openai_body())
            finally:
                run.end()
            yield sse.DONE

        return RunStream(stream(), run, sse.HEADERS)

    # -- Anthropic ----------------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = anthropic_api.messages_request(body)
            model = await self._model(req.model, req.input)
            run = HttpRun(self.generation, request)
            try:
                plan = await run.plan(req.input, "chat")
            except CallError as e:
                raise from_call_error(e, anthropic_api.param_name) from None
        except HttpError as e:
            return _error(e, anthropic=True)
        answer = anthropic_api.AnthropicAnswer(model, len(plan.prompt_token_ids), split=plan.text.message.active)
        if not req.stream:
            error = await until_disconnect(request, run, collect(run, run.pieces(plan), answer.add))
            if error is not None:
                return _error(from_call_error(error, anthropic_api.param_name), anthropic=True)
            return Response(sse.dumps(answer.response()), media_type="application/json")

        async def stream():
            try:
                for name, event in answer.start_events():
                    yield sse.event(name, event)
                pieces = run.pieces(plan)
                async with contextlib.aclosing(pieces):
                    async for piece in sse.with_pings(paced(pieces, self.pacer)):
                        if piece is None:
                            yield sse.event("ping", {"type": "ping"})
                            continue
                        for name, event in answer.events(piece):
                            yield sse.event(name, event)
                run.ok()
            except (CallError, EngineUnavailableError) as e:
                run.failed(e)
                error = from_call_error(as_call_error(e), anthropic_api.param_name)
                yield sse.event("error", error.anthropic_body())
            finally:
                run.end()

        return RunStream(stream(), run, sse.HEADERS)

    async def count_tokens(self, request: Request) -> Response:
        try:
            req = anthropic_api.messages_request(await self._body(request), count_only=True)
            await self._model(req.model)
            tokenizer, info = self._ready(anthropic_api.param_name)
            assert req.input.chat is not None
            chat = req.input.chat
            size = sum(len(m["content"]) for m in chat.messages)
            ids = await self.generation.chat_token_ids(chat, tokenizer, info.max_model_len, size)
        except CallError as e:
            return _error(from_call_error(e, anthropic_api.param_name), anthropic=True)
        except HttpError as e:
            return _error(e, anthropic=True)
        return JSONResponse({"input_tokens": len(ids)})

    # -- tokenize / detokenize ----------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            f = Fields(body)
            await self._model(f.str("model"))
            tokenizer, info = self._ready(openai_requests.param_name)
            if f.has("messages"):
                chat = openai_requests.chat_request({**body, "stream": False, "stream_options": None}).input.chat
                assert chat is not None
                size = sum(len(m["content"]) for m in chat.messages)
                ids = await self.generation.chat_token_ids(chat, tokenizer, info.max_model_len, size)
            else:
                prompt = f.str("prompt")
                if prompt is None:
                    raise bad_request("prompt", "is required: the text to tokenize (or send messages)")
                add = f.bool("add_special_tokens", True)
                ids = await self.generation.off_loop(
                    len(prompt), encode_prompt, "prompt", prompt, tokenizer, info.max_model_len, add
                )
        except CallError as e:
            return _error(from_call_error(e, openai_requests.param_name))
        except HttpError as e:
            return _error(e)
        return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        try:
            f = Fields(await self._body(request))
            await self._model(f.str("model"))
            tokenizer, info = self._ready(openai_requests.param_name)
            ids = f.ints("tokens")
            if len(ids) > MAX_DETOKENIZE_IDS:
                raise bad_request("tokens", f"at most {MAX_DETOKENIZE_IDS} ids are allowed, got {len(ids)}")
            check_ids("tokens", ids, tokenizer.vocab_size)
            text = await self.generation.off_loop(len(ids), tokenizer.decode, ids)
        except CallError as e:
            return _error(from_call_error(e, openai_requests.param_name))
        except HttpError as e:
            return _error(e)
        return JSONResponse({"prompt": text})

    # -- shared -------------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        return self.generation.loaded_tokenizer().decode(token_ids, skip_special_tokens=False)

    def _ready(self, rename):
        try:
            return self.generation.ready()
        except CallError as e:
            raise from_call_error(e, rename) from None

    async def _model(self, model: str | None, gen: GenerateInput | None = None) -> str:
        """The model the request names: the served model, or one of the engines' LoRA
        adapters (set as ``gen``'s); any other name gets 404, as from OpenAI."""
        info = self.generation.router.model_info
        if info is None:
            raise HttpError(503, "no engine is connected yet; retry later", retryable=True)
        try:
            lora_name = await self.generation.lora_name(model)
        except CallError:
            served = ", ".join(repr(n) for n in [info.model_name, *self.generation.router.lora_adapters])
            raise HttpError(
                404,
                f"the model {model!r} does not exist; this server serves {served} (GET /v1/models)",
                param="model",
                code="model_not_found",
            ) from None
        if gen is not None:
            gen.lora_name = lora_name
        return lora_name or info.model_name

    async def _body(self, request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise _too_large(self.max_body_bytes)
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


async def _not_found(request: Request, exc) -> Response:
    return _error(HttpError(404, f"no such path: {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc) -> Response:
    return _error(HttpError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"))


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(HttpError(500, "internal error; the frontend's log has the details", type="internal_error"))


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the request body is larger than this server's limit of {limit} bytes")


def _error(error: HttpError, *, anthropic: bool = False) -> Response:
    body = error.anthropic_body() if anthropic else error.openai_body()
    return Response(sse.dumps(body), status_code=error.status, headers=error.headers(), media_type="application/json")
