"""One engine's session: its channel and one long-lived bidi Stream that multiplexes requests by id.

Requests go out and outputs come back in plain values: convert.py turns them into and
out of the engine protocol, and each request's outputs land on its RequestHandle.

    EngineRouter (router.py) ── routes by load and prefix ──▶ EngineClient (one per address)
                                                         ├─ channel (keepalive, reconnect backoff)
    servicer ── add() ──▶ RequestHandle ◀── outputs ─────┤  Stream: Add/Abort in, steps out
             ── abort() ────────────────────────────────▶┘

A request's state lives in its client until the engine confirms the end (a finished
output, also sent for an abort), so outputs are always routed by a live id. Request ids
are uuid4 hex, never reused within a process. When a stream breaks, every request on it
fails at once with ``EngineUnavailableError``; the client reconnects with backoff.

A hung engine (stopped, or cut off without a TCP reset) is found two ways: HTTP/2
keepalive pings (KEEPALIVE_MS, answered by the engine's gRPC core), and a watchdog that
ends the session when nothing at all came from the engine for ``stall_timeout_s``: no
stream message and no answer to GetLoad, which the client asks for every second the
stream is quiet. An engine that answers but serves nothing (its step loop stuck) is found
by the progress watchdog (watchdog.py), which judges it against the other engines
(``peers``: their paces): its stuck requests move to other engines (aborted here, failed
so that their calls retry), or, past ``progress_timeout_s``, its session ends the same way
as a hung one's; either way, until it advances a request again it is sent one request at
a time (``suspect``), so other engines take the traffic. A session starts only after the
router accepted the engine's model (``accept``): same name, vocabulary and tokenizer files
as the first engine accepted.

With a PrefixIndex (prefix-aware routing), each session subscribes to the engine's
prefix-cache events as its first message and applies them to the index as they come,
before the outputs they arrive with; when the session ends the engine is dropped from the
index at once, and the next session starts again from the engine's snapshot.

The engine's LoRA adapters come with its model info; when its load reports a new
``lora_version`` (an adapter was loaded or unloaded) the client asks GetModelInfo again,
and routing sends a request under an adapter only to engines that serve it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import grpc

from frontend_svc.engine import convert
from frontend_svc.engine.channel import (
    BACKOFF_CAP_S,
    BACKOFF_INITIAL_S,
    RPC_TIMEOUT_S,
    drain,
    fetch_tokenizer_files,
    open_channel,
    tokenizer_digests,
)
from frontend_svc.engine.handle import RequestHandle
from frontend_svc.engine.inflight import InFlight
from frontend_svc.engine.model_view import EngineModelView
from frontend_svc.engine.prefix_index import PrefixIndex
from frontend_svc.engine.wakeups import Wakeups, read_stream
from frontend_svc.engine.watchdog import (
    DEFAULT_PROGRESS_FACTOR,
    DEFAULT_PROGRESS_FLOOR_S,
    Pace,
    ProgressWatchdog,
    Verdict,
    silence_verdict,
)
from frontend_svc.types import (
    EngineLoad,
    EngineUnavailableError,
    ModelIdentity,
    ModelInfo,
)
from tandem_common.block_hash import BLOCK_HASH_ALGORITHMS
from tandem_common.sampling import SamplingParams
from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

LOAD_POLL_S = 1.0  # GetLoad when the stream has been quiet this long (other frontends' load)
ABORT_CONFIRM_TIMEOUT_S = 30.0  # forget an aborted request the engine never confirmed
DEFAULT_STALL_TIMEOUT_S = 10.0  # nothing heard from the engine this long: it is hung
DEFAULT_PROGRESS_TIMEOUT_S = 30.0  # requests waiting this long while nothing advances: a black hole
REFUSED_RETRY_S = 30.0  # an engine refused for its model is asked again this often


class _EngineRefusedError(Exception):
    """The router does not accept the engine's model; the message says why."""


