"""Prometheus helpers shared by both services, and the /metrics endpoint they serve.

The endpoint runs in a thread of its own with its own event loop (``MetricsServer``), never
on a service's serving event loop or the engine's step thread; but it shares the process's
CPU and GIL with them, so what it does is rationed (scrape_ration.py):

* connections are accepted at most ``max_rate`` a second from all clients together; the
  rest wait in the kernel's listen queue, which costs the service nothing;
* each client address gets ``client_rate`` pages a second (a burst of CLIENT_BURST_S of
  them); past that it is answered 429 with a Retry-After;
* renders are rationed by a token bucket: BURST_RENDERS at once, refilled one per
  MIN_RENDER_INTERVAL_S (longer when rendering is slow, so that it never takes more than
  RENDER_SHARE of a core). A scraper that comes now and then (Prometheus every few seconds,
  a person, a test) always gets a fresh page; a flood gets the last page rendered.

Most of a scrape's cost is per connection (measured in a process of its own: 190 us of
CPU through asyncio's streams, 85-110 us as below; a cached page adds little), so a connection is read and
answered on the endpoint's thread with plain socket calls, blocked in the kernel (holding
neither CPU nor GIL) for at most FAST_WAIT_S for its head to come and its answer to go,
which is nearly always enough; only a slower one gets a task, which waits at most
REQUEST_TIMEOUT_S for its head and again for its answer to go out. At most
MAX_CONNECTIONS such are open at once; past that new connections are closed unanswered.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

from prometheus_client import CollectorRegistry, gc_collector, platform_collector, process_collector
from prometheus_client.exposition import choose_encoder

from tandem_common.scrape_ration import DEFAULT_CLIENT_RATE, DEFAULT_MAX_RATE, ClientBuckets, TokenBucket

logger = logging.getLogger(__name__)

MIN_RENDER_INTERVAL_S = 0.1  # a flood gets one render per this long ...
RENDER_SHARE = 0.01  # ... or per 1/RENDER_SHARE times a render's duration, so rendering takes <= 1% of a core
BURST_RENDERS = 5  # renders allowed back to back before the flood rate applies
REQUEST_TIMEOUT_S = 5.0  # to send the request line and headers, and to take the page
MAX_CONNECTIONS = 64  # slow connections (their head not there at once) open together
MAX_HEAD_BYTES = 16 * 1024  # a longer request head is closed unanswered
ACCEPT_BATCH = 16  # connections accepted per turn of the endpoint's loop
FAST_WAIT_S = 0.005  # a connection's head and answer this quick are handled without a task

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


def serve_metrics(
    port: int,
    registry: CollectorRegistry,
    host: str = "0.0.0.0",
    *,
    client_rate: float = DEFAULT_CLIENT_RATE,
    max_rate: float = DEFAULT_MAX_RATE,
) -> MetricsServer:
    """Serve ``registry`` at http://HOST:PORT/metrics from a daemon thread (port 0: a free one).
    The port is bound before this returns, so a port in use fails here."""
    server = MetricsServer(registry, host, port, client_rate=client_rate, max_rate=max_rate)
    server.start()
    return server


class MetricsServer:
    """/metrics of one registry, from its own thread, rationed and cached (see the module)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        client_rate: float = DEFAULT_CLIENT_RATE,
        max_rate: float = DEFAULT_MAX_RATE,
    ) -> None:
        self.registry = registry
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self.num_renders = 0
        self.num_refused = 0  # answered 429: their address asked too often
        self._pages: dict[str, bytes] = {}  # content type -> its last page
        self._render_s = 0.0  # how long the last render took
        self._tokens = float(BURST_RENDERS)  # renders allowed now
        self._refilled_s = time.monotonic()
        self._accepts = TokenBucket(max_rate, max(1.0, max_rate), time.monotonic())  # a second's worth at once
        self._clients = ClientBuckets(client_rate)
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
        loop.add_reader(self._sock, self._accept)
        ready.set()
        try:
            loop.run_forever()
        finally:  # close(): every connection is closed before the loop
            loop.remove_reader(self._sock)
            self._sock.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def _accept(self) -> None:
        """Accept what the rate allows; when it allows none, stop listening until it does."""
        assert self._loop is not None
        for _ in range(ACCEPT_BATCH):
            now = time.monotonic()
            if not self._accepts.ready(now):
                # Back when a batch's worth is there: a wake-up per connection would cost more than it.
                self._pause_accepting(self._accepts.wait_s(now, ACCEPT_BATCH))
                return
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, say: the socket stays readable, so wait (as asyncio does)
                logger.warning("metrics: accepting a connection failed; trying again in 1 s", exc_info=True)
                self._pause_accepting(1.0)
                return
            self._accepts.take(now)
            try:
                self._answer(conn, self._clients.admit(address[0], now))
            except Exception:  # noqa: BLE001 - a bad scrape must never end the endpoint
                logger.exception("metrics request failed")
                conn.close()

    def _pause_accepting(self, seconds: float) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._sock)
        self._loop.call_later(seconds, self._loop.add_reader, self._sock, self._accept)

    def _answer(self, conn: socket.socket, retry_after: float) -> None:
        """Answer on this thread when the head comes and the answer goes within FAST_WAIT_S
        (blocked in the kernel meanwhile, holding neither CPU nor GIL), else hand the rest to
        a task. ``retry_after`` > 0: its address asked too often, 429."""
        conn.settimeout(FAST_WAIT_S)
        received, response, sent = b"", b"", 0
        try:
            while b"\r\n\r\n" not in received:
                if len(received) >= MAX_HEAD_BYTES:
                    raise _HeadTooLongError
                data = conn.recv(MAX_HEAD_BYTES - len(received))
                if not data:
                    raise ConnectionError("closed before its request head")
                received += data
            response = self._response(received, retry_after)
            view = memoryview(response)
            while sent < len(response):
                sent += conn.send(view[sent:])
        except TimeoutError:
            self._finish_later(conn, received, response[sent:], retry_after)
            return
        except (OSError, _HeadTooLongError):
            pass
        conn.close()

    def _finish_later(self, conn: socket.socket, received: bytes, response: bytes, retry_after: float) -> None:
        if self._num_open >= MAX_CONNECTIONS:
            conn.close()
            return
        self._num_open += 1
        conn.setblocking(False)
        asyncio.ensure_future(self._finish(conn, received, response, retry_after), loop=self._loop)

    async def _finish(self, conn: socket.socket, received: bytes, response: bytes, retry_after: float) -> None:
        """A slow connection: read the rest of its head, then send (the rest of) its answer."""
        loop = asyncio.get_running_loop()
        try:
            if not response:
                head = await asyncio.wait_for(_read_head(loop, conn, received), REQUEST_TIMEOUT_S)
                response = self._response(head, retry_after)
            await asyncio.wait_for(loop.sock_sendall(conn, response), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, _HeadTooLongError):
            pass
        except OSError:
            pass
        except Exception:  # noqa: BLE001 - a bad scrape must never end the endpoint
            logger.exception("metrics request failed")
        finally:
            self._num_open -= 1
            conn.close()

    def _response(self, head: bytes, retry_after: float) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method not in ("GET", "HEAD"):
            return _http(405, b"only GET\n", "text/plain")
        if path not in ("/metrics", "/"):
            return _http(404, b"the metrics are at /metrics\n", "text/plain")
        if retry_after:
            self.num_refused += 1
            wait_s = max(1, round(retry_after + 0.5))
            body = f"this address asks for metrics too often; retry in {wait_s} s\n".encode()
            return _http(429, body, "text/plain", extra=f"Retry-After: {wait_s}\r\n")
        accept = next((v for k, _, v in (h.partition(":") for h in lines[1:]) if k.strip().lower() == "accept"), "")
        body, content_type = self.page(accept.strip())
        return _http(200, body, content_type, head_only=method == "HEAD")


class _HeadTooLongError(Exception):
    pass


async def _read_head(loop: asyncio.AbstractEventLoop, conn: socket.socket, received: bytes) -> bytes:
    """The request head: ``received`` and what follows, up to its blank line."""
    while b"\r\n\r\n" not in received:
        if len(received) >= MAX_HEAD_BYTES:
            raise _HeadTooLongError
        data = await loop.sock_recv(conn, MAX_HEAD_BYTES - len(received))
        if not data:
            raise ConnectionError("closed before its request head")
        received += data
    return received


def _http(status: int, body: bytes, content_type: str, *, head_only: bool = False, extra: str = "") -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)
