"""The frontend's end of one engine request: outputs in from the stream, merged until read.

    EngineClient._on_response ── deliver(out) ──▶ RequestHandle ── take() / async for ──▶ servicer
                 ◀── True: "wake the reader" ──┘
    EngineClient._fail_all    ── fail(error) ───▶               (raises after pending outputs)

A handle knows nobody (as vLLM's RequestOutputCollector): its client delivers to it and
wakes its reader, and the reader asks the client, not the handle, to abort.
"""

from __future__ import annotations

import asyncio

from frontend_svc.types import EngineOutput


class RequestHandle:
    """The frontend's end of one engine request.

    Outputs that arrive before the consumer reads are merged into one (so a slow
    consumer gets one coalesced delta, not a growing queue). ``deliver`` answers True when
    the reader should look: on the first output, the last one, an error, and whenever
    ``stream_interval`` tokens are pending; the deliverer then sets ``wakeup``, at once
    with a fixed ``stream_interval``, or with 0 (adaptive, the default) once it has read
    what the engine stream holds (``EngineClient.wake_soon``, wakeups.py): a frontend that lags reads
    several engine messages before its calls write, so each write carries all the tokens
    that arrived meanwhile. ``fail`` sets it at once. Several handles may share one event
    so that a caller waits on all of them. Iterate (``async for``) only when the event is
    not shared.
    """

    def __init__(self, request_id: str, wakeup: asyncio.Event | None = None, stream_interval: int = 0) -> None:
        self.request_id = request_id
        self.wakeup = wakeup or asyncio.Event()
        self.finished = False  # the engine confirmed the end
        self.aborted = False  # abort sent; outputs are dropped from now on
        self.stream_interval = stream_interval
        self._pending: EngineOutput | None = None
        self._error: Exception | None = None
        self._done = False
        self._woken = False  # the reader has been woken at least once

    # -- the client's side -----------------------------------------------------------------

    def deliver(self, out: EngineOutput) -> bool:
        """One output from the engine; a finished one confirms the end (also after an abort).
        True when the reader should be woken (the caller sets ``wakeup``)."""
        if out.finished:
            self.finished = True
        if self.aborted:
            return False
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
            return True
        return False

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
