"""Rounds of one piece of work that each caller needs started after it asked.

A caller that must see the engines as they are now (was this LoRA adapter loaded a moment
ago?) cannot use an answer fetched before it asked, nor, under a flood of such callers,
may each of them ask the engines itself. ``FreshRounds.after_now()`` returns once a round
of ``work`` that started after the call has ended::

    caller A ──┐ round 1 starts ··· ends ─┐
    caller B ────── (round 1 started before B: B waits for round 2) ──┐
    caller C ──────────────── round 2 starts ······ ends ─────────────┴─▶ B and C return

At most one round runs at a time, and every caller waiting when a round starts shares it:
a flood costs one round at a time, whatever its rate, and nothing when nobody asks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class FreshRounds:
    def __init__(self, work: Callable[[], Awaitable[object]]) -> None:
        self._work = work
        self._started = 0  # rounds that have started
        self._ended = 0  # the last round that has ended (rounds end in order: one at a time)
        self._task: asyncio.Task | None = None

    async def after_now(self) -> None:
        """Return once a round that started after this call has ended (its failure included)."""
        wanted = self._started + 1
        while self._ended < wanted:
            if self._task is None:
                self._task = asyncio.create_task(self._round())
            await asyncio.shield(self._task)  # a cancelled caller leaves the round to the others

    async def _round(self) -> None:
        self._started += 1
        try:
            await self._work()
        except Exception:  # noqa: BLE001 - a failed round still ends; its callers decide without it
            logger.debug("a round of %s failed", self._work, exc_info=True)
        finally:
            self._ended = self._started
            self._task = None
