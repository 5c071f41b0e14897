"""The thread governor on a simulated machine: steps take what a cost table says."""

from __future__ import annotations

import pytest

from engine_svc.model.backends import threads
from engine_svc.model.backends.threads import MAX_INTERVAL, ThreadGovernor


@pytest.fixture
def set_threads(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(threads.torch, "set_num_threads", calls.append)
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 2)
    return calls


def _run(governor: ThreadGovernor, seconds_per_work: dict[int, float], steps: int, tokens=(1, 40, 1024)) -> list[int]:
    """Steps of a few sizes; returns the thread count each ran on."""
    used = []
    for i in range(steps):
        num_tokens = tokens[i % len(tokens)]
        governor.before_step(num_tokens)
        used.append(governor.threads)
        governor.after_step(seconds_per_work[governor.threads] * num_tokens, float(num_tokens))
    return used


def test_a_busy_machine_ends_on_one_thread_and_rarely_tries_two(set_threads):
    governor = ThreadGovernor(2)
    used = _run(governor, {1: 1.0, 2: 3.0}, 3000)
    late = used[1000:]
    assert late.count(2) <= 3 * (len(late) // MAX_INTERVAL + 1)  # a try per class every MAX_INTERVAL steps
    assert used.count(2) < 60  # what learning cost, over three size classes
    assert set_threads and set(set_threads) <= {1, 2}


def test_a_quiet_machine_stays_on_all_threads(set_threads):
    governor = ThreadGovernor(2)
    used = _run(governor, {1: 1.7, 2: 1.0}, 3000)
    assert used[0] == 2 and used[1000:].count(1) <= 3 * (2000 // MAX_INTERVAL + 1)


def test_close_counts_are_re_tried_often_and_a_change_of_load_is_followed(set_threads):
    governor = ThreadGovernor(2)
    used = _run(governor, {1: 1.0, 2: 1.1}, 600)
    assert used[300:].count(2) >= 300 // 16  # within the margin: both keep being measured
    used = _run(governor, {1: 1.0, 2: 0.4}, 3000)  # the other work on the machine stops
    assert used[-500:].count(2) > 450


def test_one_core_has_nothing_to_choose(set_threads):
    governor = ThreadGovernor(1)
    assert set(_run(governor, {1: 1.0}, 50)) == {1}
    assert governor.summary()


def test_all_threads_runs_on_every_thread_then_restores_the_step_choice(set_threads):
    governor = ThreadGovernor(2)
    _run(governor, {1: 1.0, 2: 3.0}, 200)  # a busy machine: steps on one thread
    governor.before_step(1)
    assert governor.threads == 1
    set_threads.clear()
    with governor.all_threads():
        assert set_threads == [2]
    assert set_threads == [2, 1] and governor.threads == 1
