"""The LoRA adapters an engine serves: registered by name, held in slots, pinned by requests.

    registered   name -> directory: every adapter a request may name (--lora-modules, or
                 loaded at run time through the LoadLoraAdapter RPC)
    resident     name -> slot, at most --max-cpu-loras of them, least recently used first:
                 the adapters whose weights are in memory (model/lora/slots.py)
    in use       the adapters of unfinished requests: never evicted nor unloaded; the
                 registry counts them itself, a reference per request from ``acquire``
                 until ``release`` sees the request's finished output

A request names its adapter; admission (``acquire``) gives it the adapter's slot and digest,
reading the adapter back from its directory first if it was evicted to make room for
another (this runs on the engine thread: a disk read between two steps, logged with its
time). If every slot holds an adapter in use, the request is refused with
RESOURCE_EXHAUSTED: retrying once others finish can succeed. How many adapters one step may
mix is the scheduler's rule (sched/lora.py, --max-loras). The core hands every output it
returns to ``release``: each way a request ends (a step, an abort, a failure, a refusal)
ends in a finished output, which drops its reference.

Unloading an adapter that unfinished requests use is refused (FAILED_PRECONDITION, with
their number): an operator unloads after routing traffic elsewhere, and no request ever
loses its adapter half way. Loading a name that is registered is refused too
(ALREADY_EXISTS): a new version is unloaded and loaded again, and, since its digest
differs, never hits the blocks cached under the old one.

Everything here runs on the engine thread but ``read``, which parses and checks a
directory (any thread: the servicer runs it off the event loop before handing the result
over). ``infos`` is an immutable snapshot, replaced whole on every change (``version``).

An engine started without --enable-lora has a ``NoLoraRegistry``: no adapters, requests
that name one refused, loads and unloads refused with the flag to start with.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.lora import LoraAdapter, LoraError, LoraSlots, read_adapter
from engine_svc.outputs import EngineOutput, LoraAdapterInfo
from engine_svc.sched.request import Request
from engine_svc.types import ErrorCode, RequestError
from tandem_common.block_hash import salted

logger = logging.getLogger(__name__)

MAX_REGISTERED = 1024  # names an engine remembers (each is a name and a path)


@dataclass(frozen=True)
class LoraConfig:
    modules: tuple[tuple[str, str], ...] = ()  # --lora-modules NAME=DIR
    max_loras: int = 4  # adapters one step may mix
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # slots; None: max(max_loras, len(modules))

    @property
    def num_slots(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.modules))


class LoraRefusedError(Exception):
    """A load or unload the registry refuses; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Registered:
    path: Path
    digest: bytes
    max_rank: int
    loaded_at: float  # time.time()


class AdapterRegistry(Protocol):
    """What the core asks of the LoRA adapters it serves (all on the engine thread but ``read``)."""

    version: int
    infos: tuple[LoraAdapterInfo, ...]

    @property
    def max_loras(self) -> int:
        """Adapters one step may mix; 0: the engine serves none."""
        ...

    def read(self, name: str, path: str | Path) -> LoraAdapter: ...

    def add(self, adapter: LoraAdapter, *, seconds: float = 0.0) -> None: ...

    def remove(self, name: str) -> None: ...

    def acquire(self, request: Request) -> RequestError | None:
        """Give ``request`` its adapter's slot and digest, if it names one, or say why it cannot run."""
        ...

    def release(self, outputs: Iterable[EngineOutput]) -> None:
        """Drop the references of the requests these outputs finish."""
        ...

    def take_events(self) -> tuple[tuple[str, float], ...]: ...


