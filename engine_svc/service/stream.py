"""One open Stream call: its stream id in the engine loop, its backlog and the two events
that tie the engine thread, the reader and the writer together.

    engine thread ── sink / kv_sink ──▶ StreamBacklog ── wake ──▶ responses(): take, yield
    read_commands(): Add / Abort / Pause / Resume / SubscribeKvEvents ──▶ EngineLoop    ◀── taken ──┘

``sink`` and ``kv_sink`` run on the engine thread and never block: they append to the
backlog and wake the writer with ``call_soon_threadsafe``. The reader stops reading while
the backlog is beyond its read limit, so HTTP/2 flow control holds the client's writes
until the writer has taken some (``taken``). ``responses()`` ends once the engine says the
stream is complete (half-closed and its last request finished); it raises the reader's
failure (a malformed control message is ``MalformedCommand`` or protobuf's DecodeError),
and on any exit it stops the reader and closes the stream in the engine, which aborts
what is still live.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterable
from typing import TYPE_CHECKING

import grpc

from engine_svc.outputs import EngineOutput, EngineStats, RejectedAdd
from engine_svc.service import convert
from engine_svc.service.backlog import MAX_OUTPUTS_PER_MESSAGE, MESSAGE_OVERHEAD_BYTES, StreamBacklog
from engine_svc.service.engine_loop import EngineLoop
from tandem_common.kv_events import KvEvent

if TYPE_CHECKING:
    from tandem_protos.tandem.engine.v1.engine_pb2 import StreamResponse

logger = logging.getLogger(__name__)

# Request ids are echoed in every output; longer ones could not fit a bounded message.
MAX_REQUEST_ID_BYTES = 1024


class MalformedCommand(ValueError):
    """A control message that parses but breaks the protocol; ends the stream."""


class StreamSession:
    """Owns one stream's backlog, its events and its stream id; made inside the Stream call
    (it binds to the running event loop)."""

    def __init__(self, engine: EngineLoop, *, max_message_bytes: int, pause_bytes: int, max_hashes: int) -> None:
        self.engine = engine
        self.max_hashes = max_hashes
        self.backlog = StreamBacklog(
            max_message_bytes=max_message_bytes - MESSAGE_OVERHEAD_BYTES,  # the load figures take the rest
            max_outputs=MAX_OUTPUTS_PER_MESSAGE,
            pause_bytes=pause_bytes,
            max_hashes=max_hashes,
        )
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()  # the backlog has something, or the reader ended
        self._taken = asyncio.Event()  # the writer took from the backlog (the reader may go on)
        self.stream_id = engine.open_stream(self._sink)

    # -- the engine thread ---------------------------------------------------------------

    def _sink(self, items: list[EngineOutput | RejectedAdd] | None, stats: EngineStats) -> bool:
        """Queue, wake the writer; True asks the engine to pause the stream."""
        lagging = False
        if items is None:
            self.backlog.finish(stats)
        else:
            lagging = self.backlog.put(items, stats)
        self._notify()
        return lagging

    def _kv_sink(self, events: list[KvEvent], stats: EngineStats) -> None:
        """One batch of prefix-cache events (the stream subscribed)."""
        self.backlog.put_events(events, stats)
        self._notify()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the event loop closed (server shutdown): nobody reads
            pass

    # -- the event loop ------------------------------------------------------------------

    async def read_commands(self, request_iterator: AsyncIterable) -> None:
        """Hand the client's control messages to the engine; half-close the stream when
        the client ends its side."""
        engine, stream_id = self.engine, self.stream_id
        try:
            async for msg in request_iterator:
                action = msg.WhichOneof("action")
                if action == "add":
                    num_bytes = len(msg.add.request_id.encode())
                    if num_bytes > MAX_REQUEST_ID_BYTES:
                        raise MalformedCommand(f"request_id is {num_bytes} bytes; at most {MAX_REQUEST_ID_BYTES}")
                    engine.add(stream_id, convert.add_command(msg.add))
                elif action == "abort":
                    engine.abort(stream_id, list(msg.abort.request_ids), convert.abort_finish(msg.abort))
                elif action == "subscribe_kv_events":
                    engine.subscribe_kv_events(stream_id, self._kv_sink, self.max_hashes)
                elif action == "pause_requests":
                    engine.pause_requests(stream_id, list(msg.pause_requests.request_ids))
                elif action == "resume_requests":
                    engine.resume_requests(stream_id, list(msg.resume_requests.request_ids))
                # Far behind: stop reading, so HTTP/2 flow control holds the client's writes.
                while self.backlog.over_read_limit:
                    self._taken.clear()
                    await self._taken.wait()
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            engine.close_stream(stream_id)
            raise
        engine.half_close(stream_id)

    async def responses(self, request_iterator: AsyncIterable) -> AsyncGenerator[StreamResponse, None]:
        """The stream's StreamResponses, each one backlog take, until the stream is complete.

        Reads ``request_iterator`` meanwhile. Use it inside ``contextlib.aclosing`` so that
        a cancelled call closes the stream in the engine at once.
        """
        reader = asyncio.create_task(self.read_commands(request_iterator))
        # A malformed control message must end the call even when no step output is due.
        reader.add_done_callback(lambda _: self._wake.set())
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                _raise_failure(reader)
                while True:
                    batch = self.backlog.take()
                    if batch.resume:
                        self.engine.resume_stream(self.stream_id)
                    has_items = bool(batch.outputs or batch.rejected or batch.kv_events)
                    if has_items:
                        yield convert.batch_to_proto(batch)
                        self._taken.set()
                        _raise_failure(reader)
                    if batch.done:
                        return
                    if not has_items:
                        break
        finally:
            reader.cancel()
            self.engine.close_stream(self.stream_id)


def _raise_failure(reader: asyncio.Task) -> None:
    """Raise what ended ``reader``, if it failed."""
    if reader.done() and not reader.cancelled() and (error := reader.exception()) is not None:
        raise error
