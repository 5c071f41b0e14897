"""The load of benchmarks.capacity over the HTTP face: ``num_calls`` streamed /v1/completions.

The same calls as the gRPC load (16 prompt token ids, greedy, ignore_eos, a max_tokens no
call reaches), each an SSE stream on its own connection (HTTP/1.1 streams one response
per connection at a time). Every chunk carries ``usage``
(``stream_options.continuous_usage_stats``), whose completion_tokens tell how many tokens
the chunk brought: the figure the gRPC load reads from ``token_ids``.

The client is as cheap per message as a Python client gets, so that on a small machine
it takes as little of the cores the frontend needs as the gRPC load does: an asyncio
protocol per connection, httptools (llhttp, in C) undoing the chunked transfer coding,
and of each SSE event only the number after ``"completion_tokens":`` read (the event is
not JSON-decoded). The gRPC load does the least its protocol allows too: one
``call.read()`` per message and the length of its ``token_ids``.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httptools

_USAGE_KEY = b'"completion_tokens":'
_EVENT_END = b"\n\n"
_DIGITS = b"0123456789"


class _SseCall(asyncio.Protocol):
    """One streamed completion on its own connection; ``ended`` resolves when it ends."""

    def __init__(self, load: HttpLoad, record, request: bytes) -> None:
        self._load = load
        self._record = record
        self._request = request
        self._parser = httptools.HttpResponseParser(self)
        self._buffer = b""
        self._seen = 0
        self.status = 0
        self.ended = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._end(f"bad response: {e}")

    def connection_lost(self, exc) -> None:
        self._end("connection closed" if exc is None else type(exc).__name__)

    # -- httptools callbacks -------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        buffer = self._buffer + body if self._buffer else body
        now = time.perf_counter()
        start = 0
        while (end := buffer.find(_EVENT_END, start)) >= 0:
            self._event(buffer, start, end, now)
            start = end + 2
        self._buffer = buffer[start:]

    def _event(self, buffer: bytes, start: int, end: int, now: float) -> None:
        """One SSE event, buffer[start:end]: its usage's completion_tokens (a comment, the
        final usage-only chunk and [DONE] bring no new tokens)."""
        at = buffer.find(_USAGE_KEY, start, end)
        if at < 0:
            return
        at += len(_USAGE_KEY)
        stop = at
        while buffer[stop] in _DIGITS:
            stop += 1
        num_tokens = int(buffer[at:stop])
        k, self._seen = num_tokens - self._seen, num_tokens
        if self._load.recording and k:
            self._record.times.append(now)
            self._record.sizes.append(k)

    def on_message_complete(self) -> None:
        self._end(None if self.status == 200 else str(self.status))

    def _end(self, error: str | None) -> None:
        if not self.ended.done():
            self.ended.set_result(error)
            self.transport.close()


class HttpLoad:
    """Same interface as benchmarks.capacity.Load: calls, recording, errors, start, reset, close."""

    def __init__(self, base_url: str, num_calls: int, new_call) -> None:
        """``new_call()`` makes the record of one call (benchmarks.capacity's, with times and sizes)."""
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.calls = [new_call() for _ in range(num_calls)]
        self.recording = False
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for i, call in enumerate(self.calls):
            self._tasks.append(asyncio.create_task(self._run(call, i)))

    def _request(self, i: int) -> bytes:
        body = json.dumps(
            {
                "prompt": [1 + (i + j) % 500 for j in range(16)],
                "max_tokens": 1 << 19,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def _run(self, record, i: int) -> None:
        loop = asyncio.get_running_loop()
        request = self._request(i)
        while True:  # a call that ends (it should not) is replaced
            transport = None
            try:
                transport, stream = await loop.create_connection(
                    lambda: _SseCall(self, record, request), self.host, self.port
                )
                error = await stream.ended
            except asyncio.CancelledError:
                if transport is not None:
                    transport.close()
                return
            except OSError as e:
                error = type(e).__name__
            if error is not None:
                self.errors.append(error)
            await asyncio.sleep(0.1)

    def reset(self) -> None:
        for call in self.calls:
            call.times.clear()
            call.sizes.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
