"""Runs EngineCore on its own thread, apart from the gRPC event loop.

    any thread ── commands (OpenStream, Add, Abort, ...) ──▶ engine thread
                                                             apply commands, step once,
    stream sinks ◀── (outputs, EngineStats) per turn ──────  publish an EngineStats snapshot

Streams talk to it through a queue of small frozen commands (``commands.py``); it hands each stream's
outputs back through the stream's ``sink`` callback, once per turn. A sink must not
block: a stream session's sink only appends to its stream's bounded backlog, so a slow or
stalled reader on one stream never stalls the engine or the other streams. A sink that
returns True says its reader lags too far behind: the engine pauses that stream's
requests (``Scheduler.pause_requests``) until the stream asks to resume. A stream's
client may also pause single requests (``PauseRequests``: its own caller does not read
their output); a request runs only while neither pause holds it. Streams that
subscribed get the turn's prefix-cache events through their ``kv_sink`` before their
outputs (a snapshot when they subscribe; recorded only while some stream is subscribed).
Other threads read the engine's state only from ``stats``, the snapshot published after
every turn.

Request ids are unique per stream, not per engine: inside the engine a request gets an
engine-wide id, and ``_owners`` maps it back to (stream, client request id).

All of the engine's torch work should run on that one thread, building the model
included (``start(build)``). On CPU, libgomp (torch's OpenMP runtime) keeps a pool of
worker threads for every thread that starts parallel work; once the pools hold more
threads than there are cores, their workers stop spin-waiting between parallel regions
and every region pays a futex wake-up. A model built on one thread and stepped on
another measured 15-20% lower throughput with a quarter of the CPU time idle.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine_svc.core import EngineCore
from engine_svc.model.lora import LoraAdapter
from engine_svc.outputs import EngineOutput, EngineStats, LoraAdapterInfo, RejectedAdd
from engine_svc.sched.kv_events import snapshot_events, split_events
from engine_svc.service.commands import (
    Abort,
    Add,
    AddCommand,
    CloseStream,
    Command,
    FailAll,
    HalfClose,
    HalfCloseAll,
    KvSink,
    LoadLora,
    OpenStream,
    PauseRequests,
    ResumeRequests,
    ResumeStream,
    Sink,
    StartDraining,
    SubscribeKvEvents,
    UnloadLora,
)
from engine_svc.service.lifecycle import RequestEvents, RequestListener
from engine_svc.service.loop_faults import end_streams, failed_add
from engine_svc.types import ErrorCode, FinishReason, RequestError
from tandem_common.kv_events import KvEvent
from tandem_common.logs import printable

__all__ = ["AddCommand", "EngineLoop", "KvSink", "Sink"]

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    sink: Sink
    live: dict[str, str] = field(default_factory=dict)  # client request id -> engine request id, until finished
    half_closed: bool = False
    paused: bool = False  # its sink asked for a pause: its requests (and new adds) are held back
    held: set[str] = field(default_factory=set)  # client request ids its client paused (PauseRequests)
    kv_sink: KvSink | None = None
    kv_max_hashes: int = 0


class EngineLoop:
    def __init__(self, core: EngineCore | None = None) -> None:
        self.core = core  # None until start(build) has built it
        self.stats = EngineStats()  # replaced, never changed, by the engine thread
        # Called on the engine thread after every turn with the new snapshot and the
        # outputs of the step it ran (empty if none): metrics.
        self.on_stats: Callable[[EngineStats, list[EngineOutput]], None] | None = None
        self.events: RequestEvents | None = None  # request lifecycle; None while nobody listens
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._num_adds_applying = 0  # adds taken off the queue, not yet in ``stats``
        self._stream_ids = itertools.count()
        self._engine_ids = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self._owners: dict[str, tuple[int, str]] = {}  # engine request id -> (stream, client id)
        self._rejected: list[tuple[int, RejectedAdd]] = []  # this turn's refused duplicate adds
        self._running = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # why the engine thread died; None while it runs
        # Called on the dying engine thread with that fault (the server turns NOT_SERVING).
        self.on_failure: Callable[[BaseException], None] | None = None

    def add_listener(self, listener: RequestListener) -> None:
        """Send request lifecycle events to ``listener`` (tracing, metrics). Call before requests arrive."""
        if self.events is None:
            self.events = RequestEvents()
            if self.core is not None:
                self.core.set_observer(self.events)
        self.events.listeners.append(listener)

    # -- called from any thread ---------------------------------------------------------

    def start(self, build: Callable[[], EngineCore] | None = None) -> None:
        """Start the engine thread. ``build`` (for a loop made without a core) runs on that
        thread first; start() returns once it has, and raises what it raised."""
        if (build is None) == (self.core is None):
            raise ValueError("give a core to the constructor or a build function to start(), not both")
        built = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            if build is not None:
                try:
                    self.core = build()
                    if self.events is not None:
                        self.core.set_observer(self.events)
                    self.stats = self.core.make_stats()
                except BaseException as e:  # noqa: BLE001 - handed to the caller of start()
                    failure.append(e)
                    return
                finally:
                    built.set()
            try:
                self._run()
            except BaseException as e:  # noqa: BLE001 - reported to every stream, then the thread ends
                self._die(e)

        self._running = True
        self._thread = threading.Thread(target=main, name="engine-loop", daemon=True)
        self._thread.start()
        if build is not None:
            built.wait()
        if failure:
            self._running = False
            raise failure[0]

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.core is not None:
            self.core.structured.shutdown()

    def open_stream(self, sink: Sink) -> int:
        stream_id = next(self._stream_ids)
        self._push(OpenStream(stream_id, sink))
        return stream_id

    def add(self, stream_id: int, command: AddCommand) -> None:
        self._push(Add(stream_id, command))

    def abort(self, stream_id: int, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        self._push(Abort(stream_id, tuple(request_ids), reason))

    def resume_stream(self, stream_id: int) -> None:
        """Let a paused stream's requests run again (a no-op if it is not paused)."""
        self._push(ResumeStream(stream_id))

    def pause_requests(self, stream_id: int, request_ids: list[str]) -> None:
        self._push(PauseRequests(stream_id, tuple(request_ids)))

    def resume_requests(self, stream_id: int, request_ids: list[str]) -> None:
        self._push(ResumeRequests(stream_id, tuple(request_ids)))

    def half_close(self, stream_id: int) -> None:
        self._push(HalfClose(stream_id))

    def half_close_all(self) -> None:
        self._push(HalfCloseAll())

    def close_stream(self, stream_id: int) -> None:
        self._push(CloseStream(stream_id))

    def subscribe_kv_events(self, stream_id: int, sink: KvSink, max_hashes: int) -> None:
        self._push(SubscribeKvEvents(stream_id, sink, max_hashes))

    def start_draining(self) -> None:
        self._push(StartDraining())

    def fail_all(self, error: RequestError) -> None:
        self._push(FailAll(error))

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """Read and check a LoRA adapter directory, on the caller's thread (disk and hashing
        stay off the engine thread); raises ``LoraRefusedError``."""
        assert self.core is not None
        return self.core.read_lora(name, path)

    def load_lora(self, adapter: LoraAdapter) -> Future[LoraAdapterInfo]:
        """Serve ``adapter`` from the next turn; the future says how it went."""
        reply: Future[LoraAdapterInfo] = Future()
        self._push(LoadLora(adapter, reply))
        return reply

    def unload_lora(self, name: str) -> Future[str]:
        reply: Future[str] = Future()
        self._push(UnloadLora(name, reply))
        return reply

    def num_unfinished(self) -> int:
        """Requests added that have not finished, queued commands included."""
        with self._cond:
            queued = sum(isinstance(c, Add) for c in self._commands)
            return queued + self._num_adds_applying + self.stats.num_unfinished

    def _push(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------------------

    def _wake(self) -> None:
        """Called from a grammar-compile thread: a waiting request may be ready."""
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        assert self.core is not None
        core = self.core
        core.set_on_grammar_ready(self._wake)
        while True:
            with self._cond:
                # Requests whose grammar compiles are not work yet: sleep until a compile
                # wakes us (``_wake``) or the first of them times out.
                while self._running and not self._commands and not core.has_work():
                    self._cond.wait(core.seconds_to_next_event())
                if not self._running:
                    return
                commands, self._commands = self._commands, []
                self._num_adds_applying = sum(isinstance(c, Add) for c in commands)
            outputs: list[EngineOutput] = []
            for command in commands:
                outputs.extend(self._apply_alone(command))
            step_outputs: list[EngineOutput] = []
            if core.has_work():
                try:
                    step_outputs = core.step()
                except Exception:  # a model fault must not leave requests hanging forever
                    logger.exception("engine step failed; failing the running requests")
                    error = RequestError(ErrorCode.INTERNAL, "engine step failed; see the engine log")
                    step_outputs = core.fail(list(self._owners), error)
                outputs.extend(step_outputs)
                if self.events is not None:
                    self.events.after_step()
            stats = self._publish_stats(step_outputs)
            if core.kv_events_enabled:  # before the outputs: blocks first, then who made them
                self._publish_kv_events(core.take_kv_events(), stats)
            if (outputs or self._rejected) and self._dispatch(outputs, stats):
                self._publish_stats([])  # a stream was paused: its requests moved

    def _publish_stats(self, step_outputs: list[EngineOutput]) -> EngineStats:
        """A fresh snapshot for other threads and ``on_stats``: after every turn, whatever it did."""
        assert self.core is not None
        stats = self.core.make_stats()
        with self._cond:
            self.stats = stats
            self._num_adds_applying = 0
        if self.on_stats is not None:
            self.on_stats(stats, step_outputs)
        return stats

    def _apply_alone(self, command: Command) -> list[EngineOutput]:
        """Apply one command; a fault fails its request alone, never the loop (``loop_faults.py``)."""
        try:
            return self._apply(command)
        except Exception:
            logger.exception("applying %s failed", type(command).__name__)
            if isinstance(command, Add) and (stream := self._streams.get(command.stream_id)) is not None:
                self._forget_failed_add(command.stream_id, stream, command.command.request_id)
            return []

    def _forget_failed_add(self, stream_id: int, stream: _Stream, request_id: str) -> None:
        """Undo what a failed add left behind; its client gets a refused add."""
        engine_id = stream.live.pop(request_id, None)
        if engine_id is not None and self._owners.pop(engine_id, None) is not None and self.core is not None:
            self.core.abort([engine_id])
        self._rejected.append((stream_id, failed_add(request_id)))

    def _die(self, error: BaseException) -> None:
        logger.critical("the engine loop died; the engine can serve nothing more", exc_info=error)
        self.failure, self._running = error, False
        if self.on_failure is not None:  # health first, so nothing routes here while streams end
            self.on_failure(error)
        end_streams([stream.sink for stream in self._streams.values()], self.stats)

    def _apply(self, command: Command) -> list[EngineOutput]:
        core = self.core
        assert core is not None
        match command:
            case OpenStream(stream_id, sink):
                self._streams[stream_id] = _Stream(sink)
            case StartDraining():
                core.draining = True
            case FailAll(error):
                return core.fail(list(self._owners), error)
            case Add(stream_id, cmd) if (stream := self._streams.get(stream_id)) is not None:
                return self._add(stream_id, stream, cmd)
            case Abort(stream_id, request_ids, reason) if (stream := self._streams.get(stream_id)) is not None:
                return core.abort([stream.live[r] for r in request_ids if r in stream.live], reason)
            case ResumeStream(stream_id) if (stream := self._streams.get(stream_id)) is not None and stream.paused:
                stream.paused = False
                core.resume(e for r, e in stream.live.items() if r not in stream.held)
                logger.info("stream %d caught up: %d requests resume", stream_id, len(stream.live) - len(stream.held))
            case PauseRequests(stream_id, request_ids) if (stream := self._streams.get(stream_id)) is not None:
                ids = [r for r in request_ids if r in stream.live and r not in stream.held]
                stream.held.update(ids)
                core.pause(stream.live[r] for r in ids)
            case ResumeRequests(stream_id, request_ids) if (stream := self._streams.get(stream_id)) is not None:
                ids = [r for r in request_ids if r in stream.held]
                stream.held.difference_update(ids)
                if not stream.paused:
                    core.resume(stream.live[r] for r in ids)
            case HalfClose(stream_id) if (stream := self._streams.get(stream_id)) is not None:
                self._half_close(stream)
            case HalfCloseAll():
                for stream in self._streams.values():
                    self._half_close(stream)
            case SubscribeKvEvents(stream_id, sink, max_hashes) if (stream := self._streams.get(stream_id)) is not None:
                core.enable_kv_events()
                stream.kv_sink, stream.kv_max_hashes = sink, max_hashes
                for batch in snapshot_events(core.cached_hashes(), max_hashes):
                    sink(batch, self.stats)
            case LoadLora(adapter, reply):
                _settle(reply, lambda: self._published(core.load_lora(adapter)))
            case UnloadLora(name, reply):
                _settle(reply, lambda: self._published(core.unload_lora(name)))
            case CloseStream(stream_id) if (stream := self._streams.pop(stream_id, None)) is not None:
                if stream.kv_sink is not None and not any(s.kv_sink for s in self._streams.values()):
                    core.disable_kv_events()  # nobody listens: record nothing
                aborted = core.abort(list(stream.live.values()))
                for out in aborted:
                    self._owners.pop(out.request_id, None)
                    if self.events is not None:
                        self.events.finished(out)
        return []

    def _published(self, result: object) -> object:
        """``result`` once ``stats`` shows the change (the adapters a client sees next)."""
        self._publish_stats([])
        return result

    def _half_close(self, stream: _Stream) -> None:
        """No more commands count for ``stream``; it ends now if nothing is live, else
        after the last live request's final output (``_dispatch``)."""
        if not stream.half_closed:
            stream.half_closed = True
            if not stream.live:
                stream.sink(None, self.stats)

    def _add(self, stream_id: int, stream: _Stream, cmd: AddCommand) -> list[EngineOutput]:
        core = self.core
        assert core is not None
        if cmd.request_id in stream.live:
            # Refused without becoming a request, so the live request of that id still
            # finishes exactly once.
            error = RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"request_id '{printable(cmd.request_id)}' is already in flight on this stream; use a unique id",
                "request_id",
            )
            self._rejected.append((stream_id, RejectedAdd(cmd.request_id, error)))
            return []
        engine_id = f"{stream_id}/{next(self._engine_ids)}"
        request = core.make_request(
            engine_id,
            cmd.prompt_token_ids,
            cmd.sampling_params,
            priority=cmd.priority,
            arrival_time=cmd.arrival_time or time.time(),
            trace_context=cmd.trace_context,
            client_request_id=cmd.request_id,
            lora_name=cmd.lora_name,
            cache_salt=cmd.cache_salt,
            stream_id=stream_id,
        )
        stream.live[cmd.request_id] = engine_id
        self._owners[engine_id] = (stream_id, cmd.request_id)
        if self.events is not None:
            self.events.queued(request)
        error_output = core.add_request(request)
        if error_output is not None:
            return [error_output]
        if stream.paused:
            core.pause([engine_id])
        return []

    def _publish_kv_events(self, events: list[KvEvent], stats: EngineStats) -> None:
        if not events:
            return
        for stream in self._streams.values():
            if stream.kv_sink is not None:
                for batch in split_events(events, stream.kv_max_hashes):
                    stream.kv_sink(batch, stats)

    def _dispatch(self, outputs: list[EngineOutput], stats: EngineStats) -> bool:
        """Hand each stream its outputs; True if a stream was paused meanwhile."""
        paused = False
        by_stream: dict[int, list[EngineOutput | RejectedAdd]] = defaultdict(list)
        for stream_id, rejected in self._rejected:
            by_stream[stream_id].append(rejected)
        self._rejected.clear()
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:  # its stream closed meanwhile
                continue
            stream_id, client_id = owner
            stream = self._streams.get(stream_id)
            if out.finished:
                del self._owners[out.request_id]
                if self.events is not None:
                    self.events.finished(out)  # still keyed by the engine request id
                if stream is not None:
                    stream.live.pop(client_id, None)
                    stream.held.discard(client_id)
            if stream is None:
                continue
            out.request_id = client_id
            by_stream[stream_id].append(out)
        for stream_id, items in by_stream.items():
            stream = self._streams.get(stream_id)
            if stream is None:  # closed in this turn, after it sent a duplicate add
                continue
            if stream.sink(items, stats) is True and not stream.paused:
                self._pause(stream_id, stream)
                paused = True
            if stream.half_closed and not stream.live:
                stream.sink(None, stats)
        return paused

    def _pause(self, stream_id: int, stream: _Stream) -> None:
        """Hold the stream's requests back: its reader lags beyond its bound."""
        assert self.core is not None
        stream.paused = True
        self.core.pause(stream.live.values())
        logger.warning(
            "stream %d: its reader fell behind; %d requests paused until it catches up", stream_id, len(stream.live)
        )


def _settle(reply: Future, work: Callable[[], object]) -> None:
    """Run a command's work and hand its result, or the exception it raised, to the asker."""
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - the asker gets it; the loop goes on
        reply.set_exception(e)
    else:
        reply.set_result(result)
