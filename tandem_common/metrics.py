"""Prometheus helpers shared by both services, and the /metrics endpoint they serve.

The endpoint runs in a thread of its own with its own event loop (``MetricsServer``), never
on a service's serving event loop or the engine's step thread. Renders are rationed by a
token bucket: BURST_RENDERS at once, refilled one per MIN_RENDER_INTERVAL_S (longer when
rendering is slow, so that it never takes more than RENDER_SHARE of a core). A scraper
that comes now and then (Prometheus every few seconds, a person, a test) always gets a
fresh page; a scrape flood gets the last page rendered, so it costs one render per
interval plus the bytes sent. One connection at a time may
take at most REQUEST_TIMEOUT_S to send its request, and at most MAX_CONNECTIONS are open
at once; past that new connections are closed unanswered.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

from prometheus_client import CollectorRegistry, gc_collector, platform_collector, process_collector
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger(__name__)

MIN_RENDER_INTERVAL_S = 0.1  # a flood gets one render per this long ...
RENDER_SHARE = 0.05  # ... or per 1/RENDER_SHARE times a render's duration, so rendering takes <= 5% of a core
BURST_RENDERS = 5  # renders allowed back to back before the flood rate applies
REQUEST_TIMEOUT_S = 5.0  # to send the request line and headers, and to take the page
MAX_CONNECTIONS = 64

# Latencies from ~1 ms (a GPU decode step) to a minute (a long CPU request).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
)
# Token counts per request or per step.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def new_registry() -> CollectorRegistry:
    """A registry with the usual process, platform and GC collectors."""
    registry = CollectorRegistry()
    process_collector.ProcessCollector(registry=registry)
    platform_collector.PlatformCollector(registry=registry)
    gc_collector.GCCollector(registry=registry)
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> MetricsServer:
    """Serve ``registry`` at http://HOST:PORT/metrics from a daemon thread (port 0: a free one).
    The port is bound before this returns, so a port in use fails here."""
    server = MetricsServer(registry, host, port)
    server.start()
    return server


class MetricsServer:
    """/metrics of one registry, from its own thread, with the page cached (see the module)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family)
        self.port: int = self._sock.getsockname()[1]
        self.num_renders = 0
        self._pages: dict[str, bytes] = {}  # content type -> its last page
        self._render_s = 0.0  # how long the last render took
        self._tokens = float(BURST_RENDERS)  # renders allowed now
        self._refilled_s = time.monotonic()
        self._num_open = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), name="metrics", daemon=True).start()
        ready.wait(10)

    def close(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    def page(self, accept: str) -> tuple[bytes, str]:
        """The page in the format ``accept`` asks for: rendered now while the bucket allows,
        else the last one rendered."""
        encoder, content_type = choose_encoder(accept)
        now = time.monotonic()
        interval = max(MIN_RENDER_INTERVAL_S, self._render_s / RENDER_SHARE)
        self._tokens = min(BURST_RENDERS, self._tokens + (now - self._refilled_s) / interval)
        self._refilled_s = now
        cached = self._pages.get(content_type)
        if cached is not None and self._tokens < 1:
            return cached, content_type
        self._tokens -= 1
        body = encoder(self.registry)
        self._render_s = time.monotonic() - now
        self.num_renders += 1
        self._pages[content_type] = body
        return body, content_type

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        server = loop.run_until_complete(asyncio.start_server(self._handle, sock=self._sock, limit=16 * 1024))
        ready.set()
        try:
            loop.run_forever()
        finally:  # close(): every connection is closed before the loop
            server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._num_open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._num_open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            writer.write(self._response(head))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:  # noqa: BLE001 - a bad scrape must never end the endpoint
            logger.exception("metrics request failed")
        finally:
            self._num_open -= 1
            writer.close()

    def _response(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method not in ("GET", "HEAD"):
            return _http(405, b"only GET\n", "text/plain")
        if path not in ("/metrics", "/"):
            return _http(404, b"the metrics are at /metrics\n", "text/plain")
        accept = next((v for k, _, v in (h.partition(":") for h in lines[1:]) if k.strip().lower() == "accept"), "")
        body, content_type = self.page(accept.strip())
        return _http(200, body, content_type, head_only=method == "HEAD")


def _http(status: int, body: bytes, content_type: str, *, head_only: bool = False) -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)