class EngineClient:
    """One engine: its channel, its Stream, its in-flight requests and its reported load."""

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S,
        progress_factor: float = DEFAULT_PROGRESS_FACTOR,
        progress_floor_s: float = DEFAULT_PROGRESS_FLOOR_S,
        peers: Callable[[EngineClient], list[Pace]] | None = None,
        accept: Callable[[EngineClient, ModelIdentity], str | None] | None = None,
        on_change: Callable[[], None] | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        self.address = address
        self.connected = False
        self.retiring = False  # vanished from DNS: no new requests, closed once idle
        self.refused: str | None = None  # why the router refuses this engine's model
        self.suspect = False  # the progress watchdog fired; cleared by its next output
        self.load = EngineLoad()
        self.model = EngineModelView(address, self._fetch_model_info, on_change)  # model info, adapters
        self._credentials = credentials
        self._tls_server_name = tls_server_name
        self._max_message_bytes = max_message_bytes
        self._stall_timeout_s = stall_timeout_s
        self._progress = ProgressWatchdog(progress_timeout_s, progress_factor, progress_floor_s)
        self._peers = peers or (lambda _client: [])  # the other engines' paces, to judge this one against (router.py)
        self._accept = accept
        self._on_change = on_change
        self._index = index
        self._inflight = InFlight(self._progress)
        self._requests = self._inflight.requests  # the same dict for the client's life
        # Readers to wake once the stream is read, in the order their outputs came (a dict
        # keeps it), so calls are written in the same order every step: no call's tokens
        # wait behind the others' one step and go first the next.
        self._wakeups = Wakeups()
        self._outbox: asyncio.Queue | None = None
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None
        self._last_load_s = 0.0
        self._last_heard_s = 0.0  # the last stream message or GetLoad answer
        self._hung: str | None = None  # set by the watchdog just before it ends the session
        self._closed = False
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None

    # -- routing figures -------------------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        return len(self._requests)

    @property
    def available(self) -> bool:
        ready = self.connected and not self.load.draining and not self.retiring and self.refused is None
        return ready and not (self.suspect and self._requests)  # a suspect engine: one request at a time

    @property
    def load_tokens(self) -> int:
        """Tokens queued and running on the engine, what routing balances.

        As the engine last reported them (on its stream, or by GetLoad when the stream is
        quiet): its waiting requests' tokens plus its KV blocks in use times the block size
        (the context of its running requests). Plus the prompt tokens of this frontend's
        requests sent to it that have not produced a token yet, so that a burst counts at
        once, before the engine reports it; until their first token such requests may be
        counted twice (also as waiting), which errs towards spreading a burst.
        """
        context_tokens = self.load.num_used_blocks * self.model.block_size
        return self.load.num_waiting_tokens + context_tokens + self._inflight.unstarted_tokens

    @property
    def predicts_prefix_hits(self) -> bool:
        """The index holds this engine's blocks: it hashes as this frontend does and subscribed."""
        info = self.model_info
        return self._index is not None and info is not None and info.block_hash_algorithm in BLOCK_HASH_ALGORITHMS

    def pace(self, now: float) -> Pace:
        """How this engine serves, for judging the others against it (watchdog.py)."""
        return self._progress.pace(now)

    @property
    def model_info(self) -> ModelInfo | None:
        return self.model.info

    @model_info.setter
    def model_info(self, info: ModelInfo | None) -> None:
        self.model.info = info

    def serves(self, lora_name: str | None) -> bool:
        return self.model.serves(lora_name)

    def lora_digest(self, lora_name: str | None) -> bytes | None:
        return self.model.lora_digest(lora_name)

    async def _fetch_model_info(self) -> ModelInfo | None:
        if self._stub is None or not self.connected:
            return None
        try:
            return convert.model_info(
                await self._stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
            )
        except grpc.aio.AioRpcError as e:
            logger.debug("engine %s: GetModelInfo failed: %s", self.address, e.code().name)
            return None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._channel = open_channel(self.address, self._credentials, self._tls_server_name, self._max_message_bytes)
        self._task = asyncio.create_task(self._run(), name=f"engine {self.address}")

    async def close(self, reason: str = "the frontend closed the connection") -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(reason)
        if self._index is not None:
            self._index.remove_engine(self.address)
        self._set_connected(False)
        if self._channel is not None:
            await self._channel.close()

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        reported = False  # why the engine is unreachable, said once at INFO: shows TLS or address mistakes
        while not self._closed:
            try:
                reason = await self._session()
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except _EngineRefusedError as e:
                self._set_refused(str(e))
                await asyncio.sleep(REFUSED_RETRY_S * random.uniform(0.8, 1.2))
                continue
            except Exception as e:  # noqa: BLE001 - any failure ends this session, never the loop
                logger.exception("engine %s: stream failed", self.address)
                reason = repr(e)
            if self.connected:
                logger.warning("engine %s went away: %s; reconnecting", self.address, reason)
                backoff = BACKOFF_INITIAL_S
                reported = False
            elif not reported:
                logger.info("engine %s not reachable: %s; retrying", self.address, reason)
                reported = True
            else:
                logger.debug("engine %s not reachable: %s", self.address, reason)
            self._set_connected(False)
            self._fail_all(f"engine {self.address} went away: {reason}")
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, BACKOFF_CAP_S)

    async def _session(self) -> str:
        stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
        model_info = convert.model_info(info)
        if self._accept is not None:
            identity = ModelIdentity(model_info.model_name, model_info.vocab_size, await tokenizer_digests(stub))
            problem = self._accept(self, identity)
            if problem is not None:
                raise _EngineRefusedError(problem)
        self._set_refused(None)
        self.model.start_session(model_info)
        self._stub = stub
        outbox: asyncio.Queue = asyncio.Queue()
        if self.predicts_prefix_hits:
            assert self._index is not None
            self._index.set_capacity(self.address, model_info.num_kv_blocks)
            outbox.put_nowait(convert.subscribe_kv_events())
        elif self._index is not None:
            logger.warning(
                "engine %s hashes prefix-cache blocks as %r, this frontend as %r: no prefix-aware routing to it",
                self.address,
                model_info.block_hash_algorithm or "(unnamed)",
                " or ".join(BLOCK_HASH_ALGORITHMS),
            )
        call = stub.Stream(drain(outbox))
        self._outbox = outbox
        self.load = EngineLoad()
        self._last_heard_s = time.monotonic()
        self._hung = None
        self._set_connected(True)
        logger.info(
            "engine %s connected: model %s, max_model_len %d",
            self.address,
            model_info.model_name,
            model_info.max_model_len,
        )
        watchdog = asyncio.create_task(self._watch(stub, call))
        try:
            await self._read(call)
        except asyncio.CancelledError:
            if self._hung is None:  # the client is closing, not the watchdog
                raise
        finally:
            self._wakeups.flush()
            self._outbox = None
            if self._index is not None:
                self._index.remove_engine(self.address)
            watchdog.cancel()
            call.cancel()
        return self._hung or "the engine ended the stream"

    async def _read(self, call) -> None:
        """Reads the stream to its end, waking the calls it fed (adaptive coalescing, wakeups.py)."""
        await read_stream(call, self._on_response, self._wakeups)

    def _wake(self, handle: RequestHandle) -> None:
        """Wakes ``handle``'s reader: at once with a fixed stream interval, else once the
        stream's messages that are already here are read (adaptive coalescing, wakeups.py)."""
        if handle.stream_interval:
            handle.wakeup.set()
        else:
            self._wakeups.soon(handle.wakeup)

    def wake_soon(self, wakeup: asyncio.Event) -> None:
        """Sets ``wakeup`` once the stream's messages that are already here are read."""
        self._wakeups.soon(wakeup)

    async def _watch(self, stub: engine_pb2_grpc.EngineServiceStub, call) -> None:
        """Polls the load while the stream is quiet, and ends the session when the engine
        answers nothing at all for ``stall_timeout_s``."""
        timeout = min(RPC_TIMEOUT_S, self._stall_timeout_s)
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            silent_s = time.monotonic() - self._last_heard_s
            verdict = self._progress.stalled(time.monotonic(), self._peers(self))
            if verdict is not None:
                self._suspect(verdict)
                if verdict.end_session:
                    self._hung = verdict.reason
                    call.cancel()
                    return
            hung = silence_verdict(silent_s, self._stall_timeout_s, len(self._requests))
            if hung is not None:
                self._hung = hung
                call.cancel()
                return
            if time.monotonic() - self._last_load_s < LOAD_POLL_S:
                continue
            try:
                response = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s: GetLoad failed: %s", self.address, e.code().name)
                continue
            self._last_heard_s = time.monotonic()
            self._set_load(response.load)

    def _suspect(self, verdict: Verdict) -> None:
        """Act on the progress watchdog's verdict: move its requests, send one request at a time."""
        if not self.suspect:
            self.suspect = True
            logger.warning(
                "engine %s: %s; it gets one request at a time until it advances one", self.address, verdict.reason
            )
        else:
            logger.info("engine %s: %s", self.address, verdict.reason)
        self._progress.moved(verdict.request_ids)
        error = EngineUnavailableError(f"engine {self.address}: {verdict.reason}")
        moving = [rid for rid in verdict.request_ids if (h := self._requests.get(rid)) is not None and not h.aborted]
        self.abort(moving)  # should the engine ever read it, it drops them
        self._inflight.fail(moving, error)

    def _set_refused(self, problem: str | None) -> None:
        if problem != self.refused:
            if problem is not None:
                logger.warning(
                    "engine %s refused: %s; asking again every %.0f s", self.address, problem, REFUSED_RETRY_S
                )
            elif self.refused is not None:
                logger.info("engine %s is accepted now", self.address)
            self.refused = problem
            if self._on_change is not None:
                self._on_change()

    def _set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            if self._on_change is not None:
                self._on_change()

    def _set_load(self, load: engine_pb2.EngineLoad) -> None:
        was_draining = self.load.draining
        previous, self.load = self.load, convert.engine_load(load)
        if self.load != previous:
            self._progress.progressed()
        self._last_load_s = time.monotonic()
        self.model.saw_lora_version(self.load.lora_version)
        if self.load.draining != was_draining:
            logger.info("engine %s %s", self.address, "is draining" if self.load.draining else "accepts requests again")
            if self._on_change is not None:
                self._on_change()

    def _on_response(self, response: engine_pb2.StreamResponse) -> None:
        self._last_heard_s = time.monotonic()
        if response.HasField("load"):
            self._set_load(response.load)
        for rejected in response.rejected:
            # Only a duplicate request id is rejected, and ids here are unique uuid4s: the
            # live request of that id goes on, so there is nothing to deliver.
            logger.warning(
                "engine %s rejected an add for %s: %s", self.address, rejected.request_id, rejected.error.message
            )
        if response.kv_events and self._index is not None:  # blocks first, then the outputs
            self._index.apply(self.address, convert.kv_events(response.kv_events))
        if response.outputs:
            self._progress.output(running=self._inflight.running)
            if self.suspect:
                self.suspect = False
                logger.info("engine %s advances requests again", self.address)
        outputs = [convert.engine_output(o) for o in response.outputs]
        to_pause = self._inflight.deliver(outputs, self._wake, self.address)
        if to_pause and self._outbox is not None:
            self._outbox.put_nowait(convert.pause_requests(to_pause))

    def _fail_all(self, reason: str) -> None:
        self._inflight.fail_all(reason)

    # -- requests -------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        trace_context: dict[str, str] | None = None,
        arrival_time: float | None = None,
        wakeup: asyncio.Event | None = None,
        stream_interval: int = 0,
        num_prefill_tokens: int | None = None,
        lora_name: str | None = None,
        max_pending_bytes: int = 0,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Queue a request on this engine's stream; outputs arrive on the returned handle,
        which wakes its reader once ``stream_interval`` tokens are pending (see RequestHandle).
        ``num_prefill_tokens`` (default: the prompt's length) counts in ``load_tokens``
        until the request's first output. Past ``max_pending_bytes`` of unread output (0: no
        bound) the request is paused in the engine until ``resume``."""
        if self._outbox is None or not self.connected:
            raise EngineUnavailableError(f"engine {self.address} is not connected")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id} is already in flight")
        message = convert.add_request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            trace_context=trace_context or {},
            lora_name=lora_name,
            cache_salt=cache_salt,
        )
        convert.check_size(message, self._max_message_bytes)
        handle = RequestHandle(request_id, wakeup, stream_interval, max_pending_bytes)
        prefill = len(prompt_token_ids) if num_prefill_tokens is None else num_prefill_tokens
        self._inflight.sent(handle, prefill, compiles=params.structured is not None)
        self._outbox.put_nowait(message)
        return handle

    def abort(self, request_ids: list[str], *, stop_string: bool = False) -> None:
        """Ask the engine to stop these requests; later outputs for them are dropped.
        ``stop_string``: they are complete (the engine counts them as stopped, not aborted).

        Their state stays until the engine confirms (or ABORT_CONFIRM_TIMEOUT_S passes),
        so they keep counting as outstanding work on this engine meanwhile.
        """
        ids = []
        for rid in request_ids:
            handle = self._requests.get(rid)
            if handle is not None and not handle.aborted:
                handle.aborted = True
                ids.append(rid)
                forget = self._inflight.forget
                asyncio.get_running_loop().call_later(ABORT_CONFIRM_TIMEOUT_S, forget, handle, self.address)
        if ids and self._outbox is not None:
            self._outbox.put_nowait(convert.abort_request(ids, stop_string=stop_string))

    def resume(self, handle: RequestHandle) -> None:
        """Lets a request paused for its unread output run again (its reader took the output)."""
        handle.paused = False
        if not (handle.finished or handle.aborted) and self._outbox is not None:
            self._outbox.put_nowait(convert.resume_requests([handle.request_id]))

    @property
    def stub(self) -> engine_pb2_grpc.EngineServiceStub | None:
        """The engine's RPCs while its session is up (None otherwise), for calls beside the stream."""
        return self._stub if self.connected else None

    async def fetch_tokenizer_files(self) -> dict[str, bytes]:
        """Download the tokenizer files and check each against its sha256 ({} if the engine has none)."""
        files = await fetch_tokenizer_files(engine_pb2_grpc.EngineServiceStub(self._channel))
        if files:
            logger.info("fetched tokenizer from engine %s: %s", self.address, ", ".join(sorted(files)))
        return files
