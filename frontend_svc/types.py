"""The frontend's plain values, the bottom layer every other part may import (no protobuf here).

    service ──▶ engine ──▶ text ──▶ types          (import-linter holds the layers)

What the engine client hands to the rest of the frontend: each request's outputs and
in-band errors (``EngineOutput``, ``RequestError``: the values both services share, from
tandem_common), an engine's load, the model it serves, and the errors of reaching one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem_common.outputs import EngineOutput, RequestError
from tandem_common.types import ErrorCode

__all__ = [
    "CallError",
    "EngineLoad",
    "EngineOutput",
    "EngineRequestTooLargeError",
    "EngineUnavailableError",
    "ModelIdentity",
    "ModelInfo",
    "RequestError",
    "UnknownModelError",
]


class CallError(Exception):
    """Ends a public call with the gRPC status named by ``code`` and a message that says what
    to fix. A call's error, not a request's: the in-band ``RequestError`` of an engine output
    becomes one only when the servicer ends the call with it."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class UnknownModelError(CallError):
    """A model name that no engine serves, neither as its model nor as a LoRA adapter."""

    def __init__(self, name: str, served: list[str]) -> None:
        names = ", ".join(repr(n) for n in served)
        super().__init__(ErrorCode.NOT_FOUND, f"model: no engine serves {name!r}; served: {names or 'none yet'}")
        self.name = name
        self.served = served  # the model's name first, then the adapters'


class EngineUnavailableError(Exception):
    """No engine can take the request, or the one serving it went away; safe to retry."""


class EngineRequestTooLargeError(Exception):
    """The request, as an engine message, is larger than the engine stream can carry: sent,
    it would end the stream and every request on it. Nothing was sent."""


@dataclass
class EngineLoad:
    """What routing reads of an engine's reported load."""

    num_running: int = 0
    num_waiting: int = 0
    draining: bool = False
    num_used_blocks: int = 0  # KV blocks held by running requests
    num_waiting_tokens: int = 0  # tokens of queued requests, all still to compute
    lora_version: int = 0  # changes when the engine's LoRA adapters change (ask GetModelInfo again)


@dataclass
class ModelInfo:
    """The model an engine serves, as its GetModelInfo tells."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 0  # KV blocks in the engine's pool; 0 from an engine that names none
    block_hash_algorithm: str = ""  # "" from an engine that names none: no prefix predictions
    # The LoRA adapters the engine serves: name -> digest (the first block hash's parent).
    lora_adapters: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelIdentity:
    """What makes engines interchangeable behind one frontend: the model's name and
    vocabulary size, and the sha256 of each tokenizer file the frontend reads."""

    model_name: str
    vocab_size: int
    tokenizer_sha256: tuple[tuple[str, str], ...] = ()  # (file name, hex digest), sorted by name

    def differences(self, other: ModelIdentity) -> list[str]:
        """How ``other`` differs from this one, one phrase per difference; empty if alike."""
        diffs = []
        if other.model_name != self.model_name:
            diffs.append(f"model {other.model_name!r} instead of {self.model_name!r}")
        if other.vocab_size != self.vocab_size:
            diffs.append(f"vocabulary of {other.vocab_size} tokens instead of {self.vocab_size}")
        mine, theirs = dict(self.tokenizer_sha256), dict(other.tokenizer_sha256)
        for name in sorted(mine.keys() | theirs.keys()):
            if name not in theirs:
                diffs.append(f"no {name}")
            elif name not in mine:
                diffs.append(f"an extra {name}")
            elif mine[name] != theirs[name]:
                diffs.append(f"{name} with sha256 {theirs[name][:12]}... instead of {mine[name][:12]}...")
        return diffs
