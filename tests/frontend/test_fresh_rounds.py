"""FreshRounds: each caller returns after a round that started after it asked; callers
that ask together share a round; one round runs at a time; a failed round still ends."""

from __future__ import annotations

import asyncio

from frontend_svc.engine.fresh_rounds import FreshRounds


class _Work:
    """A round that records when it starts and waits for the test to end it."""

    def __init__(self, fail: bool = False) -> None:
        self.started: list[asyncio.Event] = []
        self.release: list[asyncio.Event] = []
        self.running = 0
        self.most_running = 0
        self.fail = fail

    async def round_started(self, i: int) -> None:
        while len(self.started) <= i:
            await asyncio.sleep(0.001)

    async def __call__(self) -> None:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        started, release = asyncio.Event(), asyncio.Event()
        self.started.append(started)
        self.release.append(release)
        started.set()
        try:
            await release.wait()
            if self.fail:
                raise RuntimeError("the engines did not answer")
        finally:
            self.running -= 1


async def test_a_caller_waits_for_a_round_that_started_after_it_asked():
    work = _Work()
    rounds = FreshRounds(work)
    first = asyncio.ensure_future(rounds.after_now())
    await asyncio.wait_for(work.round_started(0), 5)
    # Asked while round 1 runs: round 1 may have read the engines before these asked.
    late = [asyncio.ensure_future(rounds.after_now()) for _ in range(50)]
    await asyncio.sleep(0.01)
    work.release[0].set()
    await first
    assert not any(c.done() for c in late)
    await asyncio.wait_for(work.round_started(1), 5)
    work.release[1].set()
    await asyncio.gather(*late)
    assert len(work.started) == 2 and work.most_running == 1  # 51 callers, two rounds, one at a time


async def test_callers_asking_together_share_one_round_and_a_failed_round_still_ends():
    work = _Work(fail=True)
    rounds = FreshRounds(work)
    callers = [asyncio.ensure_future(rounds.after_now()) for _ in range(20)]
    await asyncio.sleep(0.01)
    work.release[0].set()
    await asyncio.wait_for(asyncio.gather(*callers), 5)
    assert len(work.started) == 1


async def test_a_cancelled_caller_leaves_the_round_to_the_others():
    work = _Work()
    rounds = FreshRounds(work)
    gone, stays = asyncio.ensure_future(rounds.after_now()), asyncio.ensure_future(rounds.after_now())
    await asyncio.sleep(0.01)
    gone.cancel()
    work.release[0].set()
    await asyncio.wait_for(stays, 5)
    assert len(work.started) == 1
