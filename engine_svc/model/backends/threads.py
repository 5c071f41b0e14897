"""How many threads each step runs on, chosen by timing steps.

    governor.before_step(num_tokens)   sets torch's thread count for the step
    governor.after_step(seconds, work) learns from how long it took

A parallel region ends when its slowest thread does, and a step runs hundreds of them. On
a CPU shared with other work the OS takes a thread away for a time slice at a time, and
every region that thread is part of waits for it. Measured on a 2-vCPU AMD EPYC at load
average 9-12 from other jobs (benchmark model): a decode step of 48 rows took 0.8 s on one
thread and 2.5-3.8 s on two; on a quiet machine two threads are ~1.7x faster than one.
So the runner times steps at each thread count it may use (all of them, or one) and keeps
the faster, trying the other again now and then: soon while the two are close, rarely
while one is far ahead, so that a wrong guess costs little.

Steps differ in size by three orders of magnitude, and small ones gain least from
threads: estimates are kept per size class (powers of two of the step's token count), in
seconds per unit of work (the caller's model of the step's arithmetic).

Only used where the result does not depend on the thread count (the native kernels never
split a sum across threads), so the choice changes speed, never tokens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

MIN_INTERVAL = 8  # steps of a size class between two tries of the other thread count
MAX_INTERVAL = 256
CLEAR_MARGIN = 1.25  # the other count is this much slower: try it less often
ALPHA = 0.5  # weight of the newest measurement


@dataclass
class _SizeClass:
    interval: int  # steps between two tries of a count that is not the best
    cost: dict[int, float] = field(default_factory=dict)  # threads -> seconds per unit of work
    since: dict[int, int] = field(default_factory=dict)  # threads -> steps since last measured

    def choose(self, choices: tuple[int, ...], preferred: int) -> tuple[int, bool]:
        """(threads, whether this is a try of a count other than the best known)."""
        measured = [n for n in choices if n in self.cost]
        if not measured:
            return preferred, False
        best = min(measured, key=self.cost.__getitem__)
        for n in choices:
            if n != best and self.since.get(n, 0) >= self.interval:
                return n, True
        return best, False


class ThreadGovernor:
    """One estimate per size class; what one class learns about the machine (which count
    wins, and by how much) seeds the classes met later, since a busy machine is busy for
    steps of every size."""

    def __init__(self, max_threads: int) -> None:
        self.choices = (max_threads, 1) if max_threads > 1 else (1,)
        self._classes: dict[int, _SizeClass] = {}
        self._preferred = self.choices[0]
        self._interval = MIN_INTERVAL
        self._current = torch.get_num_threads()
        self._step: tuple[_SizeClass, int, bool] | None = None

    @property
    def threads(self) -> int:
        return self._current

    def before_step(self, num_tokens: int) -> None:
        key = min(num_tokens, 1 << 16).bit_length()
        size = self._classes.get(key)
        if size is None:
            size = self._classes[key] = _SizeClass(interval=self._interval)
        n, trying = size.choose(self.choices, self._preferred)
        if n != self._current:
            torch.set_num_threads(n)
            self._current = n
        self._step = (size, n, trying)

    @contextlib.contextmanager
    def all_threads(self) -> Iterator[None]:
        """Every thread for work the step's choice was not made for (a draft model's passes:
        its size is not the step's), then the step's count again."""
        n = self.choices[0]
        if n == self._current:
            yield
            return
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(self._current)

    def after_step(self, seconds: float, work: float) -> None:
        if self._step is None or work <= 0:
            return
        size, n, trying = self._step
        self._step = None
        cost = seconds / work
        size.cost[n] = cost if n not in size.cost else ALPHA * cost + (1 - ALPHA) * size.cost[n]
        for m in self.choices:
            size.since[m] = 0 if m == n else size.since.get(m, 0) + 1
        if trying:
            best = min(c for m, c in size.cost.items() if m != n)
            clear = size.cost[n] > CLEAR_MARGIN * best
            size.interval = min(2 * size.interval, MAX_INTERVAL) if clear else MIN_INTERVAL
            self._interval = size.interval
            self._preferred = min(size.cost, key=size.cost.__getitem__)
            logger.debug("threads %d: %.3g s/unit vs %.3g (%s)", n, size.cost[n], best, "clear" if clear else "close")

    def summary(self) -> dict[str, dict[int, float]]:
        """Per size class (fewer than N tokens): seconds per unit of work at each thread count."""
        return {f"< {1 << k} tokens": dict(c.cost) for k, c in sorted(self._classes.items())}
