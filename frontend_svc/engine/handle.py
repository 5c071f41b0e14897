"""The frontend's end of one engine request: outputs in from the stream, merged until read.

    EngineClient._on_response ── deliver(out) ──▶ RequestHandle ── take() / async for ──▶ servicer
                 ◀── True: "wake the reader" ──┘
    EngineClient._fail_all    ── fail(error) ───▶               (raises after pending outputs)

A handle knows nobody (as vLLM's RequestOutputCollector): its client delivers to it and
wakes its reader, and the reader asks the client, not the handle, to abort.

What waits unread is bounded in bytes: past ``max_pending_bytes`` the handle wants a
pause (``wants_pause``), which its client sends to the engine (the request stops and gives
back its KV blocks); the reader, once it took the output, asks the client to resume it.
So a reader that stops reading holds at most about its bound plus the steps already on
their way, and a slow but steady reader is only slowed to its own pace.

    deliver ── pending_bytes > max_pending_bytes ──▶ client.pause ──▶ engine: PauseRequests
    take    ── paused ──▶ client.resume ──▶ engine: ResumeRequests
"""

from __future__ import annotations

import asyncio

from frontend_svc.types import EngineOutput

# What pending output costs the frontend's memory, measured with tracemalloc on CPython
# 3.11: a token id 40 bytes (its list slot and int), a Logprob 224 bytes, each of its top
# entries 122 more (a tuple of an int and a float). n = 16 x 2,000 tokens with 20 top
# logprobs is 85 MiB by this count, as measured.
TOKEN_BYTES = 40
LOGPROB_BYTES = 224
TOP_LOGPROB_BYTES = 122


def held_bytes(out: EngineOutput) -> int:
    """What ``out`` holds in the frontend's memory, about."""
    size = TOKEN_BYTES * len(out.new_token_ids)
    for lps in (out.logprobs, out.prompt_logprobs):
        if lps:
            size += LOGPROB_BYTES * len(lps) + TOP_LOGPROB_BYTES * sum(len(lp.top) for lp in lps)
    return size


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

    def __init__(
        self,
        request_id: str,
        wakeup: asyncio.Event | None = None,
        stream_interval: int = 0,
        max_pending_bytes: int = 0,
    ) -> None:
        self.request_id = request_id
        self.wakeup = wakeup or asyncio.Event()
        self.finished = False  # the engine confirmed the end
        self.aborted = False  # abort sent; outputs are dropped from now on
        self.stream_interval = stream_interval
        self.max_pending_bytes = max_pending_bytes  # 0: no bound
        self.pending_bytes = 0  # held_bytes of the pending output
        self.paused = False  # the engine was asked to hold the request back until its output is taken
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
        if self.max_pending_bytes:
            self.pending_bytes += held_bytes(out)
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

    @property
    def wants_pause(self) -> bool:
        """More output waits unread than the bound, and the request still runs unpaused."""
        return (
            self.max_pending_bytes > 0
            and self.pending_bytes > self.max_pending_bytes
            and not (self.paused or self.finished or self.aborted)
        )

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
        self.pending_bytes = 0
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
