"""Server-sent events: each chunk JSON-encoded once, straight to bytes.

    data(obj)          b'data: {...}\n\n'                       (OpenAI chunks)
    event(name, obj)   b'event: NAME\ndata: {...}\n\n'          (Anthropic events)
    DONE               b'data: [DONE]\n\n'                       (the end of an OpenAI stream)
    PING               b': ping\n\n'                            (a comment: keeps proxies from cutting an idle stream)
    with_pings(pieces) the pieces, with None wherever PING_S passed before the first one

JSON is written compact and without NaN or infinities (``allow_nan=False``): the
converters clamp log-probabilities first, so a stray non-finite value is a bug that
shows as an error, never as invalid JSON on the wire.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
PING_S = 10.0  # proxies commonly cut a stream idle for 30-60 s
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # nginx: do not buffer the stream

_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def dumps(obj) -> bytes:
    return _encode(obj).encode()


def data(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def event(name: str, obj) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


async def with_pings(pieces: AsyncIterator[T], ping_s: float = PING_S) -> AsyncIterator[T | None]:
    """``pieces`` as they come, and None each ``ping_s`` seconds that pass before the first
    (a long prompt prefilling). After the first piece they are passed on as they are, with
    no task per piece: tokens then come far more often than any proxy's idle timeout."""
    first = asyncio.ensure_future(anext(pieces))
    try:
        while not first.done():
            done, _ = await asyncio.wait({first}, timeout=ping_s)
            if not done:
                yield None
        try:
            yield first.result()
        except StopAsyncIteration:
            return
    finally:
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    async for piece in pieces:
        yield piece
