"""The requests on one engine stream, by id, from their add until the engine confirms their end.

The table a client keeps for its session (client.py): which handle an output goes to, which
requests have not produced a token yet (their prompt tokens count in the engine's load until
then), and what the progress watchdog (watchdog.py) is told of each. The dict is the same
object for the table's whole life: a session's end clears it, never replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from frontend_svc.engine.handle import RequestHandle
from frontend_svc.engine.watchdog import ProgressWatchdog
from frontend_svc.types import EngineOutput, EngineUnavailableError

logger = logging.getLogger(__name__)


class InFlight:
    """One stream's live requests and their prompt tokens not yet computed."""

    def __init__(self, progress: ProgressWatchdog) -> None:
        self.requests: dict[str, RequestHandle] = {}
        self._progress = progress
        # Requests sent that have not produced a token yet -> their prompt tokens to compute.
        self._unstarted: dict[str, int] = {}
        self.unstarted_tokens = 0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def running(self) -> bool:
        """Some request has produced a token and not finished."""
        return len(self.requests) > len(self._unstarted)

    def sent(self, handle: RequestHandle, num_prefill_tokens: int, *, compiles: bool) -> None:
        self.requests[handle.request_id] = handle
        self._unstarted[handle.request_id] = num_prefill_tokens
        self.unstarted_tokens += num_prefill_tokens
        self._progress.sent(handle.request_id, compiles=compiles)

    def started(self, request_id: str) -> None:
        self.unstarted_tokens -= self._unstarted.pop(request_id, 0)
        self._progress.started(request_id)

    def deliver(self, outputs: Iterable[EngineOutput], wake: Callable[[RequestHandle], None], address: str) -> list:
        """Hands each output to its request's handle; returns the ids whose readers lag (to pause)."""
        to_pause: list[str] = []
        for out in outputs:
            self.started(out.request_id)
            handle = self.requests.get(out.request_id)
            if handle is None:
                logger.debug("engine %s: output for unknown request %s dropped", address, out.request_id)
                continue
            if out.finished:
                del self.requests[out.request_id]
            if handle.deliver(out):
                wake(handle)
            if handle.wants_pause:  # its reader lags: the engine holds it until the reader takes its output
                handle.paused = True
                to_pause.append(handle.request_id)
        return to_pause

    def fail(self, request_ids: Iterable[str], error: Exception) -> None:
        """Fails these live requests (nothing was streamed for them: their calls retry elsewhere)."""
        for rid in request_ids:
            self.requests[rid].fail(error)

    def fail_all(self, reason: str) -> None:
        self._progress.clear()
        self._unstarted.clear()
        self.unstarted_tokens = 0
        handles = list(self.requests.values())
        self.requests.clear()
        for handle in handles:
            handle.fail(EngineUnavailableError(reason))

    def forget(self, handle: RequestHandle, address: str) -> None:
        """Drops an aborted request the engine never confirmed."""
        if self.requests.get(handle.request_id) is handle:
            logger.warning("engine %s never confirmed the abort of %s", address, handle.request_id)
            del self.requests[handle.request_id]
            self._progress.forget(handle.request_id)
            self.started(handle.request_id)
