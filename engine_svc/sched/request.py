"""Engine-side request state: sampling parameters, lifecycle and why a request ended.

These are plain dataclasses: the servicer converts protobuf into them at the boundary,
and nothing past that boundary knows protobuf exists. No torch here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (separate from why it finished)."""

    WAITING = "waiting"  # queued; num_computed_tokens may be > 0 only through prefix-cache hits
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    PREEMPTED = "preempted"  # blocks were taken back; waits to be recomputed
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended."""

    STOP = "stop"  # EOS or one of stop_token_ids (see Request.stop_token_id)
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the client or because its stream ended
    ERROR = "error"  # refused (invalid input, queue full, draining); see Request.error


class ErrorCode(enum.Enum):
    """In-band error classes; they map one to one onto gRPC status codes."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


@dataclass(frozen=True)
class RequestError:
    code: ErrorCode
    message: str
    field: str = ""  # the offending field, e.g. "sampling_params.top_p"


@dataclass
class SamplingParams:
    """Token-level sampling controls; names follow vLLM so readers can cross-reference.

    Defaults are the neutral values: temperature 1.0, top_p 1.0, top_k 0 (= off),
    min_p 0.0, penalties 0.0 / 1.0 (off). ``temperature == 0`` means greedy.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives to return besides the chosen token
    prompt_logprobs: int | None = None  # same, for every prompt position
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Logprob:
    """The chosen token's log-probability, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


class Request:
    """One generation request inside the engine.

    Token layout: ``all_token_ids = prompt_token_ids + output_token_ids``. The first
    ``num_computed_tokens`` of them have their K/V in the cache; the scheduler moves that
    counter forward, so chunked prefill, decode and recompute after preemption are the
    same operation: catch ``num_computed_tokens`` up with ``len(all_token_ids)``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
        trace_context: dict[str, str] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.trace_context = trace_context or {}

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache (set once)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.error: RequestError | None = None
        # Prompt logprobs are produced chunk by chunk and sent once; a request that is
        # recomputed after preemption does not produce them again.
        self.num_prompt_logprobs_done = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish(self, reason: FinishReason, *, error: RequestError | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, {self.status.value})"
        )


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its last output token ends it. Returns True when it finished.

    Order matters: a stop token wins over a length limit reached by the same token.
    Stop and EOS tokens only count once ``min_tokens`` outputs exist (the sampler also
    masks them until then).
    """
    params = request.sampling_params
    num_out = request.num_output_tokens
    if num_out == 0:
        return False
    last = request.output_token_ids[-1]
    if num_out >= params.min_tokens:
        if (not params.ignore_eos and last in request.eos_token_ids) or last in params.stop_token_ids:
            request.stop_token_id = last
            request.finish(FinishReason.STOP)
            return True
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        request.finish(FinishReason.LENGTH)
        return True
    return False
