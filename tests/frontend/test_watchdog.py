"""ProgressWatchdog: an engine that takes requests and advances nothing, checked once a second,
alone (the timeout) and against the engines that serve (relative_limit)."""

from __future__ import annotations

import time

import pytest

from frontend_svc.engine.watchdog import PACE_HALF_LIFE_S, Pace, ProgressWatchdog, relative_limit


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


def test_the_relative_limit_is_k_times_the_slowest_serving_pace_within_floor_and_timeout():
    rules = dict(factor=4.0, floor_s=3.0, timeout_s=30.0)
    assert relative_limit([Pace(0.0, 0.3)], None, **rules) == (3.0, 0.3)  # the floor
    assert relative_limit([Pace(0.0, 2.0), Pace(0.0, 0.1)], None, **rules) == (8.0, 2.0)  # the slowest serving
    assert relative_limit([Pace(0.0, 0.5)], 1.5, **rules) == (6.0, 1.5)  # its own pace counts too
    assert relative_limit([Pace(2.9, 0.5), Pace(3.1, 0.1)], None, **rules) == (3.0, 0.5)  # the stuck one is not
    assert relative_limit([Pace(5.0, 0.3)], None, **rules) is None  # no engine serves: the timeout alone
    assert relative_limit([Pace(0.0, None)], None, **rules) is None  # it never served
    assert relative_limit([], 0.3, **rules) is None  # alone
    assert relative_limit([Pace(0.0, 8.0)], None, **rules) is None  # 32 s: past the timeout, which acts
    assert relative_limit([Pace(0.0, 0.3)], None, factor=0.0, floor_s=3.0, timeout_s=30.0) is None  # off
    assert relative_limit([Pace(0.0, 0.3)], None, factor=4.0, floor_s=3.0, timeout_s=0.0) is None  # all off


def test_beside_a_serving_engine_stuck_requests_move_and_grammar_waits_are_left_to_the_timeout():
    w = ProgressWatchdog(30.0, factor=4.0, floor_s=3.0)
    start = time.monotonic()
    w.sent("plain")
    w.sent("compiling", compiles=True)
    serving = [Pace(0.0, 0.5)]
    fired = {}
    for t in range(1, 10):
        if (verdict := w.stalled(start + t, serving)) is not None:
            fired[t] = verdict
            w.moved(verdict.request_ids)  # as the client does
    assert list(fired) == [4] and fired[4].request_ids == ("plain",) and not fired[4].end_session
    assert "they move to another engine" in fired[4].reason  # moved once; "compiling" waits for the timeout
    stuck_peer = [Pace(10.0, 0.5)]
    w2 = ProgressWatchdog(30.0, factor=4.0, floor_s=3.0)
    w2.sent("r")
    assert [t for t in range(1, 10) if w2.stalled(start + t, stuck_peer) is not None] == []  # no engine serves


def test_the_pace_is_the_slowest_first_output_or_gap_and_it_fades():
    w = ProgressWatchdog(30.0)
    assert w.pace(time.monotonic()) == Pace(0.0, None)
    w.sent("r")
    w._waiting["r"] = w._judged["r"] = time.monotonic() - 2.0  # sent two seconds ago
    w.started("r")
    pace = w.pace(time.monotonic()).pace_s
    assert pace is not None and 2.0 <= pace < 2.1
    faded = w.pace(time.monotonic() + PACE_HALF_LIFE_S).pace_s
    assert faded is not None and 1.0 <= faded < 1.05
    w.forget("never-sent")
    w.output(running=False)
    w.output(running=True)  # the first output since requests ran: no gap yet
    assert w.pace(time.monotonic()).pace_s == pytest.approx(pace, rel=0.01)
