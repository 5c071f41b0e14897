"""Typed hand-offs between the engine's stages.

    scheduler.schedule() -> SchedulerOutput -> model_runner.execute() -> ModelRunnerOutput
    -> scheduler.update_from_output() -> list[EngineOutput] (what the servicer streams)
    EngineCore.make_stats() -> EngineStats (one snapshot per loop turn, for other threads)
    EngineCore.model_info() -> ModelInfo (what the model and its KV cache are, once loaded)

No torch here: the scheduler and the servicer import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.types import Logprob, RequestError, RequestView
from tandem_common.outputs import EngineOutput as EngineOutput  # the per-request output both services share

# A draft slot the runner's draft model fills in the step (``ScheduledRequest.draft_token_ids``
# with the draft-model method): not a token id.
MODEL_DRAFT = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens ``request.all_token_ids[start:start + num_new_tokens]``
    where ``start = request.num_computed_tokens`` (not yet advanced: the scheduler moves
    it forward in ``update_from_output``). ``block_ids`` is the request's whole block
    table, already long enough for ``start + num_new_tokens`` tokens plus the drafts.

    ``draft_token_ids`` (speculative decoding, ``sched/spec/``) are guesses of the
    tokens after the request's last one: the runner computes them as rows after the real
    ones and verifies them; only a chunk that reaches the end (``needs_sample``) has any.
    With a draft model they are ``MODEL_DRAFT`` slots, which the runner fills first.
    """

    request: RequestView
    num_new_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        """Rows this request takes in the step: its new tokens and its drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def needs_sample(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new one is due."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """Everything the model runner needs for one step, in no particular order: the
    runner alone decides the batch order (outputs are keyed by request id)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted or finished since the last step: the runner drops per-request
    # state it holds for them (seeded generators, penalty counts).
    finished_request_ids: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Per request id: the tokens it gets this step (only requests with ``needs_sample``):
    one, or, scheduled with drafts, the drafts verification accepted and the token sampled
    after them (accepted + 1); one logprob entry per token when logprobs are asked; prompt
    logprobs for the positions computed this step; and errors.

    ``num_verified_drafts``: for a request scheduled with drafts, how many of them were
    verified (an output constraint cuts the ones it forbids).

    ``execute_s`` is the step's time in the runner, less the draft model's passes, which
    ``draft_passes`` lists as (rows, seconds): what the adaptive rule learns costs from.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    num_verified_drafts: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    # Requests the runner could not serve (an output constraint that failed mid-way): the
    # scheduler finishes them with this error instead of keeping a token.
    errors: dict[str, RequestError] = field(default_factory=dict)
    execute_s: float = 0.0
    draft_passes: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class RejectedAdd:
    """An add refused without becoming a request: its id is in flight on its stream.

    Not an EngineOutput, so it can never finish (or be mistaken for) the live request
    of the same id.
    """

    request_id: str
    error: RequestError


@dataclass(frozen=True)
class StepStats:
    """The figures of one engine step."""

    duration_s: float
    num_batched_tokens: int


@dataclass(frozen=True)
class StructuredStats:
    """Structured output since the engine started (``engine_svc/grammar_compiler.py``)."""

    requests_by_kind: tuple[tuple[str, int], ...] = ()  # constrained requests received, by kind
    num_cache_hits: int = 0  # requests whose grammar was already compiled
    num_failed: int = 0  # requests refused because their constraint does not compile
    num_timeouts: int = 0  # requests refused because their compile took too long
    compile_durations_s: tuple[float, ...] = ()  # compiles finished since the previous snapshot


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding since the engine started, as totals (``engine_svc/sched/spec/``)."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose position i was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after one turn of its loop, as other threads may read it.

    The engine thread builds a new one after every turn (commands applied, a step run or
    not) and replaces the old one in a single assignment; readers (GetLoad, the stream's
    load figures, metrics) never touch the live scheduler or KV manager.
    """

    num_running: int = 0
    num_waiting: int = 0  # queued, including requests whose grammar is being compiled
    num_paused: int = 0  # held back because their stream's reader lags (not in num_waiting)
    num_waiting_tokens: int = 0  # tokens of the waiting requests, all still to compute
    num_used_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0  # since start
    num_unfinished: int = 0  # requests the engine still owes a final output
    draining: bool = False
    step: StepStats | None = None  # None when the turn ran no step
    structured: StructuredStats = StructuredStats()
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
    lora_version: int = 0  # changes whenever an adapter is loaded, unloaded or changed
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()  # the LoRA adapters requests may name
    lora_events: tuple[tuple[str, float], ...] = ()  # (load | unload | reload, seconds) in this turn


@dataclass(frozen=True)
class LoraAdapterInfo:
    """A LoRA adapter the engine serves (lora_registry.py)."""

    name: str
    path: str
    digest: bytes  # sha256 of its weights and scales: the parent of its requests' first block hash
    max_rank: int
    loaded_at: float  # seconds since the epoch


@dataclass(frozen=True)
class ModelInfo:
    """The served model and its KV cache as clients see them; fixed once the core is built."""

    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str  # what --dtype auto resolved to, e.g. "bfloat16"
    device: str
    block_size: int
    num_kv_blocks: int
    max_loras: int = 0  # LoRA adapters one step may mix; 0: this engine serves none

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
