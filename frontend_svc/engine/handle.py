"""The frontend's end of one engine request: outputs in from the stream, merged until read.

    EngineClient._on_response ── deliver(out) ──▶ RequestHandle ── take() / async for ──▶ servicer
    EngineClient._fail_all    ── fail(error) ───▶               (raises after pending outputs)

A handle never talks to the network itself: its client delivers to it and sends its abort.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from frontend_svc.engine.types import EngineOutput

if TYPE_CHECKING:
    from frontend_svc.engine.client import EngineClient


class RequestHandle:
    """The frontend's end of one engine request.

    Outputs that arrive before the consumer reads are merged into one (so a slow
    consumer gets one coalesced delta, not a growing queue). ``wakeup`` is set when the
    reader should look: on the first output, the last one, an error, and whenever
    ``stream_interval`` tokens are pending. With ``stream_interval`` 0 (adaptive, the
    default) every delivery asks for a wake-up, but the client sets the event only once it
    has read what the engine stream holds (``EngineClient.wake_soon``): a frontend that
    lags reads several engine messages before its calls write, so each write carries all
    the tokens that arrived meanwhile. Several handles may share one event so that a
    caller waits on all of them. Iterate (``async for``) only when the event is not shared.
    """

    def __init__(
        self, request_id: str, client: EngineClient, wakeup: asyncio.Event | None, stream_interval: int = 0
    ) -> None:
        self.request_id = request_id
        self.client = client
        self.wakeup = wakeup or asyncio.Event()
        self.finished = False  # the engine confirmed the end
        self.aborted = False  # abort sent; outputs are dropped from now on
        self.stream_interval = stream_interval
        self._pending: EngineOutput | None = None
        self._error: Exception | None = None
        self._done = False
        self._woken = False  # the reader has been woken at least once

    # -- the client's side -----------------------------------------------------------------

    def deliver(self, out: EngineOutput) -> None:
        """One output from the engine; a finished one confirms the end (also after an abort)."""
        if out.finished:
            self.finished = True
        if self.aborted:
            return
        if self._pending is None:
            self._pending = out
        else:
            self._pending.merge(out)
        pending = self._pending
        if (
            not self._woken
            or pending.finished
            or pending.error is not None
            or len(pending.new_token_ids) >= max(self.stream_interval, 1)
        ):
            self._woken = True
            if self.stream_interval:
                self.wakeup.set()
            else:
                self.client.wake_soon(self.wakeup)

    def fail(self, error: Exception) -> None:
        """The request is lost (its stream broke): ``take()`` raises ``error`` once the outputs
        still pending are taken."""
        self._error = error
        self.wakeup.set()

    # -- the reader's side -----------------------------------------------------------------

    def take(self) -> EngineOutput | None:
        """Everything delivered since the last call, merged; None if nothing; raises on failure
        (after the outputs delivered before it: the reader is woken again to see it)."""
        out, self._pending = self._pending, None
        if self._error is not None:
            if out is None:
                raise self._error
            self.wakeup.set()
        return out

    def abort(self, *, stop_string: bool = False) -> None:
        self.client.abort([self.request_id], stop_string=stop_string)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> EngineOutput:
        while not self._done:
            out = self.take()
            if out is not None:
                self._done = out.finished
                return out
            self.wakeup.clear()
            await self.wakeup.wait()
        raise StopAsyncIteration
