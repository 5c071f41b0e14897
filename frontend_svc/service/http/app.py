"""The HTTP face's routes (Starlette): OpenAI-compatible and Anthropic Messages, beside gRPC.

    GET  /health                    200 while the frontend serves, else 503 (never needs a key)
    GET  /v1/models                 the engines' model
    POST /v1/completions            OpenAI completions, streaming (SSE) or not
    POST /v1/chat/completions       OpenAI chat completions, streaming (SSE) or not
    POST /v1/messages               Anthropic Messages, streaming (SSE events) or not
    POST /v1/messages/count_tokens  Anthropic: the prompt's token count
    POST /v1/responses              OpenAI Responses, streaming (SSE events) or not
    GET, DELETE /v1/responses/{id}  a stored response; POST .../cancel: 400 (no background responses)
    POST /tokenize, /detokenize     vLLM's shapes
    POST /v1/load_lora_adapter,     vLLM's LoRA admin, with --http-lora-admin only (lora_admin.py)
         /v1/unload_lora_adapter

Each route is one line below (endpoint.py: the body read, the errors in the route's
dialect); a generation route is a converter (openai_requests, anthropic_api,
responses_requests) to the plain values that planning checks, and an answer builder
(openai_answers, anthropic_api, responses_answers) fed
the same ChoiceOutputs the gRPC servicer streams, run by the call lifecycle both faces
share (service/generate_call.py). Errors are OpenAI's nested JSON, or Anthropic's on
/v1/messages (dialect.py); stored responses live in the process (responses_store.py).
Nothing a client sends reaches a 500 (an unexpected exception
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
from frontend_svc.service.http.dialect import ANTHROPIC, OPENAI, RESPONSES
from frontend_svc.service.http.echo import Echo, echo_prompt
from frontend_svc.service.http.endpoint import Endpoints
from frontend_svc.service.http.errors import HttpError, bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.service.http.lora_admin import LOAD_PATH, UNLOAD_PATH, LoraAdmin
from frontend_svc.service.http.openai_answers import OpenAIAnswer
from frontend_svc.service.http.openai_requests import OpenAIRequest
from frontend_svc.service.http.prompts import Plans
from frontend_svc.service.http.responses_answers import ResponsesAnswer
from frontend_svc.service.http.responses_requests import ResponsesRequest, responses_request
from frontend_svc.service.http.responses_store import ResponseStore, StoredResponse
from frontend_svc.service.planning import MAX_DETOKENIZE_IDS, Chat, GenerateInput, Plan, check_ids, encode_prompt
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools.spec import ToolRequest
from frontend_svc.types import ModelInfo

logger = logging.getLogger(__name__)


class HttpFace:
    def __init__(
        self,
        generation: Generation,
        *,
        serving: Callable[[], bool],
        max_body_bytes: int,
        responses: ResponseStore,
        lora_admin: bool = False,
    ) -> None:
        self.generation = generation
        self.serving = serving
        self.responses = responses  # stored responses (--responses-store-max-bytes, --responses-store-max-age-s)
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
                e.generate("/v1/responses", RESPONSES, self.responses_request, self.responses_answer),
                e.route("/v1/responses/{response_id}", RESPONSES, self.get_response, method="GET"),
                e.route("/v1/responses/{response_id}", RESPONSES, self.delete_response, method="DELETE"),
                e.route("/v1/responses/{response_id}/cancel", RESPONSES, self.cancel_response, body=False),
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

    def openai_answer(self, req: OpenAIRequest, model: str, plan: Plan | Plans) -> OpenAIAnswer:
        """Completions (one prompt or several: ``Plans``) or chat (messages)."""
        plans = plan.plans if isinstance(plan, Plans) else [plan]
        echoes = [self._echo(req, gen, p) for gen, p in zip(req.prompts or [req.input], plans, strict=True)]
        return OpenAIAnswer(
            chat=req.input.input == "messages",
            model=model,
            n=plans[0].n,
            num_prompt_tokens=[len(p.prompt_token_ids) for p in plans],
            logprobs=req.logprobs,
            echoes=echoes,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            num_logprobs=req.num_logprobs,
            echo_only=req.echo_only,
            num_prompt_logprobs=req.num_prompt_logprobs,
            keep=req.best_of_keep,
        )

    def _echo(self, req: OpenAIRequest, gen: GenerateInput, plan: Plan) -> Echo:
        """Completions ``echo``: the prompt as text (as sent, or its token ids decoded), and
        with ``logprobs`` its tokens' places in that text."""
        if not req.echo:
            return Echo()
        text = gen.text if gen.input == "text" else self._decode(gen.token_ids)
        if not req.logprobs:
            return Echo(text)
        tokenizer = self.generation.loaded_tokenizer()
        return Echo(text, echo_prompt(text, plan.prompt_token_ids, tokenizer, gen.input == "text"))

    def responses_request(self, body: Any) -> ResponsesRequest:
        return responses_request(body, self.responses)

    def responses_answer(self, req: ResponsesRequest, model: str, plan: Plan) -> ResponsesAnswer:
        return ResponsesAnswer(req, model, len(plan.prompt_token_ids), self.responses)

    # -- stored responses ---------------------------------------------------------------------

    async def get_response(self, request: Request) -> Response:
        """The stored response; its query parameters (a background response's stream, extra
        output) are not served, so any but ``stream=false`` is refused."""
        for key, value in request.query_params.multi_items():
            if not (key == "stream" and value == "false"):
                raise bad_request(key, "is not served: a stored response is read whole, as it was answered")
        return JSONResponse(self._stored(request).response)

    async def delete_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.responses.delete(response_id):
            raise _response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel_response(self, request: Request) -> Response:
        """Only a background response can be cancelled, and none is served: every stored one
        was answered in the foreground, and OpenAI refuses to cancel those."""
        self._stored(request)
        raise HttpError(400, "Only responses created with background=true can be cancelled.", param="response_id")

    def _stored(self, request: Request) -> StoredResponse:
        response_id = request.path_params["response_id"]
        stored = self.responses.get(response_id)
        if stored is None:
            raise _response_not_found(response_id)
        return stored

    # -- token counts -------------------------------------------------------------------------

    async def count_tokens(self, request: Request, body: Any) -> Response:
        req = anthropic_api.messages_request(body, count_only=True)
        tokenizer, info = await self._ready(req.model)
        assert req.input.chat is not None
        ids = await self._chat_token_ids(req.input.chat, tokenizer, info, req.input.tools)
        return JSONResponse({"input_tokens": len(ids)})

    async def tokenize(self, request: Request, body: Any) -> Response:
        f = Fields(body)
        tokenizer, info = await self._ready(f.str("model"))
        if f.has("messages"):
            rendered = body | {"stream": False, "stream_options": None}
            chat_input = openai_requests.chat_request(rendered, check_fields=False).input
            assert chat_input.chat is not None
            ids = await self._chat_token_ids(chat_input.chat, tokenizer, info, chat_input.tools)
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

    async def _chat_token_ids(self, chat: Chat, tokenizer: Tokenizer, info: ModelInfo, tools: ToolRequest) -> list[int]:
        size = sum(len(m["content"]) for m in chat.messages) + sum(len(t.parameters) for t in tools.tools)
        return await self.generation.chat_token_ids(chat, tokenizer, info.max_model_len, size, tools)

    def _decode(self, token_ids: list[int]) -> str:
        return self.generation.loaded_tokenizer().decode(token_ids, skip_special_tokens=False)


def _response_not_found(response_id: str) -> HttpError:
    return HttpError(404, f"Response with id {response_id!r} not found.", param="response_id", code="not_found")


async def _not_found(request: Request, exc) -> Response:
    return OPENAI.response(HttpError(404, f"no such path: {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc) -> Response:
    return OPENAI.response(
        HttpError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    )


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return OPENAI.response(HttpError(500, "internal error; the frontend's log has the details", type="internal_error"))
