"""The HTTP server: uvicorn inside the frontend's own asyncio loop, beside grpc.aio.

    HttpServer(app, ...).start()   binds (SO_REUSEPORT with --workers), uvicorn startup on that socket
    .stop(grace)                   stops accepting, lets requests in progress finish up to ``grace`` s

Never ``uvicorn.run``: it makes a second event loop, and the grpc.aio objects (engine
streams, the router) can be used only from the loop that made them. uvicorn's own signal
handling is not installed either: the frontend's handlers decide when to drain. One
ASGI layer in front of the app checks API keys (every path but /health) and counts
requests by route and status. Limits: ``max_body_bytes`` per body (413, in app.py); the
connections' deadlines and caps, and the head's size and fields (connection.py:
``ConnectionLimits``, enforced by uvicorn's h11 protocol subclassed there).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import socket

import uvicorn
from prometheus_client import Counter

from frontend_svc.service.http import sse
from frontend_svc.service.http.connection import ConnectionLimits, protocol_class
from frontend_svc.service.http.errors import HttpError

logger = logging.getLogger(__name__)

ROUTES = frozenset(
    (
        "/health",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    )
)
OPEN_PATHS = frozenset(("/health",))


class Guard:
    """ASGI middleware: API keys (``authorization: Bearer KEY`` or ``x-api-key: KEY``), and
    the count of HTTP requests by route and status."""

    def __init__(self, app, keys: list[str], requests: Counter) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]
        self._requests = requests

    def _authorized(self, headers) -> bool:
        for key, value in headers:
            if key == b"authorization" and value[:7].lower() == b"bearer ":
                value = value[7:].strip()
            elif key != b"x-api-key":
                continue
            if any(hmac.compare_digest(value, k) for k in self._keys):
                return True
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else _route_template(path)
        status = [0]

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._keys and path not in OPEN_PATHS and not self._authorized(scope["headers"]):
                error = HttpError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'")
                body = error.anthropic_body() if path.startswith("/v1/messages") else error.openai_body()
                await _send_json(counted_send, 401, body)
                return
            await self.app(scope, receive, counted_send)
        finally:
            self._requests.labels(route, str(status[0] or 499)).inc()  # 499: gone before an answer


def _route_template(path: str) -> str:
    """The route label of a path with an id in it (a stored response's), else "other"."""
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}/cancel" if path.endswith("/cancel") else "/v1/responses/{id}"
    return "other"


async def _send_json(send, status: int, body: dict) -> None:
    data = sse.dumps(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class HttpServer:
    def __init__(
        self,
        app,
        *,
        host: str,
        port: int,
        reuse_port: bool = False,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        limits: ConnectionLimits | None = None,
        grace_s: float = 30.0,
    ) -> None:
        self.host = host.strip("[]")
        self.port = port
        self.reuse_port = reuse_port
        self.limits = limits or ConnectionLimits()
        self.config = uvicorn.Config(
            app,
            host=self.host,
            port=port,
            # uvicorn's h11 protocol (pure Python, the head's byte limit a setting of h11) with
            # the connections' deadlines and caps; the call limit is the servicer's, not this.
            http=protocol_class(self.limits),
            loop="none",  # the running loop: never a second one
            lifespan="off",
            log_config=None,  # the frontend's logging as it is set up
            access_log=False,  # each generation request has its own log line (request_stats)
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
            timeout_keep_alive=math.ceil(self.limits.idle_timeout_s),  # the protocol's own idle deadline comes first
            timeout_graceful_shutdown=math.ceil(grace_s),
            server_header=False,
        )
        self.server = uvicorn.Server(self.config)
        self._socket: socket.socket | None = None
        self._main: asyncio.Task | None = None

    async def start(self) -> int:
        """Listens; returns the port (the chosen one for port 0)."""
        self._socket = _bind(self.host, self.port, self.reuse_port)
        self.port = self._socket.getsockname()[1]
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[self._socket])
        # main_loop refreshes the Date header each second and returns once should_exit is set.
        self._main = asyncio.create_task(self.server.main_loop(), name="http")
        return self.port

    async def stop(self) -> None:
        if self._main is None:
            return
        self.server.should_exit = True
        await self._main
        await self.server.shutdown(sockets=[self._socket] if self._socket is not None else None)


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # --workers: every worker binds the port; the kernel spreads connections
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen for HTTP on {host}:{port}: {e}") from e
    return sock


def http_requests_counter(registry) -> Counter:
    return Counter(
        "tandem_frontend_http_requests", "HTTP requests by route and status", ["route", "status"], registry=registry
    )
