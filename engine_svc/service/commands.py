"""What other threads ask of the engine thread (``engine_loop.py``): small frozen commands,
applied in order by one ``match`` on the engine thread between steps.

Commands that answer (the LoRA admin ones) carry a ``concurrent.futures.Future`` that the
engine thread settles with the result or the refusal; the asker waits on it from its own
thread or event loop (``asyncio.wrap_future``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine_svc.model.lora import LoraAdapter
from engine_svc.outputs import EngineOutput, EngineStats, RejectedAdd
from engine_svc.types import FinishReason, RequestError, SamplingParams
from tandem_common.kv_events import KvEvent

# A sink receives (outputs, stats) per turn, or (None, stats) once the stream is done:
# it was half-closed by its client and its last request finished. Outputs are in step
# order; refused duplicate adds come as RejectedAdd. It returns True to ask for a pause
# (its reader lags beyond its bound), anything else to go on.
Sink = Callable[[list[EngineOutput | RejectedAdd] | None, EngineStats], bool | None]
# A KV sink receives batches of prefix-cache events, each of at most the hashes it asked for.
KvSink = Callable[[list[KvEvent], EngineStats], None]


@dataclass(frozen=True)
class AddCommand:
    """One request as a stream's client sent it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    trace_context: dict[str, str] | None = None
    lora_name: str | None = None  # the LoRA adapter it runs under; None: the base model
    cache_salt: str | None = None  # mixed into its block hashes (tandem_common/block_hash.py)


@dataclass(frozen=True)
class OpenStream:
    stream_id: int
    sink: Sink


@dataclass(frozen=True)
class Add:
    stream_id: int
    command: AddCommand


@dataclass(frozen=True)
class Abort:
    stream_id: int
    request_ids: tuple[str, ...]
    reason: FinishReason = FinishReason.ABORT  # STOP when the client found a stop string


@dataclass(frozen=True)
class ResumeStream:
    """The stream's reader caught up: its paused requests may run again."""

    stream_id: int


@dataclass(frozen=True)
class PauseRequests:
    """The stream's client cannot take these requests' output yet: hold them back."""

    stream_id: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class ResumeRequests:
    """The stream's client took their output: the requests it paused may run again."""

    stream_id: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class HalfClose:
    """The client sends no more commands; the stream ends once its requests finish."""

    stream_id: int


@dataclass(frozen=True)
class HalfCloseAll:
    """Shutdown: every stream ends once its requests have finished."""


@dataclass(frozen=True)
class CloseStream:
    """The stream ended: abort everything it added and forget it."""

    stream_id: int


@dataclass(frozen=True)
class SubscribeKvEvents:
    """Send the stream a snapshot of the prefix cache, then every turn's cache events."""

    stream_id: int
    sink: KvSink
    max_hashes: int  # per batch, so that each fits one stream message


@dataclass(frozen=True)
class StartDraining:
    """Refuse new requests from now on; running ones go on."""


@dataclass(frozen=True)
class FailAll:
    """Finish every request with an in-band error (a shutdown cut)."""

    error: RequestError


@dataclass(frozen=True)
class LoadLora:
    """Serve a LoRA adapter read (and checked) on another thread; ``reply`` gets its
    ``LoraAdapterInfo`` or the ``LoraRefusedError`` that says why not."""

    adapter: LoraAdapter
    reply: Future


@dataclass(frozen=True)
class UnloadLora:
    """Stop serving a LoRA adapter; ``reply`` gets its name or the ``LoraRefusedError``."""

    name: str
    reply: Future


Command = (
    OpenStream
    | Add
    | Abort
    | ResumeStream
    | PauseRequests
    | ResumeRequests
    | HalfClose
    | HalfCloseAll
    | CloseStream
    | SubscribeKvEvents
    | StartDraining
    | FailAll
    | LoadLora
    | UnloadLora
)
