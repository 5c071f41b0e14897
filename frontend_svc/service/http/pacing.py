"""Coalescing for the HTTP face: a streamed call's next chunk waits while the frontend is busy.

    paced(pieces, pacer)   the pieces, the call holding pacer.hold() s after each one's SSE chunk
    Pacer.hold()           0 s, or up to MAX_HOLD_S while the frontend is busy
    Pacer    ── BusyShare: the share of wall time the event loop's thread ran or waited for a core

A gRPC write waits for its completion, which a busy frontend delivers late: the tokens that
arrive meanwhile are merged into the call's next message (docs/streaming.md), so the busier
the frontend, the more tokens each message carries and the less CPU each token costs. An
SSE chunk's write returns at once (uvicorn hands it to the socket), so without a wait of
its own an HTTP call writes one chunk per engine message at any load, and a saturated
frontend spends its core on per-chunk work. The pacer gives the HTTP writer that wait,
from the same cause: after each chunk the call holds for

    0                                        while the loop's busy share < SHARE_LOW
    MAX_HOLD_S * (share - SHARE_LOW) / (1 - SHARE_LOW)          above it

and then takes everything its engine requests delivered meanwhile, as one chunk (one
JSON encoding, the text byte-identical). An idle or lightly loaded frontend never holds:
each token goes out as soon as it arrives, as over gRPC.

The busy share counts the time the thread waited for a core as busy (Linux's schedstat:
run time plus run-queue delay), so that a frontend starved by other processes on its
cores coalesces too; where schedstat cannot be read, the thread's CPU time alone.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator

from frontend_svc.text.output_processor import ChoiceOutput

SHARE_LOW = 0.6  # below it, nothing is held
MAX_HOLD_S = 0.008  # the hold at a busy share of 1: up to ~4 tokens per chunk at 2 ms per token
SAMPLE_S = 0.005  # the share is re-read at most this often
SMOOTHING_S = 0.05  # its time constant: a burst of writes is not a busy frontend
_SCHEDSTAT = "/proc/thread-self/schedstat"


class BusyShare:
    """The share of wall time this thread ran or waited to run, smoothed over ~SMOOTHING_S.
    Made and read on the event loop's thread."""

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open(_SCHEDSTAT, os.O_RDONLY)
            self._busy_s()
        except (OSError, ValueError, IndexError):
            self._close()
        self._wall = time.monotonic()
        self._busy = self._busy_s()
        self.share = 0.0

    def _busy_s(self) -> float:
        if self._fd is None:
            return time.thread_time()
        run_ns, wait_ns = os.pread(self._fd, 128, 0).split()[:2]
        return (int(run_ns) + int(wait_ns)) * 1e-9

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self) -> float:
        """The smoothed share, re-sampled when SAMPLE_S has passed since the last sample."""
        now = time.monotonic()
        elapsed = now - self._wall
        if elapsed >= SAMPLE_S:
            busy = self._busy_s()
            recent = min(1.0, (busy - self._busy) / elapsed)
            self.share += (1.0 - math.exp(-elapsed / SMOOTHING_S)) * (recent - self.share)
            self._wall, self._busy = now, busy
        return self.share

    def __del__(self) -> None:
        self._close()


class Pacer:
    """How long a streamed HTTP call holds after each chunk (the module docstring's rule)."""

    def __init__(self, busy: BusyShare | None = None) -> None:
        self._busy = busy

    def hold(self) -> float:
        if self._busy is None:  # made on first use, on the event loop's thread
            self._busy = BusyShare()
        share = self._busy.read()
        if share <= SHARE_LOW:
            return 0.0
        return MAX_HOLD_S * min(1.0, (share - SHARE_LOW) / (1.0 - SHARE_LOW))


async def paced(pieces: AsyncIterator[ChoiceOutput], pacer: Pacer) -> AsyncIterator[ChoiceOutput]:
    """``pieces``, each asked for only after the previous one's chunk was written and the
    call held (a finished choice's piece is not held for: what follows it is the end)."""
    async for piece in pieces:
        yield piece  # resumed once the piece's chunk was written
        if not piece.finished and (hold := pacer.hold()):
            await asyncio.sleep(hold)
