"""Streams to engines: one long-lived bidi Stream per engine, multiplexing requests by id.

This is the only frontend module that knows the engine protocol's protobuf types; it
hands plain dataclasses (``EngineOutput``, ``ModelInfo``, ``EngineLoad``) to the rest.

    EngineRouter ── picks by least outstanding work ──▶ EngineClient (one per address)
                                                         ├─ channel (keepalive, reconnect backoff)
    servicer ── add() ──▶ RequestHandle ◀── outputs ─────┤  Stream: Add/Abort in, steps out
             ── abort() ────────────────────────────────▶┘

A request's state lives in its client until the engine confirms the end (a finished
output, also sent for an abort), so outputs are always routed by a live id. Request ids
are uuid4 hex, never reused within a process. When a stream breaks, every request on it
fails at once with ``EngineUnavailableError``; the client reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

KEEPALIVE_MS = 10_000
BACKOFF_INITIAL_S = 0.05
BACKOFF_CAP_S = 2.0
RPC_TIMEOUT_S = 10.0
LOAD_POLL_S = 1.0  # GetLoad when the stream has been quiet this long (other frontends' load)
ABORT_CONFIRM_TIMEOUT_S = 30.0  # forget an aborted request the engine never confirmed


# -- plain types handed past this module ----------------------------------------------------


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or (frontend side) a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # see EngineOutput.error


class ErrorCode(enum.Enum):
    """In-band error classes; each maps onto the gRPC status of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class EngineError:
    code: ErrorCode
    message: str
    field: str = ""


class EngineUnavailableError(Exception):
    """No engine can take the request, or the one serving it went away; safe to retry."""


@dataclass
class SamplingParams:
    """Token-level controls sent to the engine; defaults are the neutral values."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class EngineOutput:
    """What one request produced in one or more engine steps (merged while unread)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: EngineError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "EngineOutput") -> None:
        self.new_token_ids.extend(later.new_token_ids)
        self.logprobs.extend(later.logprobs)
        self.prompt_logprobs.extend(later.prompt_logprobs)
        self.num_prompt_tokens = max(self.num_prompt_tokens, later.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        if later.finished:
            self.finish_reason, self.stop_token_id, self.error = later.finish_reason, later.stop_token_id, later.error


@dataclass
class EngineLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_used_blocks: int = 0
    draining: bool = False


@dataclass
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architecture: str = ""
    device: str = ""


_FINISH = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    engine_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}
_ERROR = {
    engine_pb2.ERROR_CODE_INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    engine_pb2.ERROR_CODE_UNAVAILABLE: ErrorCode.UNAVAILABLE,
}


class RequestHandle:
    """The frontend's end of one engine request.

    Outputs that arrive before the consumer reads are merged into one (so a slow
    consumer gets one coalesced delta, not a growing queue). ``wakeup`` is set on every
    delivery; several handles may share one event so that a caller waits on all of them.
    Iterate (``async for``) only when the event is not shared.
    """

    def __init__(self, request_id: str, client: "EngineClient", wakeup: asyncio.Event | None) -> None:
        self.request_id = request_id
        self.client = client
        self.wakeup = wakeup or asyncio.Event()
        self.finished = False  # the engine confirmed the end
        self.aborted = False  # abort sent; outputs are dropped from now on
        self._pending: EngineOutput | None = None
        self._error: Exception | None = None
        self._done = False

    def _deliver(self, out: EngineOutput) -> None:
        if self.aborted:
            return
        if self._pending is None:
            self._pending = out
        else:
            self._pending.merge(out)
        self.wakeup.set()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self.wakeup.set()

    def take(self) -> EngineOutput | None:
        """Everything delivered since the last call, merged; None if nothing; raises on failure."""
        out, self._pending = self._pending, None
        if out is None and self._error is not None:
            raise self._error
        return out

    def abort(self) -> None:
        self.client.abort([self.request_id])

    def __aiter__(self) -> "RequestHandle":
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


