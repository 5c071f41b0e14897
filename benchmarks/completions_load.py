"""One load client for any OpenAI-compatible server: token-id prompts to ``/v1/completions``.

    figures = asyncio.run(run_cell(base_url, requests, concurrency))

Every request is sent as the same JSON body whatever the server: the prompt as an array
of token ids, ``max_tokens``, ``temperature`` 0 (greedy), ``ignore_eos``, not streamed
(one response per request: the least client and server work per token, the same for
both sides). All requests are released at once; at most ``concurrency`` are open at a
time (a closed loop). Output tokens are the server's ``usage.completion_tokens``; a
request that returns fewer than its ``max_tokens`` is an error, so every cell generates
exactly the tokens it asks for.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx


def body(request: dict) -> dict:
    return {
        "prompt": request["prompt_token_ids"],
        "max_tokens": request["max_tokens"],
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": False,
    }


def _cached_tokens(answer: dict) -> int:
    """Prompt tokens the server says it served from its cache (OpenAI's usage field, or
    llama.cpp's ``timings.cache_n``); 0 where it says nothing."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"] or 0)
    return int((answer.get("timings") or {}).get("cache_n", 0) or 0)


async def run_cell(base_url: str, requests: list[dict], concurrency: int, timeout: float = 3600.0) -> dict:
    """Sends ``requests`` with at most ``concurrency`` open; returns the cell's figures."""
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    errors: list[str] = []
    latencies: list[float] = []
    texts: list[str | None] = [None] * len(requests)
    counts = {"output": 0, "cached": 0}

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def one(i: int, request: dict) -> None:
            async with slots:
                t0 = time.perf_counter()
                try:
                    response = await client.post("/v1/completions", json=body(request))
                except httpx.HTTPError as e:
                    errors.append(f"request {i}: {type(e).__name__}: {e}")
                    return
                latencies.append(time.perf_counter() - t0)
            if response.status_code != 200:
                errors.append(f"request {i}: HTTP {response.status_code}: {response.text[:300]}")
                return
            answer = response.json()
            made = int(answer["usage"]["completion_tokens"])
            if made != request["max_tokens"]:
                errors.append(f"request {i}: {made} tokens, asked for {request['max_tokens']}")
            counts["output"] += made
            counts["cached"] += _cached_tokens(answer)
            texts[i] = answer["choices"][0]["text"]

        start = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        wall = time.perf_counter() - start
    return {
        "num_requests": len(requests),
        "concurrency": concurrency,
        "num_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "num_output_tokens": counts["output"],
        "num_cached_prompt_tokens": counts["cached"],
        "wall_s": wall,
        "output_tok_per_s": counts["output"] / wall,
        "latency_s_median": statistics.median(latencies) if latencies else None,
        "errors": errors,
        "texts": texts,
    }
