"""The scheduler's mutable request: lifecycle, token counters, and the stop rules.

Only the scheduler side changes a ``Request``; the model side reads it through
``engine_svc.types.RequestView``. No torch here.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from engine_svc.outputs import EngineOutput
from engine_svc.types import FinishReason, Logprob, RequestError, SamplingParams
from tandem_common.block_hash import salted


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle (separate from why it finished)."""

    WAITING = "waiting"  # queued; num_computed_tokens may be > 0 only through prefix-cache hits
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    PREEMPTED = "preempted"  # blocks were taken back; waits to be recomputed
    PAUSED = "paused"  # held back (its stream's reader lags); holds no blocks, not scheduled
    FINISHED = "finished"


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
        client_request_id: str | None = None,
        lora_name: str | None = None,
        stream_id: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id  # unique in the engine
        # The id its client gave it (unique per stream only); logs and traces show it.
        self.client_request_id = request_id if client_request_id is None else client_request_id
        # The engine stream it came on (service/engine_loop.py), whose shares it counts against;
        # None: run in-process (``EngineCore.generate``), all such requests one stream.
        self.stream_id = stream_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.trace_context = trace_context or {}
        # The compiled output constraint, set by EngineCore before the request is queued
        # (engine_svc/grammar_compiler.py); opaque here.
        self.grammar: object | None = None
        # The LoRA adapter it runs under (None: the base model) and its slot, set at admission;
        # the client's cache salt; the parent of its first block's hash, both of them mixed:
        # salted(the adapter's digest, the salt) (tandem_common/block_hash.py).
        self.lora_name = lora_name
        self.lora_slot: int | None = None
        self.client_cache_salt = cache_salt
        self.cache_salt: bytes | None = salted(None, cache_salt)

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache (set once)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)  # checked every step
        self.error: RequestError | None = None
        # Prompt logprobs are produced chunk by chunk and sent once; a request that is
        # recomputed after preemption does not produce them again.
        self.num_prompt_logprobs_done = 0

    # Its own row in a step, as the sampler reads it (``RequestView``): no drafts before it.
    draft_token_ids: Sequence[int] = ()

    @property
    def draft_base(self) -> Request:
        return self

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
    masks them until then). With an output constraint, EOS always ends the request: the
    sampler lets it through only where the grammar may end, and under min_tokens or
    ignore_eos only where the grammar allows nothing else.
    """
    params = request.sampling_params
    num_out = request.num_output_tokens
    if num_out == 0:
        return False
    last = request.output_token_ids[-1]
    if params.structured is not None and last in request.eos_token_ids:
        request.stop_token_id = last
        request.finish(FinishReason.STOP)
        return True
    if num_out >= params.min_tokens:
        if (not params.ignore_eos and last in request.eos_token_ids) or last in request.stop_token_ids:
            request.stop_token_id = last
            request.finish(FinishReason.STOP)
            return True
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        request.finish(FinishReason.LENGTH)
        return True
    return False


def request_output(
    request: Request,
    new_token_ids: Sequence[int] = (),
    logprobs: Sequence[Logprob] = (),
    prompt_logprobs: Sequence[Logprob] = (),
) -> EngineOutput:
    """The output that tells a request's client what it produced this step; once the
    request is finished, also why it ended (and its error, if refused or failed)."""
    finished = request.is_finished
    return EngineOutput(
        request.request_id,
        new_token_ids=list(new_token_ids),
        logprobs=list(logprobs),
        prompt_logprobs=list(prompt_logprobs),
        finish_reason=request.finish_reason if finished else None,
        stop_token_id=request.stop_token_id if finished else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(0, request.num_cached_tokens),
        error=request.error,
    )
