"""Plain types the engine client hands to the rest of the frontend (no protobuf here).

The vocabulary both services share (SamplingParams, FinishReason, ErrorCode, Logprob)
lives in tandem_common; these are the frontend's own: what one request produced, an
engine's load, its model, and its in-band errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem_common.types import ErrorCode, FinishReason, Logprob


@dataclass(frozen=True)
class EngineError:
    """A request's in-band failure, as the engine reported it; ``field`` is "" when none is named."""

    code: ErrorCode
    message: str
    field: str = ""


class EngineUnavailableError(Exception):
    """No engine can take the request, or the one serving it went away; safe to retry."""


class EngineRequestTooLargeError(Exception):
    """The request, as an engine message, is larger than the engine stream can carry: sent,
    it would end the stream and every request on it. Nothing was sent."""


@dataclass
class EngineOutput:
    """What one request produced in one or more engine steps (merged while unread)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: EngineError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: EngineOutput) -> None:
        self.new_token_ids.extend(later.new_token_ids)
        self.logprobs.extend(later.logprobs)
        self.prompt_logprobs.extend(later.prompt_logprobs)
        self.num_prompt_tokens = max(self.num_prompt_tokens, later.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        if later.finished:
            self.finish_reason, self.stop_token_id, self.error = later.finish_reason, later.stop_token_id, later.error

    def split(self) -> list[EngineOutput]:
        """One output per token, as if each had come alone (``--stream-interval 1``): the
        first carries the prompt logprobs, the last the finish; merge() undoes it."""
        if len(self.new_token_ids) < 2:
            return [self]
        has_logprobs = len(self.logprobs) == len(self.new_token_ids)
        parts = [
            EngineOutput(
                self.request_id,
                [t],
                [self.logprobs[i]] if has_logprobs else [],
                num_prompt_tokens=self.num_prompt_tokens,
                num_cached_tokens=self.num_cached_tokens,
            )
            for i, t in enumerate(self.new_token_ids)
        ]
        parts[0].prompt_logprobs = self.prompt_logprobs
        last = parts[-1]
        last.finish_reason, last.stop_token_id, last.error = self.finish_reason, self.stop_token_id, self.error
        return parts


@dataclass
class EngineLoad:
    """What routing reads of an engine's reported load."""

    num_running: int = 0
    num_waiting: int = 0
    draining: bool = False
    num_used_blocks: int = 0  # KV blocks held by running requests
    num_waiting_tokens: int = 0  # tokens of queued requests, all still to compute


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