class LoraRegistry:
    def __init__(self, slots: LoraSlots, args: ModelArgs, config: LoraConfig) -> None:
        self.slots = slots
        self.args = args
        self.config = config
        self._registered: dict[str, _Registered] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._free_slots = list(range(slots.num_slots - 1, -1, -1))
        self.version = 0
        self.infos: tuple[LoraAdapterInfo, ...] = ()
        self._events: list[tuple[str, float]] = []  # (load | unload | reload, seconds) since take_events
        self._users: dict[str, str] = {}  # request id -> the adapter it holds a reference to
        self._num_users: Counter[str] = Counter()  # adapter name -> unfinished requests using it

    @property
    def max_loras(self) -> int:
        return self.config.max_loras

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """The adapter in ``path``, checked against the model (any thread); LoraRefusedError
        (INVALID_ARGUMENT) names what cannot be served."""
        _check_name(name)
        try:
            return read_adapter(name, path, self.args, max_rank=self.config.max_lora_rank)
        except LoraError as e:
            raise LoraRefusedError(ErrorCode.INVALID_ARGUMENT, str(e)) from None

    def add(self, adapter: LoraAdapter, *, seconds: float = 0.0) -> None:
        """Register ``adapter`` and put it in a slot (evicting the least recently used
        adapter no request uses; if all are in use it stays registered, and is read back
        when a request names it)."""
        if adapter.name in self._registered:
            raise LoraRefusedError(
                ErrorCode.ALREADY_EXISTS,
                f"a LoRA adapter named {adapter.name!r} is loaded already; unload it first to load a new version",
            )
        if len(self._registered) >= MAX_REGISTERED:
            raise LoraRefusedError(
                ErrorCode.RESOURCE_EXHAUSTED, f"this engine holds {MAX_REGISTERED} adapter names; unload some first"
            )
        start = time.perf_counter()
        slot = self._take_slot()
        if slot is not None:
            self._install(adapter, slot)
        self._registered[adapter.name] = _Registered(adapter.path, adapter.digest, adapter.max_rank, time.time())
        self._changed()
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %.1f MiB, %s)",
            adapter.name,
            adapter.path,
            adapter.max_rank,
            adapter.nbytes / 2**20,
            f"slot {slot}" if slot is not None else "no free slot: read again when a request names it",
        )
        self._event("load", seconds + time.perf_counter() - start)

    def remove(self, name: str) -> None:
        if name not in self._registered:
            raise LoraRefusedError(ErrorCode.NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
        users = self._num_users[name]
        if users:
            raise LoraRefusedError(
                ErrorCode.FAILED_PRECONDITION,
                f"LoRA adapter {name!r} is used by {users} unfinished requests; unload it once they finish",
            )
        start = time.perf_counter()
        slot = self._resident.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)
            self._free_slots.append(slot)
        del self._registered[name]
        self._changed()
        logger.info("LoRA adapter %r unloaded", name)
        self._event("unload", time.perf_counter() - start)

    def acquire(self, request: Request) -> RequestError | None:
        """Give ``request`` its adapter's slot and digest (the parent of its first block's
        hash) and count it as a user, or say why it cannot run."""
        if request.lora_name is None:
            return None
        slot_and_digest = self._slot_of(request.lora_name)
        if isinstance(slot_and_digest, RequestError):
            return slot_and_digest
        request.lora_slot, digest = slot_and_digest
        request.cache_salt = salted(digest, request.client_cache_salt)
        self._users[request.request_id] = request.lora_name
        self._num_users[request.lora_name] += 1
        return None

    def release(self, outputs: Iterable[EngineOutput]) -> None:
        for out in outputs:
            if out.finished and (name := self._users.pop(out.request_id, None)) is not None:
                self._num_users[name] -= 1
                if not self._num_users[name]:
                    del self._num_users[name]

    def _slot_of(self, name: str) -> tuple[int, bytes] | RequestError:
        """(slot, digest) for a request of adapter ``name``, reading it back if it was
        evicted; or the error the request is refused with."""
        entry = self._registered.get(name)
        if entry is None:
            known = ", ".join(sorted(self._registered)) or "none"
            return RequestError(
                ErrorCode.NOT_FOUND, f"no LoRA adapter named {name!r} on this engine (loaded: {known})", "lora_name"
            )
        slot = self._resident.get(name)
        if slot is not None:
            self._resident.move_to_end(name)
            return slot, entry.digest
        slot = self._take_slot()
        if slot is None:
            return RequestError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"every LoRA slot (--max-cpu-loras {self.slots.num_slots}) holds an adapter that running requests "
                f"use; retry {name!r} later",
            )
        start = time.perf_counter()
        try:
            adapter = read_adapter(name, entry.path, self.args, max_rank=self.config.max_lora_rank)
        except (LoraError, OSError) as e:
            self._free_slots.append(slot)
            logger.error("LoRA adapter %r could not be read back: %s", name, e)
            return RequestError(ErrorCode.UNAVAILABLE, f"LoRA adapter {name!r} could not be read back: {e}")
        self._install(adapter, slot)
        if adapter.digest != entry.digest:  # the directory changed since it was loaded
            logger.warning("LoRA adapter %r changed on disk since it was loaded; serving the new weights", name)
            entry.digest = adapter.digest
            self._changed()
        seconds = time.perf_counter() - start
        logger.info("LoRA adapter %r read back into slot %d in %.3f s", name, slot, seconds)
        self._event("reload", seconds)
        return slot, entry.digest

    # -- internals ----------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A free slot, or the least recently used adapter's that no request uses."""
        if self._free_slots:
            return self._free_slots.pop()
        for name, slot in self._resident.items():  # least recently used first
            if name not in self._num_users:
                del self._resident[name]
                logger.info("LoRA adapter %r evicted from slot %d (least recently used)", name, slot)
                return slot
        return None

    def _install(self, adapter: LoraAdapter, slot: int) -> None:
        self.slots.write(slot, adapter)
        self._resident[adapter.name] = slot

    def _changed(self) -> None:
        self.version += 1
        self.infos = tuple(
            LoraAdapterInfo(name, str(e.path), e.digest, e.max_rank, e.loaded_at)
            for name, e in sorted(self._registered.items())
        )

    def _event(self, kind: str, seconds: float) -> None:
        self._events.append((kind, seconds))

    def take_events(self) -> tuple[tuple[str, float], ...]:
        """The loads, unloads and read-backs since the last take, with their durations (metrics)."""
        events, self._events = tuple(self._events), []
        return events


class NoLoraRegistry:
    """The engine without --enable-lora: it serves no adapters."""

    version = 0
    infos: tuple[LoraAdapterInfo, ...] = ()
    max_loras = 0

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        raise _lora_off()

    def add(self, adapter: LoraAdapter, *, seconds: float = 0.0) -> None:
        raise _lora_off()

    def remove(self, name: str) -> None:
        raise _lora_off()

    def acquire(self, request: Request) -> RequestError | None:
        if request.lora_name is None:
            return None
        return RequestError(
            ErrorCode.NOT_FOUND,
            f"no LoRA adapter named {request.lora_name!r}: this engine serves none (start it with --enable-lora)",
            "lora_name",
        )

    def release(self, outputs: Iterable[EngineOutput]) -> None:
        pass

    def take_events(self) -> tuple[tuple[str, float], ...]:
        return ()


def _lora_off() -> LoraRefusedError:
    return LoraRefusedError(
        ErrorCode.FAILED_PRECONDITION, "this engine serves no LoRA adapters: start it with --enable-lora"
    )


def _check_name(name: str) -> None:
    if not name or len(name) > 128 or not name.isprintable() or name != name.strip():
        raise LoraRefusedError(
            ErrorCode.INVALID_ARGUMENT,
            f"LoRA adapter name {name[:64]!r}: 1 to 128 printable characters, no surrounding spaces",
        )
