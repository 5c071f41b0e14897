"""What the scheduler asks of speculative decoding, and the engine without it.

    schedule():            plan(running, budget)        drafts per decoding request
    update_from_output():  record(...) per request       one verification (none: no drafts)
                           observe(scheduler output,     the step's cost
                                   runner output)
    blocks given back:     drop_draft_cache(request id)
    request finished:      forget(request id)

The scheduler calls every verb unconditionally: ``NoSpeculation`` plans no drafts, so
nothing downstream ever has any to verify, and its other verbs do nothing. ``Speculator``
(``speculator.py``) is the one that drafts. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from engine_svc.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from engine_svc.sched.request import Request

# (rows, seconds) measurements of the given row counts (the runner's calibration).
Timer = Callable[[list[int]], list[tuple[int, float]]]


class Speculation(Protocol):
    def plan(self, running: Sequence[Request], num_budget: int) -> dict[str, list[int]]:
        """Draft tokens for this step's decoding requests, by request id; requests without
        drafts are absent. ``running`` in the order the budget is handed out in."""
        ...

    def record(
        self,
        request_id: str,
        num_drafted: int,
        num_accepted: int,
        num_verified: int | None = None,
        *,
        num_tokens: int | None = None,
    ) -> None:
        """A request's verification this step (``num_drafted`` 0: it had no drafts)."""
        ...

    def observe(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """The step ran: what it cost."""
        ...

    def drop_draft_cache(self, request_id: str) -> None:
        """The request's blocks went back (preempted, paused)."""
        ...

    def forget(self, request_id: str) -> None: ...

    def calibrate(
        self, time_steps: Timer, time_draft_passes: Timer, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        """Before serving: time what the adaptive rule weighs."""
        ...

    def snapshot(self) -> SpecDecodeStats | None:
        """The totals for other threads; None: speculative decoding is off."""
        ...


class NoSpeculation:
    """The engine without speculative decoding: no drafts, nothing to learn."""

    def plan(self, running: Sequence[Request], num_budget: int) -> dict[str, list[int]]:
        return {}

    def record(
        self,
        request_id: str,
        num_drafted: int,
        num_accepted: int,
        num_verified: int | None = None,
        *,
        num_tokens: int | None = None,
    ) -> None:
        pass

    def observe(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        pass

    def drop_draft_cache(self, request_id: str) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def calibrate(
        self, time_steps: Timer, time_draft_passes: Timer, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        pass

    def snapshot(self) -> SpecDecodeStats | None:
        return None
