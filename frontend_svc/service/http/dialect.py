"""How each HTTP API names its parameters and writes its errors and events: OpenAI's, Anthropic's.

    Dialect.error(e)          HttpError | CallError | EngineUnavailableError ──▶ HttpError in this API's names
    Dialect.response(e)       ──▶ the JSON error response (its status, body, Retry-After)
    Dialect.event(name, obj)  ──▶ one server-sent event (OpenAI chat: data only; Responses, Anthropic: named)
    Dialect.stream_error(e)   ──▶ the event that ends a stream cut by an error
    Dialect.ping, .done       a keep-alive event; what closes every stream (OpenAI's [DONE], else nothing)

Planning and the engines speak CallError, whose INVALID_ARGUMENT messages start with a
field path of the gRPC API (``sampling_params.top_p``); ``param_name`` turns that path into
the API's own parameter (errors.from_call_error). A model name no engine serves is 404
``model_not_found``, naming what is served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response

from frontend_svc.service.http import anthropic_api, openai_requests, responses_requests, sse
from frontend_svc.service.http.errors import HttpError, from_call_error
from frontend_svc.types import CallError, UnknownModelError
from tandem_common.types import ErrorCode


@dataclass(frozen=True)
class Dialect:
    param_name: Callable[[str], str]
    body: Callable[[HttpError], dict]
    event: Callable[[str, dict], bytes]
    ping: bytes
    done: bytes = b""

    def error(self, error: Exception, rename: Callable[[str], str] | None = None) -> HttpError:
        """``rename``: the request's own names for field paths, where it has them (else ``param_name``)."""
        if isinstance(error, HttpError):
            return error
        if isinstance(error, UnknownModelError):
            served = ", ".join(repr(n) for n in error.served)
            return HttpError(
                404,
                f"the model {error.name!r} does not exist; this server serves {served} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if not isinstance(error, CallError):  # EngineUnavailableError: no engine can serve
            error = CallError(ErrorCode.UNAVAILABLE, str(error))
        return from_call_error(error, rename or self.param_name)

    def response(self, error: Exception, rename: Callable[[str], str] | None = None) -> Response:
        e = self.error(error, rename)
        return Response(
            sse.dumps(self.body(e)), status_code=e.status, headers=e.headers(), media_type="application/json"
        )

    def stream_error(self, error: Exception) -> bytes:
        return self.event("error", self.body(self.error(error)))


def _data(name: str, obj: dict) -> bytes:
    return sse.data(obj)  # OpenAI's events are unnamed


OPENAI = Dialect(openai_requests.param_name, HttpError.openai_body, _data, sse.PING, sse.DONE)
ANTHROPIC = Dialect(anthropic_api.param_name, HttpError.anthropic_body, sse.event, sse.event("ping", {"type": "ping"}))
# The Responses API: OpenAI's errors, its parameter names, named events and no [DONE].
RESPONSES = Dialect(responses_requests.param_name, HttpError.openai_body, sse.event, sse.PING)
