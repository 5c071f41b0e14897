"""Generate calls in progress: the concurrent-call limit and the watch on clients that stopped reading.

    Generate ── calls.enter(caller) ──▶ Call    (RESOURCE_EXHAUSTED past --max-concurrent-calls,
                                                 or past the client's share: fair_share.py)
             ── call.write(response) ...        (time-stamped while the write waits)
             ── calls.leave(call)
    sweeper (every second or so) ── a write waiting past --stalled-client-timeout-s ──▶ call task cancelled

While a write waits, the call's engine outputs wait in the frontend (merged per request,
engine/handle.py); past ``max_pending_bytes`` for the call (--max-pending-output-bytes,
shared evenly by its n requests) a request is paused in the engine until the call reads
its output, so what a call holds is bounded in bytes and a slow reader only slows itself.

A write to the client waits only once gRPC's buffers for the call are full, that is when
the client has stopped reading (HTTP/2 flow control). Past the timeout the call's task is
cancelled; its lifecycle (generate_call.py) sees ``call.stalled``, aborts the engine
requests (so the engine stops computing for nobody) and ends the call with RESOURCE_EXHAUSTED. Nothing here runs
per token beyond two clock reads per write.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from frontend_svc.service.caller import Caller
from frontend_svc.service.fair_share import FairShare, client_of
from frontend_svc.types import CallError
from tandem_common.types import ErrorCode

logger = logging.getLogger(__name__)


class Call:
    """One Generate call in progress."""

    __slots__ = ("task", "writing_since", "stalled", "client")

    def __init__(self, task: asyncio.Task | None, client: str = "") -> None:
        self.task = task
        self.client = client  # who called (fair_share.client_of); "" when shares are off
        self.writing_since = 0.0  # monotonic time a write began; 0 while none waits
        self.stalled = False  # cancelled by the sweeper: the client stopped reading

    async def write(self, context, response) -> None:
        """Writes ``response``; raises CancelledError when the call is already over."""
        self.writing_since = time.monotonic()
        try:
            await context.write(response)
        except grpc.aio.InternalError as e:
            raise call_over(e) from e
        self.writing_since = 0.0


def call_over(error: grpc.aio.InternalError) -> asyncio.CancelledError:
    """What a handler raises when gRPC could not send on its call (a message, the status)
    because the call had already ended: the client cancelled, its deadline passed. gRPC
    tells the handler's task of the end by cancelling it, but from another completion,
    which may come after the failed send's; an ExecuteBatchError (an InternalError)
    escaping the handler first is logged by grpc.aio with a traceback, as if the servicer
    had failed. CancelledError is what the handler would have got a moment later."""
    return asyncio.CancelledError(f"the call ended before gRPC could send on it: {error}")


class InFlightCalls:
    """The Generate calls in progress, at most ``max_calls`` (0: no limit) and at most
    ``max_calls_per_client`` of one client (0: no limit; ``keyed``: clients are told apart
    by API key, else by address); writes that wait longer than ``stalled_timeout_s`` (0:
    never) cancel their call; a call's unread output past ``max_pending_bytes`` (0: no
    bound) pauses its requests in the engine."""

    def __init__(
        self,
        max_calls: int = 0,
        stalled_timeout_s: float = 0.0,
        *,
        max_calls_per_client: int = 0,
        keyed: bool = False,
        max_pending_bytes: int = 0,
    ) -> None:
        self.max_calls = max_calls
        self.stalled_timeout_s = stalled_timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.fair_share = FairShare(max_calls_per_client)
        self._keyed = keyed
        self._calls: set[Call] = set()
        self._sweeper: asyncio.Task | None = None

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def enter(self, caller: Caller | None = None) -> Call:
        """Admits a call (``caller`` names its client), or raises CallError(RESOURCE_EXHAUSTED)
        when the limit or the client's share is reached."""
        if self.max_calls and len(self._calls) >= self.max_calls:
            raise CallError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"this frontend is serving its limit of {self.max_calls} concurrent Generate calls "
                "(--max-concurrent-calls); retry later or on another frontend replica",
            )
        client = ""
        if self.fair_share.max_calls_per_client and caller is not None:
            client = client_of(caller.metadata, caller.peer, keyed=self._keyed)
            self.fair_share.enter(client)
        call = Call(asyncio.current_task(), client)
        self._calls.add(call)
        if self.stalled_timeout_s and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="stalled-client sweeper")
        return call

    def leave(self, call: Call) -> None:
        if call in self._calls and call.client:
            self.fair_share.leave(call.client)
        self._calls.discard(call)

    def pending_share(self, num_requests: int) -> int:
        """The unread output one of a call's ``num_requests`` requests may hold, in bytes (0: no bound)."""
        return self.max_pending_bytes // max(num_requests, 1)

    def describe(self) -> str:
        """One line for the start-up log."""
        return (
            f"at most {self.max_calls or 'any number of'} Generate calls, "
            f"{self.fair_share.max_calls_per_client or 'any number'} per client; a call's unread output paused "
            f"in the engine past {self.max_pending_bytes} bytes, a client that reads nothing ended after "
            f"{self.stalled_timeout_s:g} s"
        )

    def stalled_message(self) -> str:
        return (
            f"the client read none of its stream for {self.stalled_timeout_s:g} s while output waited "
            "(--stalled-client-timeout-s); the request was aborted. Read the stream as it arrives"
        )

    async def _sweep(self) -> None:
        period = min(1.0, self.stalled_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for call in list(self._calls):
                since = call.writing_since
                if since and now - since > self.stalled_timeout_s and not call.stalled and call.task is not None:
                    call.stalled = True
                    call.task.cancel()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