class EngineClient:
    """One engine: its channel, its Stream, its in-flight requests and its reported load."""

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self.connected = False
        self.retiring = False  # vanished from DNS: no new requests, closed once idle
        self.load = EngineLoad()
        self.model_info: ModelInfo | None = None
        self._credentials = credentials
        self._tls_server_name = tls_server_name
        self._max_message_bytes = max_message_bytes
        self._on_change = on_change
        self._requests: dict[str, RequestHandle] = {}
        self._outbox: asyncio.Queue | None = None
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None
        self._last_load_s = 0.0
        self._closed = False

    # -- routing figures -------------------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        return len(self._requests)

    @property
    def available(self) -> bool:
        return self.connected and not self.load.draining and not self.retiring

    @property
    def outstanding_work(self) -> int:
        return self.num_outstanding + self.load.num_waiting + self.load.num_running

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        options = [
            ("grpc.max_send_message_length", self._max_message_bytes),
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000) or 1),
            ("grpc.min_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000) or 1),
            ("grpc.max_reconnect_backoff_ms", int(BACKOFF_CAP_S * 1000)),
        ]
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=options)
        else:
            if self._tls_server_name:
                options.append(("grpc.ssl_target_name_override", self._tls_server_name))
            self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=options)
        self._task = asyncio.create_task(self._run(), name=f"engine {self.address}")

    async def close(self, reason: str = "the frontend closed the connection") -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(reason)
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
        self.model_info = _model_info(info)
        outbox: asyncio.Queue = asyncio.Queue()
        call = stub.Stream(_drain(outbox))
        self._outbox = outbox
        self.load = EngineLoad()
        self._set_connected(True)
        logger.info("engine %s connected: model %s, max_model_len %d",
                    self.address, self.model_info.model_name, self.model_info.max_model_len)
        poller = asyncio.create_task(self._poll_load(stub))
        try:
            async for response in call:
                self._on_response(response)
        finally:
            self._outbox = None
            poller.cancel()
            call.cancel()
        return "the engine ended the stream"

    async def _poll_load(self, stub: engine_pb2_grpc.EngineServiceStub) -> None:
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            if time.monotonic() - self._last_load_s < LOAD_POLL_S:
                continue
            try:
                response = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s: GetLoad failed: %s", self.address, e.code().name)
                continue
            self._set_load(response.load)

    def _set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            if self._on_change is not None:
                self._on_change()

    def _set_load(self, load: engine_pb2.EngineLoad) -> None:
        was_draining = self.load.draining
        self.load = _engine_load(load)
        self._last_load_s = time.monotonic()
        if self.load.draining != was_draining:
            logger.info("engine %s %s", self.address, "is draining" if self.load.draining else "accepts requests again")
            if self._on_change is not None:
                self._on_change()

    def _on_response(self, response: engine_pb2.StreamResponse) -> None:
        if response.HasField("load"):
            self._set_load(response.load)
        for o in response.outputs:
            handle = self._requests.get(o.request_id)
            if handle is None:
                logger.debug("engine %s: output for unknown request %s dropped", self.address, o.request_id)
                continue
            out = _engine_output(o)
            if out.finished:
                del self._requests[o.request_id]
                handle.finished = True
            handle._deliver(out)

    def _fail_all(self, reason: str) -> None:
        requests, self._requests = self._requests, {}
        for handle in requests.values():
            handle._fail(EngineUnavailableError(reason))

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
    ) -> RequestHandle:
        """Queue a request on this engine's stream; outputs arrive on the returned handle."""
        if self._outbox is None or not self.connected:
            raise EngineUnavailableError(f"engine {self.address} is not connected")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id} is already in flight")
        handle = RequestHandle(request_id, self, wakeup)
        self._requests[request_id] = handle
        add = engine_pb2.Add(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=_sampling_params(params),
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            trace_context=trace_context or {},
        )
        self._outbox.put_nowait(engine_pb2.StreamRequest(add=add))
        return handle

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine to stop these requests; later outputs for them are dropped.

        Their state stays until the engine confirms (or ABORT_CONFIRM_TIMEOUT_S passes),
        so they keep counting as outstanding work on this engine meanwhile.
        """
        ids = []
        for rid in request_ids:
            handle = self._requests.get(rid)
            if handle is not None and not handle.aborted:
                handle.aborted = True
                ids.append(rid)
                asyncio.get_running_loop().call_later(ABORT_CONFIRM_TIMEOUT_S, self._forget, handle)
        if ids and self._outbox is not None:
            self._outbox.put_nowait(engine_pb2.StreamRequest(abort=engine_pb2.Abort(request_ids=ids)))

    def _forget(self, handle: RequestHandle) -> None:
        if self._requests.get(handle.request_id) is handle:
            logger.warning("engine %s never confirmed the abort of %s", self.address, handle.request_id)
            del self._requests[handle.request_id]

    async def fetch_tokenizer_files(self) -> dict[str, bytes]:
        """Download the tokenizer files and check each against its sha256."""
        stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        files: dict[str, bytearray] = {}
        digests: dict[str, tuple[int, str]] = {}
        async for chunk in stub.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=120):
            buf = files.setdefault(chunk.file_name, bytearray())
            if chunk.offset != len(buf):
                raise ValueError(f"{chunk.file_name}: chunk at offset {chunk.offset}, expected {len(buf)}")
            buf.extend(chunk.data)
            digests[chunk.file_name] = (chunk.total_size, chunk.sha256)
        for name, buf in files.items():
            size, digest = digests[name]
            if len(buf) != size:
                raise ValueError(f"{name}: got {len(buf)} bytes, the engine announced {size}")
            actual = hashlib.sha256(buf).hexdigest()
            if actual != digest.lower():
                raise ValueError(f"{name}: sha256 {actual} does not match the engine's {digest}")
        logger.info("fetched tokenizer from engine %s: %s", self.address, ", ".join(sorted(files)))
        return {name: bytes(buf) for name, buf in files.items()}


class EngineRouter:
    """All engines this frontend knows: a static list plus DNS names re-resolved periodically.

    ``pick()`` returns the available engine (connected, not draining, not retiring) with
    the least outstanding work: this frontend's in-flight requests on it plus the
    engine's reported running and waiting requests. Ties are broken at random.
    """

    def __init__(
        self,
        targets: list[str],
        *,
        dns_refresh_s: float = 10.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self._static = [t for t in targets if not t.startswith("dns:")]
        self._dns = [parse_dns_target(t) for t in targets if t.startswith("dns:")]
        self._dns_refresh_s = dns_refresh_s
        self._credentials = credentials
        self._max_message_bytes = max_message_bytes
        self._clients: dict[str, EngineClient] = {}
        self._resolved: dict[tuple[str, int], set[str]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._connected = asyncio.Event()
        self._refresh_task: asyncio.Task | None = None
        self._retire_tasks: set[asyncio.Task] = set()

    @property
    def clients(self) -> list[EngineClient]:
        return list(self._clients.values())

    @property
    def healthy(self) -> bool:
        return any(c.connected for c in self._clients.values())

    @property
    def num_connected(self) -> int:
        return sum(c.connected for c in self._clients.values())

    @property
    def model_info(self) -> ModelInfo | None:
        return next((c.model_info for c in self._clients.values() if c.connected and c.model_info), None)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever an engine connects, disconnects or starts/stops draining."""
        self._listeners.append(callback)

    async def start(self) -> None:
        for address in self._static:
            self._add_client(address, None)
        if self._dns:
            await self.refresh()
            self._refresh_task = asyncio.create_task(self._refresh_loop(), name="engine dns refresh")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        for task in self._retire_tasks:
            task.cancel()
        await asyncio.gather(*(c.close() for c in self._clients.values()), return_exceptions=True)
        self._clients.clear()

    async def wait_connected(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout)

    def pick(self, exclude: Sequence[EngineClient] = ()) -> EngineClient:
        candidates = [c for c in self._clients.values() if c.available and c not in exclude]
        if not candidates:
            raise EngineUnavailableError(
                f"no engine is available ({len(self._clients)} known, {self.num_connected} connected, "
                "none accepting requests); retry later"
            )
        return min(candidates, key=lambda c: (c.outstanding_work, random.random()))

    async def fetch_tokenizer_files(self) -> dict[str, bytes]:
        """Tokenizer files from the first connected engine that serves them intact."""
        errors = []
        for client in [c for c in self._clients.values() if c.connected]:
            try:
                return await client.fetch_tokenizer_files()
            except (grpc.aio.AioRpcError, ValueError) as e:
                errors.append(f"{client.address}: {e}")
        raise EngineUnavailableError("cannot fetch the tokenizer: " + ("; ".join(errors) or "no engine connected"))

    def _changed(self) -> None:
        if self.healthy:
            self._connected.set()
        else:
            self._connected.clear()
        for callback in self._listeners:
            callback()

    def _add_client(self, address: str, tls_server_name: str | None) -> None:
        client = EngineClient(
            address, credentials=self._credentials, tls_server_name=tls_server_name,
            max_message_bytes=self._max_message_bytes, on_change=self._changed,
        )
        self._clients[address] = client
        client.start()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._dns_refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Re-resolve the DNS names; start clients for new addresses, retire vanished ones."""
        loop = asyncio.get_running_loop()
        resolved: dict[tuple[str, int], set[str]] = {}
        for name, port in self._dns:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
                resolved[(name, port)] = {_join_host_port(info[4][0], port) for info in infos}
            except OSError as e:
                resolved[(name, port)] = self._resolved.get((name, port), set())
                logger.warning("cannot resolve %s: %s; keeping its %d known engines",
                               name, e, len(resolved[(name, port)]))
        self._resolved = resolved
        wanted = {a: None for a in self._static}
        for (name, _), addresses in self._resolved.items():
            wanted.update({a: name for a in addresses if a not in wanted})
        for address, name in wanted.items():
            client = self._clients.get(address)
            if client is None:
                logger.info("engine %s discovered (%s)", address, name)
                self._add_client(address, name)
            elif client.retiring:
                client.retiring = False
        for address, client in list(self._clients.items()):
            if address not in wanted and not client.retiring:
                logger.info("engine %s vanished from DNS; closing it once its %d requests end",
                            address, client.num_outstanding)
                client.retiring = True
                task = asyncio.create_task(self._retire(client))
                self._retire_tasks.add(task)
                task.add_done_callback(self._retire_tasks.discard)

    async def _retire(self, client: EngineClient) -> None:
        while client.num_outstanding and client.retiring:
            await asyncio.sleep(0.2)
        if client.retiring and self._clients.get(client.address) is client:
            del self._clients[client.address]
            await client.close("the engine vanished from DNS")
            self._changed()


def parse_dns_target(target: str) -> tuple[str, int]:
    """``dns:///NAME:PORT`` (or ``dns://AUTHORITY/NAME:PORT``) -> (NAME, PORT)."""
    rest = target[len("dns:"):]
    if rest.startswith("//"):
        rest = rest[2:].partition("/")[2]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"engine target {target!r}: expected dns:///NAME:PORT")
    return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _drain(outbox: asyncio.Queue):
    while True:
        yield await outbox.get()


