"""The progress watchdog: an engine that takes requests and advances none of them.

    EngineClient.add ─────── sent(request_id) ─────▶ ProgressWatchdog
    EngineClient outputs ─── started(request_id), output(), progressed() ─▶
    EngineClient._watch ──── stalled(now, the other engines' paces) every second ──▶ None, or a Verdict

The stream watchdog (client.py) catches an engine that goes silent. This one catches an
engine that still answers (its stream stays open, GetLoad answers) while its step loop
serves nothing. "Moved" is any output of any request, or a change of the load the engine
reports (its KV blocks and queued tokens change with every chunk of a long prefill), so a
busy engine, whose new requests queue behind others, and one prefilling a long prompt both
count as advancing. A request is *stuck* while it waits for its first output and nothing
moves on its engine. Two rules judge it:

* **Against the other engines** (``relative_limit``): while another engine serves (it
  served before, and none of its own requests is stuck past ``floor_s``), a request stuck
  longer than ``factor`` times the slowest pace among those engines and this one, and at
  least ``floor_s``, moves: the client aborts it here and fails it, so that the call, which
  has streamed nothing, is retried on another engine; the engine gets one request at a time
  until it advances one. An engine's *pace* is the slowest of its recent times from sending
  a request to its first output and between two outputs while requests run, as a maximum
  that halves every PACE_HALF_LIFE_S: a slow model, a long queue or a long prefill makes
  every engine's pace slow, and the rule patient. Requests under a structured-output
  constraint are left to the next rule: their start waits for a grammar to compile, which
  the other engines' paces do not show.
* **Alone** (``timeout_s``): a request stuck longer than ``timeout_s`` ends the engine's
  session: every call on it fails (those that streamed nothing are retried elsewhere), and
  it gets one request at a time until it advances one. This is the rule when no other
  engine serves.

    a black hole beside an engine that serves in 0.3 s: its calls move after
    max(3 s, 4 x 0.3 s) = 3 s (+ up to 1 s to the next check), not after the 30 s timeout

A frontend that could not run (its event loop blocked, the process stopped) has not read
what the engines sent: when a check comes late (LATE_CHECK_S after the one before), the
clocks restart instead of blaming the engines.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

LATE_CHECK_S = 3.0  # a check this long after the previous one: the frontend itself was stalled
DEFAULT_PROGRESS_FACTOR = 4.0  # stuck this many times the slowest serving engine's pace: move
DEFAULT_PROGRESS_FLOOR_S = 3.0  # ... and never sooner: a check a second, a load poll a second, slack
PACE_HALF_LIFE_S = 600.0  # a slow pace is remembered for minutes: slow periods make the rule patient


@dataclass(frozen=True)
class Pace:
    """One engine as the others are judged against it, at a check."""

    stuck_s: float  # how long its oldest judgeable request has waited while nothing moved on it (0: none)
    pace_s: float | None  # its slowest recent time to a first output or between outputs; None: it served none


@dataclass(frozen=True)
class Verdict:
    """What a check found: requests to move to other engines, or the whole session to end."""

    reason: str
    request_ids: tuple[str, ...] = ()  # to move (abort here, retry elsewhere); () when the session ends
    end_session: bool = False


def relative_limit(
    peers: Sequence[Pace], own_pace_s: float | None, *, factor: float, floor_s: float, timeout_s: float
) -> tuple[float, float] | None:
    """(How long a request may be stuck on an engine, the pace it is judged by) while another
    engine serves; None when none does, the rule is off (``factor`` or ``timeout_s`` 0), or the
    limit would reach ``timeout_s`` (the rule alone then acts).

    An engine serves if it has a pace (it served) and nothing of its own is stuck past
    ``floor_s``. The pace judged by is the slowest of the serving engines' and this one's.

    >>> relative_limit([Pace(0.0, 0.3)], None, factor=4, floor_s=3, timeout_s=30)
    (3, 0.3)
    >>> relative_limit([Pace(0.0, 2.0), Pace(10.0, 0.1)], 1.0, factor=4, floor_s=3, timeout_s=30)
    (8.0, 2.0)
    >>> relative_limit([Pace(5.0, 0.3)], None, factor=4, floor_s=3, timeout_s=30) is None  # it is stuck too
    True
    """
    if not factor or not timeout_s:
        return None
    serving = [p.pace_s for p in peers if p.pace_s is not None and p.stuck_s <= floor_s]
    if not serving:
        return None
    pace_s = max(serving + ([own_pace_s] if own_pace_s is not None else []))
    limit = max(floor_s, factor * pace_s)
    return (limit, pace_s) if limit < timeout_s else None


class ProgressWatchdog:
    """Requests sent and not started, when the engine last moved, and its pace.
    ``timeout_s`` 0: off; ``factor`` 0: no judging against other engines."""

    def __init__(
        self,
        timeout_s: float,
        factor: float = DEFAULT_PROGRESS_FACTOR,
        floor_s: float = DEFAULT_PROGRESS_FLOOR_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.factor = factor
        self.floor_s = floor_s
        self._waiting: dict[str, float] = {}  # request id -> when sent, oldest first (dict order)
        self._judged: dict[str, float] = {}  # those of them the relative rule may move
        self._progress_s = time.monotonic()
        self._output_s: float | None = None  # the last output while requests ran
        self._checked_s = self._progress_s
        self._pace_s: float | None = None
        self._pace_at = self._progress_s

    def sent(self, request_id: str, *, compiles: bool = False) -> None:
        """``compiles``: its start waits for a grammar to compile; the relative rule leaves it be."""
        now = time.monotonic()
        self._waiting[request_id] = now
        if not compiles:
            self._judged[request_id] = now

    def started(self, request_id: str) -> None:
        """The request produced its first output: it no longer waits, and its wait is a pace sample."""
        sent_s = self._waiting.pop(request_id, None)
        self._judged.pop(request_id, None)
        if sent_s is not None:
            self._sample(time.monotonic() - sent_s)

    def forget(self, request_id: str) -> None:
        """The request is gone without an output (its abort was never confirmed): no sample."""
        self._waiting.pop(request_id, None)
        self._judged.pop(request_id, None)

    def moved(self, request_ids: Sequence[str]) -> None:
        """These were moved to other engines: not judged again (the rule alone still sees them)."""
        for request_id in request_ids:
            self._judged.pop(request_id, None)

    def output(self, running: bool) -> None:
        """An output message came; ``running``: requests had started and run until it (its gap is a sample)."""
        now = time.monotonic()
        if running and self._output_s is not None:
            self._sample(now - self._output_s)
        self._output_s = now if running else None
        self._progress_s = now

    def progressed(self) -> None:
        self._progress_s = time.monotonic()

    def clear(self) -> None:
        """Every request is gone (the session ended): nothing waits, the clock restarts."""
        self._waiting.clear()
        self._judged.clear()
        self._output_s = None
        self._progress_s = time.monotonic()

    def pace(self, now: float) -> Pace:
        return Pace(self._stuck_s(self._judged, now), self._pace_now(now))

    def stalled(self, now: float, peers: Sequence[Pace] = ()) -> Verdict | None:
        """What to do about the engine, or None. Called about once a second."""
        late = now - self._checked_s > LATE_CHECK_S
        self._checked_s = now
        if late:
            self._progress_s = now
            self._output_s = None
            self._waiting = dict.fromkeys(self._waiting, now)
            self._judged = dict.fromkeys(self._judged, now)
            return None
        if not self.timeout_s or not self._waiting:
            return None
        oldest_s = next(iter(self._waiting.values()))
        if now - oldest_s > self.timeout_s and now - self._progress_s > self.timeout_s:
            return Verdict(
                f"the engine took {len(self._waiting)} requests and advanced none of them, nor anything else, "
                f"for {now - max(oldest_s, self._progress_s):.1f} s (--engine-progress-timeout-s "
                f"{self.timeout_s:g}); it is not serving",
                end_session=True,
            )
        judged = relative_limit(
            peers, self._pace_now(now), factor=self.factor, floor_s=self.floor_s, timeout_s=self.timeout_s
        )
        if judged is None:
            return None
        limit_s, pace_s = judged
        stuck_s = self._stuck_s(self._judged, now)
        if stuck_s <= limit_s:
            return None
        due = tuple(rid for rid, sent_s in self._judged.items() if now - sent_s > limit_s)
        return Verdict(
            f"{len(due)} requests waited {stuck_s:.1f} s for a first output while nothing moved on the engine, "
            f"where engines that serve take {pace_s:.2f} s (--engine-progress-factor {self.factor:g}, "
            f"--engine-progress-floor-s {self.floor_s:g}); they move to another engine",
            request_ids=due,
        )

    def _stuck_s(self, waiting: dict[str, float], now: float) -> float:
        if not waiting:
            return 0.0
        return now - max(next(iter(waiting.values())), self._progress_s)

    def _sample(self, seconds: float) -> None:
        now = time.monotonic()
        self._pace_s = max(seconds, self._pace_now(now) or 0.0)
        self._pace_at = now

    def _pace_now(self, now: float) -> float | None:
        if self._pace_s is None:
            return None
        return self._pace_s * 0.5 ** ((now - self._pace_at) / PACE_HALF_LIFE_S)


def silence_verdict(silent_s: float, stall_timeout_s: float, num_requests: int) -> str | None:
    """Why a session whose engine has said nothing for ``silent_s`` is hung, or None if it is not yet."""
    if silent_s <= stall_timeout_s:
        return None
    return (
        f"the engine sent nothing and answered no GetLoad for {silent_s:.1f} s with "
        f"{num_requests} requests in flight (--engine-stall-timeout-s {stall_timeout_s:g}); it is hung"
    )
