"""What the engine loop does when its own code fails: the fault stays with its cause.

    a command fails   ─▶ that command alone: an add is refused in band (INTERNAL), its
                         partial state undone; every other request and the loop go on
    the thread dies   ─▶ every stream ends at once (the servicer answers UNAVAILABLE, since
                         EngineLoop.failure is set), health turns NOT_SERVING (on_failure)

Without this, one bad command ended the loop thread while health still said SERVING and
GetLoad still answered: the frontend kept routing to an engine that would answer nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from engine_svc.outputs import EngineStats, RejectedAdd
from engine_svc.types import ErrorCode, RequestError

logger = logging.getLogger(__name__)


def failed_add(request_id: str) -> RejectedAdd:
    """The in-band answer to an add whose applying raised."""
    return RejectedAdd(
        request_id, RequestError(ErrorCode.INTERNAL, "the engine failed to add this request; see the engine log")
    )


def end_streams(sinks: Iterable[Callable[..., object]], stats: EngineStats) -> None:
    """End every stream (its sink's ``(None, stats)``), each alone: one failing sink stops no other."""
    for sink in sinks:
        try:
            sink(None, stats)
        except Exception:
            logger.exception("ending a stream after the engine loop died")
