"""Request lifecycle events, for tracing and metrics, on the engine thread.

    queued ──▶ scheduled ──▶ first_token ──▶ finished
     (add)   (first admission)  (after a step)   (any end: stop, length, abort, error)
                    └── preempted (any number of times, between scheduled and finished)

``RequestEvents`` turns what the EngineLoop and the scheduler already see into these
events and hands them to listeners (``RequestListener``). It exists only when someone
listens: otherwise ``EngineLoop.events`` and ``Scheduler.observer`` are None and none
of this runs. When it runs, its work happens at these events, plus one look per step
at the requests that were admitted but have no output token yet; never per token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from engine_svc.outputs import EngineOutput
from engine_svc.sched.request import Request

logger = logging.getLogger(__name__)


@dataclass
class RequestTimeline:
    """One request's lifecycle times (``time.time_ns()``, engine clock)."""

    request: Request
    queued_ns: int
    scheduled_ns: int = 0
    first_token_ns: int = 0
    finished_ns: int = 0
    span: Any = None  # the tracer's span of this request, when tracing

    @property
    def queue_time_s(self) -> float:
        return (self.scheduled_ns - self.queued_ns) / 1e9

    @property
    def time_to_first_token_s(self) -> float:
        return (self.first_token_ns - self.queued_ns) / 1e9

    @property
    def e2e_s(self) -> float:
        return (self.finished_ns - self.queued_ns) / 1e9


class RequestListener:
    """Receives lifecycle events; every method is optional."""

    def on_queued(self, timeline: RequestTimeline) -> None:
        pass

    def on_scheduled(self, timeline: RequestTimeline) -> None:
        pass

    def on_first_token(self, timeline: RequestTimeline) -> None:
        pass

    def on_preempted(self, timeline: RequestTimeline, now_ns: int) -> None:
        pass

    def on_finished(self, timeline: RequestTimeline, output: EngineOutput) -> None:
        """``output`` is the request's last output (finish reason, error, token counts)."""


class RequestEvents:
    """Tracks live requests by engine request id and tells the listeners what happens.

    It is the scheduler's observer (scheduled, preempted); the EngineLoop calls
    ``queued`` on add, ``after_step`` after each step and ``finished`` for each final
    output. Unknown ids are ignored, so a listener attached late sees only new requests.
    """

    def __init__(self) -> None:
        self.listeners: list[RequestListener] = []
        self._live: dict[str, RequestTimeline] = {}
        self._awaiting_first_token: dict[str, RequestTimeline] = {}

    def queued(self, request: Request) -> None:
        timeline = RequestTimeline(request, time.time_ns())
        self._live[request.request_id] = timeline
        self._emit("on_queued", timeline)

    # -- SchedulerObserver -------------------------------------------------------------

    def request_scheduled(self, request: Request) -> None:
        timeline = self._live.get(request.request_id)
        if timeline is None:
            return
        timeline.scheduled_ns = time.time_ns()
        self._awaiting_first_token[request.request_id] = timeline
        self._emit("on_scheduled", timeline)

    def request_preempted(self, request: Request) -> None:
        timeline = self._live.get(request.request_id)
        if timeline is None:
            return
        self._emit("on_preempted", timeline, time.time_ns())

    # -- called by the EngineLoop ----------------------------------------------------

    def after_step(self) -> None:
        """First tokens: only requests admitted but not yet past their prefill are looked at."""
        if not self._awaiting_first_token:
            return
        done = [t for t in self._awaiting_first_token.values() if t.request.num_output_tokens]
        if not done:
            return
        now = time.time_ns()
        for timeline in done:
            del self._awaiting_first_token[timeline.request.request_id]
            timeline.first_token_ns = now
            self._emit("on_first_token", timeline)

    def finished(self, output: EngineOutput) -> None:
        """``output.request_id`` must still be the engine request id."""
        timeline = self._live.pop(output.request_id, None)
        if timeline is None:
            return
        self._awaiting_first_token.pop(output.request_id, None)
        timeline.finished_ns = time.time_ns()
        self._emit("on_finished", timeline, output)

    def _emit(self, event: str, *args) -> None:
        # A faulty listener must never stop the engine loop or fail a request.
        for listener in self.listeners:
            try:
                getattr(listener, event)(*args)
            except Exception:  # noqa: BLE001
                logger.exception("request listener %s failed on %s", type(listener).__name__, event)
