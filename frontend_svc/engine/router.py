"""Routing over every engine this frontend knows: static addresses and DNS names.

    servicer ── route(PromptBlocks) ──▶ EngineRouter ── Candidate per available engine ──▶
             routing.py (least-load or prefix policy) ──▶ Route(client, reason, predicted hit)

With the prefix policy the router owns a PrefixIndex that every EngineClient feeds from
its engine's prefix-cache events; a prompt is hashed once per request, only when there
are two or more engines to choose from, and off the event loop when it is long.

A request under a LoRA adapter goes only to engines that serve the adapter, and its
prompt is hashed from the adapter's digest as those engines hash it
(tandem_common/block_hash.py), so it is predicted to hit only blocks cached under the
same adapter version.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from frontend_svc.engine.client import DEFAULT_PROGRESS_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, EngineClient
from frontend_svc.engine.fresh_rounds import FreshRounds
from frontend_svc.engine.prefix_index import PrefixIndex
from frontend_svc.engine.routing import (
    DEFAULT_LOAD_THRESHOLD_TOKENS,
    Candidate,
    RoutingPolicy,
    RoutingReason,
    choose_by_prefix,
    least_loaded,
)
from frontend_svc.engine.watchdog import DEFAULT_PROGRESS_FACTOR, DEFAULT_PROGRESS_FLOOR_S, Pace
from frontend_svc.types import EngineUnavailableError, ModelIdentity, ModelInfo, UnknownModelError
from tandem_common.block_hash import BlockHash, hash_blocks, max_hit_blocks, salted

logger = logging.getLogger(__name__)

# Prompts with more tokens to hash than this are hashed on a worker thread: SHA-256 of a
# block of 16 costs 1-2 us here (4096 tokens about 0.3 ms, 32k tokens about 3 ms), and the
# event loop serves every other call and stream meanwhile.
HASH_OFF_LOOP_TOKENS = 4096


class PromptBlocks:
    """A request's prompt as routing sees it: its block hashes, made once per block size,
    on first use, and kept for a retry on another engine."""

    def __init__(self, token_ids: list[int], *, prompt_logprobs: bool = False, cache_salt: str | None = None) -> None:
        self.token_ids = token_ids
        self.prompt_logprobs = prompt_logprobs  # such requests hit nothing (the engine's rule)
        self.cache_salt = cache_salt  # mixed into the first block's parent, as the engine mixes it
        self._hashes: dict[tuple[int, bytes | None], list[BlockHash]] = {}

    async def hashes(self, block_size: int, salt: bytes | None = None) -> list[BlockHash]:
        """Hashes of the leading blocks an engine's prefix cache could serve (max_hit_blocks),
        the first chained to ``salt`` (a LoRA adapter's digest; None for the base model) with
        the request's cache salt mixed in."""
        hashes = self._hashes.get((block_size, salt))
        if hashes is None:
            n = max_hit_blocks(len(self.token_ids), block_size, prompt_logprobs=self.prompt_logprobs)
            parent = salted(salt, self.cache_salt)
            if n * block_size > HASH_OFF_LOOP_TOKENS:
                hashes = await asyncio.to_thread(hash_blocks, self.token_ids, block_size, n, parent)
            else:
                hashes = hash_blocks(self.token_ids, block_size, n, parent)
            self._hashes[(block_size, salt)] = hashes
        return hashes


@dataclass(frozen=True)
class Route:
    """Where a request goes and why; ``predicted_cached_tokens`` is None when nothing was predicted."""

    client: EngineClient
    reason: RoutingReason
    predicted_cached_tokens: int | None = None


class EngineRouter:
    """All engines this frontend knows: a static list plus DNS names re-resolved periodically.

    ``route()`` picks among the available engines (connected, not draining, not retiring)
    by the policy (routing.py): the least loaded one, or the one holding the longest
    cached prefix of the prompt within ``load_threshold_tokens`` of the least load.
    ``pick()`` is the least-load choice alone.

    Every engine must serve the model of the first engine accepted (``identity``): an
    engine with another model name, vocabulary size or tokenizer file is refused, with a
    warning that says what differs, and never gets a request. The first model stays the
    reference for the life of the process: a frontend follows a model change by restarting.
    """

    def __init__(
        self,
        targets: list[str],
        *,
        dns_refresh_s: float = 10.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S,
        progress_factor: float = DEFAULT_PROGRESS_FACTOR,
        progress_floor_s: float = DEFAULT_PROGRESS_FLOOR_S,
        policy: RoutingPolicy = RoutingPolicy.LEAST_LOAD,
        load_threshold_tokens: int = DEFAULT_LOAD_THRESHOLD_TOKENS,
    ) -> None:
        self._static = [t for t in targets if not t.startswith("dns:")]
        self._dns = [parse_dns_target(t) for t in targets if t.startswith("dns:")]
        self._dns_refresh_s = dns_refresh_s
        self._credentials = credentials
        self._max_message_bytes = max_message_bytes
        self._stall_timeout_s = stall_timeout_s
        self._progress_timeout_s = progress_timeout_s
        self._progress_factor = progress_factor
        self._progress_floor_s = progress_floor_s
        self.identity: ModelIdentity | None = None  # of the first engine accepted
        self.policy = policy
        self.load_threshold_tokens = load_threshold_tokens
        self.index = PrefixIndex() if policy is RoutingPolicy.PREFIX else None
        self._clients: dict[str, EngineClient] = {}
        self._resolved: dict[tuple[str, int], set[str]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._connected = asyncio.Event()
        self._refresh_task: asyncio.Task | None = None
        self._retire_tasks: set[asyncio.Task] = set()
        self._lora_rounds = FreshRounds(
            lambda: asyncio.gather(*(c.model.refresh() for c in self._clients.values() if c.connected))
        )

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
    def num_refused(self) -> int:
        """Engines refused because they serve another model."""
        return sum(c.refused is not None for c in self._clients.values())

    @property
    def model_info(self) -> ModelInfo | None:
        return next((c.model_info for c in self._clients.values() if c.connected and c.model_info), None)

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters some connected engine serves, by name."""
        names = {n for c in self._clients.values() if c.connected and c.model_info for n in c.model_info.lora_adapters}
        return sorted(names)

    async def check_lora(self, name: str) -> None:
        """Raise NOT_FOUND unless some connected engine serves adapter ``name``. A known name
        costs nothing; an unknown one first waits for every engine's model info asked after
        the call arrived (fresh_rounds.py: unknown names arriving together share one round),
        so an adapter loaded before the call is never answered NOT_FOUND."""
        if name in self.lora_adapters:
            return
        await self._lora_rounds.after_now()
        if name in self.lora_adapters:
            return
        info = self.model_info
        raise UnknownModelError(name, ([info.model_name] if info else []) + list(self.lora_adapters))

    async def refresh_model_infos(self) -> None:
        """Every connected engine's model info asked again (after a LoRA load or unload)."""
        await self._lora_rounds.after_now()

    def engine_figures(self) -> dict[str, tuple[int, int]]:
        """{address: (load tokens, blocks the prefix index holds)} of the connected engines and
        of those the index still holds blocks of (metrics)."""
        index = self.index
        addresses = {c.address for c in self._clients.values() if c.connected}
        addresses.update(index.engines if index is not None else ())
        return {
            a: (self._clients[a].load_tokens if a in self._clients else 0, index.num_blocks(a) if index else 0)
            for a in addresses
        }

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever an engine connects, disconnects, starts/stops draining
        or is refused."""
        self._listeners.append(callback)

    async def start(self) -> None:
        logger.info(
            "engine watchdogs: an engine silent for %g s is hung; one that advances nothing has its waiting "
            "requests moved after %g x the pace of the engines that serve (at least %g s), and its calls failed "
            "after %g s (0: never)",
            self._stall_timeout_s,
            self._progress_factor,
            self._progress_floor_s,
            self._progress_timeout_s,
        )
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

    def pick(self, exclude: Sequence[EngineClient] = (), lora_name: str | None = None) -> EngineClient:
        """The least loaded available engine (``EngineClient.load_tokens``) that serves
        ``lora_name`` (None: the base model); ties at random."""
        candidates = self._available(exclude, lora_name)
        return candidates[least_loaded([Candidate(c.load_tokens) for c in candidates])]

    async def route(
        self, prompt: PromptBlocks, exclude: Sequence[EngineClient] = (), lora_name: str | None = None
    ) -> Route:
        """Where ``prompt``'s request goes, by the policy, among the engines that serve
        ``lora_name``; raises EngineUnavailableError when nowhere."""
        candidates = self._available(exclude, lora_name)
        if self.index is None:
            return Route(self.pick(exclude, lora_name), RoutingReason.LEAST_LOAD)
        if len(candidates) == 1:
            return Route(candidates[0], RoutingReason.SINGLE_ENGINE)
        keys = {key for c in candidates if (key := _hash_key(c, lora_name)) is not None}
        matches = {key: self.index.match(await prompt.hashes(*key)) for key in sorted(keys, key=str)}
        candidates = self._available(exclude, lora_name)  # the awaits may have let engines come or go
        figures = []
        for c in candidates:
            hit = 0
            key = _hash_key(c, lora_name)
            if key is not None and key in matches:
                hit = matches[key].get(c.address, 0) * key[0]
            figures.append(Candidate(c.load_tokens, hit, self.index.num_blocks(c.address)))
        i, reason = choose_by_prefix(figures, self.load_threshold_tokens)
        chosen = candidates[i]
        return Route(chosen, reason, figures[i].hit_tokens if chosen.predicts_prefix_hits else None)

    def _available(self, exclude: Sequence[EngineClient], lora_name: str | None = None) -> list[EngineClient]:
        candidates = [c for c in self._clients.values() if c.available and c not in exclude and c.serves(lora_name)]
        if not candidates:
            serving = "" if lora_name is None else f" serving LoRA adapter {lora_name!r}"
            raise EngineUnavailableError(
                f"no engine{serving} is available ({len(self._clients)} known, {self.num_connected} connected, "
                "none accepting requests); retry later"
            )
        return candidates

    async def fetch_tokenizer_files(self) -> dict[str, bytes]:
        """Tokenizer files from the first connected engine that serves them intact."""
        errors = []
        for client in [c for c in self._clients.values() if c.connected]:
            try:
                return await client.fetch_tokenizer_files()
            except (grpc.aio.AioRpcError, ValueError) as e:
                errors.append(f"{client.address}: {e}")
        raise EngineUnavailableError("cannot fetch the tokenizer: " + ("; ".join(errors) or "no engine connected"))

    def _accept(self, client: EngineClient, identity: ModelIdentity) -> str | None:
        """None if ``client``'s model is the one this frontend serves, else why not."""
        if self.identity is None:
            self.identity = identity
            files = ", ".join(name for name, _ in identity.tokenizer_sha256) or "none"
            logger.info(
                "serving model %s (vocabulary %d, tokenizer files: %s) as engine %s has it",
                identity.model_name,
                identity.vocab_size,
                files,
                client.address,
            )
            return None
        diffs = self.identity.differences(identity)
        if not diffs:
            return None
        return f"it serves another model than the first engine this frontend accepted: {'; '.join(diffs)}"

    def _changed(self) -> None:
        if self.healthy:
            self._connected.set()
        else:
            self._connected.clear()
        for callback in self._listeners:
            callback()

    def _add_client(self, address: str, tls_server_name: str | None) -> None:
        client = EngineClient(
            address,
            credentials=self._credentials,
            tls_server_name=tls_server_name,
            max_message_bytes=self._max_message_bytes,
            stall_timeout_s=self._stall_timeout_s,
            progress_timeout_s=self._progress_timeout_s,
            progress_factor=self._progress_factor,
            progress_floor_s=self._progress_floor_s,
            peers=self._paces_besides,
            accept=self._accept,
            on_change=self._changed,
            index=self.index,
        )
        self._clients[address] = client
        client.start()

    def _paces_besides(self, client: EngineClient) -> list[Pace]:
        """The paces of the engines ``client``'s is judged against: the others that take requests."""
        now = time.monotonic()
        return [c.pace(now) for c in self._clients.values() if c is not client and c.available]

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
                resolved[(name, port)] = {_join_host_port(str(info[4][0]), port) for info in infos}
            except OSError as e:
                resolved[(name, port)] = self._resolved.get((name, port), set())
                logger.warning(
                    "cannot resolve %s: %s; keeping its %d known engines", name, e, len(resolved[(name, port)])
                )
        self._resolved = resolved
        wanted: dict[str, str | None] = {a: None for a in self._static}  # address -> its DNS name
        for (name, _), addresses in self._resolved.items():
            wanted.update({a: name for a in addresses if a not in wanted})
        for address, dns_name in wanted.items():
            client = self._clients.get(address)
            if client is None:
                logger.info("engine %s discovered (%s)", address, dns_name)
                self._add_client(address, dns_name)
            elif client.retiring:
                client.retiring = False
        for address, client in list(self._clients.items()):
            if address not in wanted and not client.retiring:
                logger.info(
                    "engine %s vanished from DNS; closing it once its %d requests end", address, client.num_outstanding
                )
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


def _hash_key(client: EngineClient, lora_name: str | None) -> tuple[int, bytes | None] | None:
    """(block size, salt) the engine hashes ``lora_name``'s prompts with; None: no prediction."""
    if not client.predicts_prefix_hits or client.model_info is None:
        return None
    return client.model_info.block_size, client.lora_digest(lora_name)


def parse_dns_target(target: str) -> tuple[str, int]:
    """``dns:///NAME:PORT`` (or ``dns://AUTHORITY/NAME:PORT``) -> (NAME, PORT)."""
    rest = target[len("dns:") :]
    if rest.startswith("//"):
        rest = rest[2:].partition("/")[2]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"engine target {target!r}: expected dns:///NAME:PORT")
    return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
