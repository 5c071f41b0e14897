"""HTTP errors of both APIs: one exception, one status table, two JSON shapes.

    CallError(code, "field: what to fix") ── from_call_error() ──▶ HttpError(status, message, param)
    HttpError ── openai_body() ──▶ {"error": {"message", "type", "param", "code"}}     (OpenAI's shape)
              ── anthropic_body() ──▶ {"type": "error", "error": {"type", "message"}} (/v1/messages)

Planning names fields by their path in the gRPC API (``sampling_params.top_p``); each face
passes a ``rename`` that turns that path into its own parameter name, so an HTTP client
reads ``param: "top_p"`` and a message that starts with it.
"""

from __future__ import annotations

from collections.abc import Callable

from frontend_svc.types import CallError
from tandem_common.types import ErrorCode

# ErrorCode -> (HTTP status, OpenAI error type). RESOURCE_EXHAUSTED and UNAVAILABLE are
# retryable: their responses carry Retry-After, as gRPC clients retry on those codes.
_STATUS = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    ErrorCode.FAILED_PRECONDITION: (503, "service_unavailable"),
    ErrorCode.INTERNAL: (500, "internal_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),  # a model (LoRA adapter) no engine serves
}
RETRY_AFTER_S = 1
# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class HttpError(Exception):
    """Ends an HTTP request with ``status`` and a message that says what to fix."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _type_of(status)
        self.code = code
        self.retryable = retryable

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message},
        }

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(RETRY_AFTER_S)} if self.retryable else {}


def bad_request(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param=param)


def from_call_error(error: CallError, rename: Callable[[str], str]) -> HttpError:
    """The HTTP error for a planning or engine error; an INVALID_ARGUMENT's leading field
    path becomes the face's parameter name."""
    status, kind = _STATUS.get(error.code, (500, "internal_error"))
    message, param = str(error), None
    if error.code is ErrorCode.INVALID_ARGUMENT and ": " in message:
        field, rest = message.split(": ", 1)
        if " " not in field:  # a path, not prose
            param = rename(field)
            message = f"{param}: {rest}"
    retryable = error.code in (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE)
    return HttpError(status, message, param=param, type=kind, code=error.code.value.lower(), retryable=retryable)


def _type_of(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    return "invalid_request_error" if status < 500 else "internal_error"
