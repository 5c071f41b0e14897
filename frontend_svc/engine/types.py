"""Plain types the engine client hands to the rest of the frontend (no protobuf here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
