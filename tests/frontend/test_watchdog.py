"""ProgressWatchdog: an engine that takes requests and advances nothing, checked once a second."""

from __future__ import annotations

import time

from frontend_svc.engine.watchdog import ProgressWatchdog


def run(watchdog: ProgressWatchdog, seconds: int, start: float) -> list[int]:
    """The seconds (after ``start``) at which a check found the engine stalled."""
    return [t for t in range(1, seconds + 1) if watchdog.stalled(start + t) is not None]


def test_a_request_that_waits_while_nothing_moves_is_a_stall():
    w = ProgressWatchdog(5.0)
    start = time.monotonic()
    w.sent("r1")
    fired = run(w, 8, start)
    assert fired and fired[0] == 6


def test_progress_elsewhere_or_a_start_keeps_it_quiet_and_zero_is_off():
    w = ProgressWatchdog(5.0)
    start = time.monotonic()
    w.sent("queued")
    w._progress_s = start + 4  # another request's output (progressed()) at t=4
    assert run(w, 8, start) == []  # 8 - 4 is within the timeout
    w.started("queued")
    assert w.stalled(start + 9) is None  # nothing waits
    off = ProgressWatchdog(0.0)
    off.sent("r")
    assert run(off, 10, start) == []


def test_a_late_check_restarts_the_clocks():
    w = ProgressWatchdog(5.0)
    start = time.monotonic()
    w.sent("r")
    assert w.stalled(start + 1) is None
    assert w.stalled(start + 20) is None  # the frontend itself did not run for 19 s
    assert run(w, 24, start + 20) == list(range(6, 25))
