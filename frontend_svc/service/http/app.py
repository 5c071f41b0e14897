"""The HTTP face's routes (Starlette): OpenAI-compatible and Anthropic Messages, beside gRPC.

    GET  /health                    200 while the frontend serves, else 503 (never needs a key)
    GET  /v1/models                 the engines' model
    POST /v1/completions            OpenAI completions, streaming (SSE) or not
    POST /v1/chat/completions       OpenAI chat completions, streaming (SSE) or not
    POST /v1/messages               Anthropic Messages, streaming (SSE events) or not
    POST /v1/messages/count_tokens  Anthropic: the prompt's token count
    POST /tokenize, /detokenize     vLLM's shapes
    POST /v1/load_lora_adapter,     vLLM's LoRA admin, with --http-lora-admin only (lora_admin.py)
         /v1/unload_lora_adapter

Each route is one line below (endpoint.py: the body read, the errors in the route's
dialect); a generation route is a converter (openai_requests, anthropic_api) to the plain
values that planning checks, and an answer builder (openai_answers, anthropic_api) fed
the same ChoiceOutputs the gRPC servicer streams, run by the call lifecycle both faces
share (service/generate_call.py). Errors are OpenAI's nested JSON, or Anthropic's on
/v1/messages (dialect.py); nothing a client sends reaches a 500 (an unexpected exception
is logged and answered as one, without a traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend_svc.service.generation import Generation
from frontend_svc.service.http import anthropic_api, openai_requests
from frontend_svc.service.http.dialect import ANTHROPIC, OPENAI
from frontend_svc.service.http.endpoint import Endpoints
from frontend_svc.service.http.errors import HttpError, bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.service.http.lora_admin import LOAD_PATH, UNLOAD_PATH, LoraAdmin
from frontend_svc.service.http.openai_answers import OpenAIAnswer
from frontend_svc.service.http.openai_requests import OpenAIRequest
from frontend_svc.service.planning import MAX_DETOKENIZE_IDS, Chat, Plan, check_ids, encode_prompt
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.types import ModelInfo

logger = logging.getLogger(__name__)


class HttpFace:
    def __init__(
        self, generation: Generation, *, serving: Callable[[], bool], max_body_bytes: int, lora_admin: bool = False
    ) -> None:
        self.generation = generation
        self.serving = serving
        e = self.endpoints = Endpoints(generation, max_body_bytes)
        admin = LoraAdmin(generation.router)
        admin_routes = [e.route(LOAD_PATH, OPENAI, admin.load), e.route(UNLOAD_PATH, OPENAI, admin.unload)]
        self.app = Starlette(
            routes=[
                *(admin_routes if lora_admin else []),
                Route("/health", self.health, methods=["GET"]),
                e.route("/v1/models", OPENAI, self.models, method="GET"),
                e.generate("/v1/completions", OPENAI, openai_requests.completion_request, self.openai_answer),
                e.generate("/v1/chat/completions", OPENAI, openai_requests.chat_request, self.openai_answer),
                e.generate("/v1/messages", ANTHROPIC, anthropic_api.messages_request, anthropic_api.answer),
                e.route("/v1/messages/count_tokens", ANTHROPIC, self.count_tokens),
                e.route("/tokenize", OPENAI, self.tokenize),
                e.route("/detokenize", OPENAI, self.detokenize),
            ],
            exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal},
        )

    # -- plain routes -------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.serving() else 503)

    async def models(self, request: Request) -> Response:
        info = self.generation.router.model_info
        if info is None:
            raise HttpError(503, "no engine is connected yet; retry later", retryable=True)
        model = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "tandem"}
        model["max_model_len"] = info.max_model_len
        adapters = [
            {"id": name, "object": "model", "created": 0, "owned_by": "tandem", "parent": info.model_name}
            | {"max_model_len": info.max_model_len}
            for name in self.generation.router.lora_adapters
        ]
        return JSONResponse({"object": "list", "data": [model, *adapters]})

    # -- answers ------------------------------------------------------------------------------

    def openai_answer(self, req: OpenAIRequest, model: str, plan: Plan) -> OpenAIAnswer:
        """Completions (a prompt) or chat (messages)."""
        gen = req.input
        echo = ""
        if req.echo:  # the prompt as text: as sent, or its token ids decoded
            echo = gen.text if gen.input == "text" else self._decode(gen.token_ids)
        return OpenAIAnswer(
            chat=gen.input == "messages",
            model=model,
            n=plan.n,
            num_prompt_tokens=len(plan.prompt_token_ids),
            logprobs=req.logprobs,
            echo=echo,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            keep=req.best_of_keep,
        )

    # -- token counts -------------------------------------------------------------------------

    async def count_tokens(self, request: Request, body: Any) -> Response:
        req = anthropic_api.messages_request(body, count_only=True)
        tokenizer, info = await self._ready(req.model)
        assert req.input.chat is not None
        ids = await self._chat_token_ids(req.input.chat, tokenizer, info)
        return JSONResponse({"input_tokens": len(ids)})

    async def tokenize(self, request: Request, body: Any) -> Response:
        f = Fields(body)
        tokenizer, info = await self._ready(f.str("model"))
        if f.has("messages"):
            rendered = body | {"stream": False, "stream_options": None}
            chat = openai_requests.chat_request(rendered, check_fields=False).input.chat
            assert chat is not None
            ids = await self._chat_token_ids(chat, tokenizer, info)
        else:
            prompt = f.str("prompt")
            if prompt is None:
                raise bad_request("prompt", "is required: the text to tokenize (or send messages)")
            add = f.bool("add_special_tokens", True)
            ids = await self.generation.off_loop(
                len(prompt), encode_prompt, "prompt", prompt, tokenizer, info.max_model_len, add
            )
        return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request, body: Any) -> Response:
        f = Fields(body)
        tokenizer, _ = await self._ready(f.str("model"))
        ids = f.ints("tokens")
        if len(ids) > MAX_DETOKENIZE_IDS:
            raise bad_request("tokens", f"at most {MAX_DETOKENIZE_IDS} ids are allowed, got {len(ids)}")
        check_ids("tokens", ids, tokenizer.vocab_size)
        text = await self.generation.off_loop(len(ids), tokenizer.decode, ids)
        return JSONResponse({"prompt": text})

    # -- shared -------------------------------------------------------------------------------

    async def _ready(self, model: str | None) -> tuple[Tokenizer, ModelInfo]:
        """The tokenizer and model info, for a request that names a served model (as a
        Generate call checks them, in the same order)."""
        ready = self.generation.ready()
        await self.generation.lora_name(model)
        return ready

    async def _chat_token_ids(self, chat: Chat, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
        size = sum(len(m["content"]) for m in chat.messages)
        return await self.generation.chat_token_ids(chat, tokenizer, info.max_model_len, size)

    def _decode(self, token_ids: list[int]) -> str:
        return self.generation.loaded_tokenizer().decode(token_ids, skip_special_tokens=False)


async def _not_found(request: Request, exc) -> Response:
    return OPENAI.response(HttpError(404, f"no such path: {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc) -> Response:
    return OPENAI.response(
        HttpError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    )


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return OPENAI.response(HttpError(500, "internal error; the frontend's log has the details", type="internal_error"))
