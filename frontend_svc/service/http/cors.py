"""Cross-origin requests from browsers: vLLM's three flags, its defaults, one ASGI layer.

    --allowed-origins '["https://app.example"]'   JSON arrays, as vLLM takes them;
    --allowed-methods '["GET", "POST"]'           each defaults to ["*"] (any), as vLLM's do
    --allowed-headers '["authorization"]'        (parsed and checked in frontend_svc/config.py)
    with_cors(app, Cors(...))   outermost: a preflight (OPTIONS with Origin and
                                Access-Control-Request-Method) is answered before the API key
                                is asked for, since browsers send no credentials on it

Credentials (cookies) are never allowed: the API key travels in a header, which
``Access-Control-Allow-Headers`` covers, and ``*`` origins with credentials would let any
site act as the browser's user. ``X-Request-Id`` and ``Retry-After`` are exposed so that a
page can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.middleware.cors import CORSMiddleware

ANY = "*"
EXPOSED = ("x-request-id", "retry-after")


@dataclass(frozen=True)
class Cors:
    origins: list[str] = field(default_factory=lambda: [ANY])
    methods: list[str] = field(default_factory=lambda: [ANY])
    headers: list[str] = field(default_factory=lambda: [ANY])

    def describe(self) -> str:
        return f"origins {_joined(self.origins)}, methods {_joined(self.methods)}, headers {_joined(self.headers)}"


def with_cors(app, cors: Cors):
    """``app`` behind the CORS layer (none when no origin is allowed)."""
    if not cors.origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=cors.origins,
        allow_methods=cors.methods,
        allow_headers=cors.headers,
        allow_credentials=False,
        expose_headers=list(EXPOSED),
    )


def _joined(values: list[str]) -> str:
    return ",".join(values) if values else "none"
