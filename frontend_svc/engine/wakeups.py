"""Reading one engine stream with adaptive coalescing: the calls an engine message fed are
woken once the stream holds nothing more that is already here.

    read_stream(call, on_response, wakeups)     delivers each message at once (on_response),
                                                wakes the calls it fed (Wakeups) after the
                                                messages already waiting are read too

While a message is delivered the next read is started; if it completes before the event
loop has been idle for PROBE_TURNS turns, the engine's messages were waiting for this
frontend (it lags): the calls are woken only after the backlog is read (at most
MAX_DEFERRED_S after the first), so each call writes everything that arrived in one
message. Turns that other work made long (the calls writing their previous messages) do
not count as idle: a busy frontend reads on until the writes are done. An idle frontend
finds the next read still waiting and wakes the calls at once: their tokens go out one by
one, a few loop turns later than without the probe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

# The idle event-loop turns a finished read is looked for, how long a turn may take and
# still count as idle, and the longest the calls' wake-ups wait while a backlog is read.
PROBE_TURNS = 3
BUSY_TURN_S = 0.0005
MAX_DEFERRED_S = 0.01


class Wakeups:
    """The calls' events to set once the stream's waiting messages are read (in order of
    first request: calls are woken in arrival order)."""

    def __init__(self) -> None:
        self._events: dict[asyncio.Event, None] = {}

    def soon(self, event: asyncio.Event) -> None:
        self._events[event] = None

    def __bool__(self) -> bool:
        return bool(self._events)

    def flush(self) -> None:
        events, self._events = self._events, {}
        for event in events:
            event.set()


async def read_stream(call: Any, on_response: Callable[[Any], None], wakeups: Wakeups) -> None:
    """Reads ``call`` to its end (the module docstring's rule)."""
    pending = asyncio.ensure_future(call.read())
    deferred_since = 0.0
    try:
        while True:
            response = await pending
            if response is grpc.aio.EOF:
                return
            on_response(response)
            pending = asyncio.ensure_future(call.read())
            if not wakeups:
                continue
            deferred_since = deferred_since or time.monotonic()
            if await _arrives_before_idle(pending, deferred_since + MAX_DEFERRED_S):
                continue  # more was waiting: read it before the calls write
            deferred_since = 0.0
            wakeups.flush()
    finally:
        if not pending.done():
            pending.cancel()
        elif not pending.cancelled():
            pending.exception()  # retrieved: the session's end reports it, not asyncio


async def _arrives_before_idle(pending: asyncio.Future, deadline: float) -> bool:
    """Whether ``pending`` completes before the event loop has made PROBE_TURNS idle turns
    (turns that took the loop's thread less than BUSY_TURN_S of CPU: nothing else was
    waiting to run; CPU time, so that a turn the OS preempted does not look busy), and
    before ``deadline`` (time.monotonic()): a loop kept busy by other work while the
    engine sends nothing must not hold the calls' wake-ups."""
    idle_turns = 0
    last = time.thread_time()
    while not pending.done() and idle_turns < PROBE_TURNS and time.monotonic() < deadline:
        await asyncio.sleep(0)
        now = time.thread_time()
        if now - last < BUSY_TURN_S:
            idle_turns += 1
        last = now
    return pending.done() and time.monotonic() < deadline
