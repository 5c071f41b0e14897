"""What a step costs on this machine, by its number of rows: measured, never assumed.

    calibration (start-up): seconds of dummy decode steps of 1, 2, ... rows
    every decode step:      observe(rows, seconds)
    the planner:            seconds(rows), for any row count

Kept per row count. A shared machine only ever adds time to a step (another process takes
the CPU for a slice), so an estimate follows a faster measurement at once (weight
``FALL``) and a slower one slowly (``RISE``): it tracks what the step costs this machine
when nothing else intervenes, and still rises within tens of steps when the step itself
got dearer (longer contexts). Between measured row counts the cost is interpolated;
beyond the largest it grows in proportion to the rows (every row as dear as the average
one), a bound that makes drafting there look no better than it can be.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

FALL = 0.5
RISE = 0.05


class StepCosts:
    def __init__(self) -> None:
        self._rows: list[int] = []  # sorted row counts with an estimate
        self._seconds: dict[int, float] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def observe(self, num_rows: int, seconds: float) -> None:
        if num_rows <= 0 or seconds <= 0.0:
            return
        estimate = self._seconds.get(num_rows)
        if estimate is None:
            bisect.insort(self._rows, num_rows)
            self._seconds[num_rows] = seconds
        else:
            weight = FALL if seconds < estimate else RISE
            self._seconds[num_rows] = estimate + weight * (seconds - estimate)

    def observe_all(self, measurements: Iterable[tuple[int, float]]) -> None:
        for num_rows, seconds in measurements:
            self.observe(num_rows, seconds)

    def seconds(self, num_rows: int) -> float:
        """Estimated seconds of a step of ``num_rows`` rows (0 without any measurement)."""
        rows, seconds = self._rows, self._seconds
        if not rows or num_rows <= 0:
            return 0.0
        i = bisect.bisect_left(rows, num_rows)
        if i < len(rows) and rows[i] == num_rows:
            return seconds[num_rows]
        if i == 0:
            return seconds[rows[0]]
        if i == len(rows):
            return seconds[rows[-1]] * num_rows / rows[-1]
        lo, hi = rows[i - 1], rows[i]
        return seconds[lo] + (seconds[hi] - seconds[lo]) * (num_rows - lo) / (hi - lo)

    def table(self) -> dict[int, float]:
        """Row count -> estimated seconds, for the measured counts."""
        return {n: self._seconds[n] for n in self._rows}


def calibration_sizes(max_rows: int) -> list[int]:
    """Row counts to time at start-up: every count to 8, then about 25% apart."""
    sizes = list(range(1, min(max_rows, 8) + 1))
    n = 8
    while n < max_rows:
        n = min(max_rows, max(n + 1, round(n * 1.25)))
        sizes.append(n)
    return sizes
