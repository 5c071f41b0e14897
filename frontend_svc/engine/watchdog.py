"""The progress watchdog: an engine that takes requests and advances none of them.

    EngineClient.add ─────── sent(request_id) ─────▶ ProgressWatchdog
    EngineClient outputs ─── started(request_id), progressed() ─▶
    EngineClient._watch ──── stalled(now) every second ──▶ None, or why the engine is a black hole

The stream watchdog (client.py) catches an engine that goes silent. This one catches an
engine that still answers (its stream stays open, GetLoad answers) while its step loop
serves nothing: a request waits longer than ``timeout_s`` for its first output, and
nothing at all moved on the engine meanwhile. "Moved" is any output of any request, or a
change of the load the engine reports (its KV blocks and queued tokens change with every
chunk of a long prefill), so a busy engine, whose new requests queue behind others, and
one prefilling a long prompt both count as advancing.

A frontend that could not run (its event loop blocked, the process stopped) has not read
what the engines sent: when a check comes late (LATE_CHECK_S after the one before), the
clocks restart instead of blaming the engines.
"""

from __future__ import annotations

import time

LATE_CHECK_S = 3.0  # a check this long after the previous one: the frontend itself was stalled


class ProgressWatchdog:
    """Requests sent and not started, and when the engine last moved; ``timeout_s`` 0: off."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._waiting: dict[str, float] = {}  # request id -> when sent, oldest first (dict order)
        self._progress_s = time.monotonic()
        self._checked_s = self._progress_s

    def sent(self, request_id: str) -> None:
        self._waiting[request_id] = time.monotonic()

    def started(self, request_id: str) -> None:
        """The request produced an output (or is forgotten): it no longer waits."""
        self._waiting.pop(request_id, None)

    def progressed(self) -> None:
        self._progress_s = time.monotonic()

    def clear(self) -> None:
        """Every request is gone (the session ended): nothing waits, the clock restarts."""
        self._waiting.clear()
        self._progress_s = time.monotonic()

    def stalled(self, now: float) -> str | None:
        """Why the engine is not serving, or None. Called about once a second."""
        late = now - self._checked_s > LATE_CHECK_S
        self._checked_s = now
        if late:
            self._progress_s = now
            self._waiting = dict.fromkeys(self._waiting, now)
            return None
        if not self.timeout_s or not self._waiting:
            return None
        oldest_s = next(iter(self._waiting.values()))
        if now - oldest_s <= self.timeout_s or now - self._progress_s <= self.timeout_s:
            return None
        return (
            f"the engine took {len(self._waiting)} requests and advanced none of them, nor anything else, for "
            f"{now - max(oldest_s, self._progress_s):.1f} s (--engine-progress-timeout-s {self.timeout_s:g}); "
            "it is not serving"
        )
