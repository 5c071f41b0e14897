"""The load of benchmarks.capacity over the HTTP face: ``num_calls`` streamed /v1/completions.

The same calls as the gRPC load (16 prompt token ids, greedy, ignore_eos, a max_tokens no
call reaches), each an SSE stream on its own connection (HTTP/1.1 streams one response
per connection at a time). Every chunk carries
``usage`` (``stream_options.continuous_usage_stats``), whose completion_tokens tell how
many tokens the chunk brought: the figure the gRPC load reads from ``token_ids``.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx


class HttpLoad:
    """Same interface as benchmarks.capacity.Load: calls, recording, errors, start, reset, close."""

    def __init__(self, base_url: str, num_calls: int, new_call) -> None:
        """``new_call()`` makes the record of one call (benchmarks.capacity's, with times and sizes)."""
        limits = httpx.Limits(max_connections=num_calls + 4, max_keepalive_connections=num_calls + 4)
        self.client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None)
        self.calls = [new_call() for _ in range(num_calls)]
        self.recording = False
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for i, call in enumerate(self.calls):
            self._tasks.append(asyncio.create_task(self._run(call, i)))

    async def _run(self, call, i: int) -> None:
        body = {
            "prompt": [1 + (i + j) % 500 for j in range(16)],
            "max_tokens": 1 << 19,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        while True:  # a call that ends (it should not) is replaced
            try:
                async with self.client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.errors.append(str(response.status_code))
                        await asyncio.sleep(0.1)
                        continue
                    seen = 0
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        num_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                        k, seen = num_tokens - seen, num_tokens
                        if self.recording and k:
                            call.times.append(time.perf_counter())
                            call.sizes.append(k)
            except asyncio.CancelledError:
                return
            except httpx.HTTPError as e:
                self.errors.append(type(e).__name__)
                await asyncio.sleep(0.1)

    def reset(self) -> None:
        for call in self.calls:
            call.times.clear()
            call.sizes.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
