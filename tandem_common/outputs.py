"""What one request produced, as both services speak of it, and why it failed.

    engine: scheduler ── EngineOutput per step ──▶ StreamBacklog (merge while unread,
                                                   split_at a message's byte budget)
    frontend: stream ── EngineOutput ──▶ RequestHandle (merge while unread) ──▶ split() per token

The merge and split rules live here once, so that an output merged or split on either
side reads the same as the outputs it came from: tokens, logprobs and prompt logprobs
concatenate in order, the finish (reason, stop token, error) is the last output's, and
the counts (prompt tokens, cached tokens) are the largest seen.

Plain Python (no protobuf, no torch): each service converts at its boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tandem_common.types import ErrorCode, FinishReason, Logprob


@dataclass(frozen=True)
class RequestError:
    """Why a request was refused or failed; travels in band on the engine stream."""

    code: ErrorCode
    message: str
    field: str = ""  # the offending field, e.g. "sampling_params.top_p"; "" when none is named


@dataclass
class EngineOutput:
    """What one request produced in one engine step, or in several merged while unread.

    Invariant: ``logprobs`` is empty or holds one entry per ``new_token_ids`` entry. A
    finished output (``finish_reason`` set) is the request's last; ``error`` is set only
    on a finished one.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self) -> EngineOutput:
        """A copy whose lists are its own (the Logprob values in them are shared: never changed)."""
        return dataclasses.replace(
            self,
            new_token_ids=list(self.new_token_ids),
            logprobs=list(self.logprobs),
            prompt_logprobs=list(self.prompt_logprobs),
        )

    def merge(self, later: EngineOutput) -> None:
        """Appends ``later`` (the same request's next output) to this one, in place."""
        self.new_token_ids.extend(later.new_token_ids)
        self.logprobs.extend(later.logprobs)
        self.prompt_logprobs.extend(later.prompt_logprobs)
        self.num_prompt_tokens = max(self.num_prompt_tokens, later.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        if later.finished:
            self.finish_reason, self.stop_token_id, self.error = later.finish_reason, later.stop_token_id, later.error

    def split_at(self, num_prompt_logprobs: int, num_tokens: int) -> tuple[EngineOutput, EngineOutput]:
        """(head, tail): the head carries the first ``num_prompt_logprobs`` prompt logprobs and
        the first ``num_tokens`` tokens (with their logprobs) and no finish; the tail the rest
        and the finish. Neither shares a list with this output; ``head.merge(tail)`` gives it back."""
        head = EngineOutput(
            self.request_id,
            new_token_ids=self.new_token_ids[:num_tokens],
            logprobs=self.logprobs[:num_tokens],
            prompt_logprobs=self.prompt_logprobs[:num_prompt_logprobs],
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )
        tail = dataclasses.replace(
            self,
            new_token_ids=self.new_token_ids[num_tokens:],
            logprobs=self.logprobs[num_tokens:],
            prompt_logprobs=self.prompt_logprobs[num_prompt_logprobs:],
        )
        return head, tail

    def split(self) -> list[EngineOutput]:
        """One output per token, as if each had come alone (``--stream-interval 1``): the
        first carries the prompt logprobs, the last the finish; merging them in order gives
        this output back."""
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