def engine_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS to engines; with cert and key also a client certificate (mutual TLS)."""

    def read(path: str | None) -> bytes | None:
        return None if path is None else open(path, "rb").read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


# -- protobuf <-> plain --------------------------------------------------------------------


def _sampling_params(p: SamplingParams) -> engine_pb2.SamplingParams:
    sp = engine_pb2.SamplingParams(
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature, top_p=p.top_p,
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos, logit_bias=p.logit_bias,
    )
    if p.seed is not None:
        sp.seed = p.seed
    if p.logprobs is not None:
        sp.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        sp.prompt_logprobs = p.prompt_logprobs
    return sp


def _logprob(lp: engine_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, lp.rank, [(t.token_id, t.logprob) for t in lp.top])


def _engine_output(o: engine_pb2.RequestOutput) -> EngineOutput:
    out = EngineOutput(o.request_id, list(o.new_token_ids), num_prompt_tokens=o.num_prompt_tokens,
                       num_cached_tokens=o.num_cached_tokens)
    # Most outputs are one decode token and nothing else: skip what is not there.
    if o.logprobs:
        out.logprobs = [_logprob(lp) for lp in o.logprobs]
    if o.prompt_logprobs:
        out.prompt_logprobs = [_logprob(lp) for lp in o.prompt_logprobs]
    if o.finish_reason:
        out.finish_reason = _FINISH.get(o.finish_reason)
    if o.HasField("stop_token_id"):
        out.stop_token_id = o.stop_token_id
    if o.HasField("error"):
        out.error = EngineError(_ERROR.get(o.error.code, ErrorCode.INTERNAL), o.error.message, o.error.field)
    return out


def _engine_load(load: engine_pb2.EngineLoad) -> EngineLoad:
    return EngineLoad(
        num_running=load.num_running, num_waiting=load.num_waiting, kv_cache_usage=load.kv_cache_usage,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate, num_used_blocks=load.num_used_blocks,
        draining=load.draining,
    )


def _model_info(info: engine_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
        architecture=info.architecture, device=info.device,
    )
