"""LoRA adapters loaded and unloaded over HTTP, as vLLM serves it (``--http-lora-admin``).

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}  ──▶ 200 text, on every engine of the model
    POST /v1/unload_lora_adapter  {"lora_name"}               ──▶ 200 text, from every engine that has it

Behind the API key like every route (server.Guard), and only with its own flag, which
needs a key (config.py): ``lora_path`` names a directory on the engines' file system.
The work is the engines' LoadLoraAdapter / UnloadLoraAdapter RPCs, fanned out by
engine/lora_admin.py (all or none on load). The answers are vLLM's: plain text on
success; errors in OpenAI's body, 400 for what the engines refuse (no --enable-lora, an
adapter they cannot serve, a name already loaded, an adapter still in use), 404 for an
unknown name on unload, 503 with no engine.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from frontend_svc.engine.lora_admin import load_everywhere, unload_everywhere
from frontend_svc.engine.router import EngineRouter
from frontend_svc.service.http import allow_list
from frontend_svc.service.http.errors import HttpError, bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.types import CallError
from tandem_common.types import ErrorCode

logger = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
# The engines' statuses as vLLM answers them: what they refuse is the request's fault.
_STATUS = {ErrorCode.NOT_FOUND: 404, ErrorCode.UNAVAILABLE: 503}


class LoraAdmin:
    def __init__(self, router: EngineRouter) -> None:
        self.router = router

    async def load(self, request: Request, body: Any) -> Response:
        allow_list.check(body, allow_list.LOAD_LORA)
        f = Fields(body)
        name, path = _required(f, "lora_name"), _required(f, "lora_path")
        try:
            engines = await load_everywhere(self.router, name, path)
        except CallError as e:
            raise _http_error(e) from None
        logger.info("LoRA adapter %r loaded from %s on %s", name, path, ", ".join(engines))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request, body: Any) -> Response:
        allow_list.check(body, allow_list.UNLOAD_LORA)
        name = _required(Fields(body), "lora_name")
        try:
            engines = await unload_everywhere(self.router, name)
        except CallError as e:
            raise _http_error(e) from None
        logger.info("LoRA adapter %r unloaded from %s", name, ", ".join(engines))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _required(f: Fields, name: str) -> str:
    value = f.str(name)
    if not value:
        raise bad_request(name, "is required: a non-empty string")
    return value


def _http_error(e: CallError) -> HttpError:
    status = _STATUS.get(e.code, 400)
    return HttpError(status, str(e), code=e.code.value.lower(), retryable=status == 503)
