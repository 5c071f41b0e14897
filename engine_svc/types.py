"""The engine's value types, and the read-only view of a request that the model side gets.

The scheduler side owns the mutable ``Request`` (``engine_svc/sched/request.py``); the
model runner and the sampler read requests only through ``RequestView``, so they can
never move a counter the scheduler relies on. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem_common.outputs import RequestError
from tandem_common.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from tandem_common.types import ErrorCode, FinishReason, Logprob

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ErrorCode",
    "FinishReason",
    "Logprob",
    "RequestError",
    "RequestView",
    "SamplingParams",
]


class RequestView(Protocol):
    """What the model runner and the sampler read of a request, and nothing more.

    Token layout: ``all_token_ids = prompt_token_ids + output_token_ids``; the first
    ``num_computed_tokens`` of them have their K/V in the cache.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def grammar(self) -> object | None:
        """The compiled output constraint (``engine_svc.model.structured.CompiledGrammar``)
        when ``sampling_params.structured`` is set, else None. Attached before the request
        is first scheduled; opaque to the scheduler side, which never imports the model."""
        ...

    @property
    def lora_slot(self) -> int | None:
        """The slot of the LoRA adapter the request runs under (engine_svc/model/lora/), or
        None for the base model. Set when the request is admitted; its adapter stays in that
        slot while the request is unfinished."""
        ...

    @property
    def draft_base(self) -> RequestView:
        """The request this row samples for: the request itself, or, at a draft row of
        speculative decoding (``engine_svc/model/spec/verify.py``), the request whose
        drafts the row judges. Per-request state (penalty counts, a grammar's matcher,
        logit-bias tensors) is the base's."""
        ...

    @property
    def draft_token_ids(self) -> Sequence[int]:
        """The drafts before this row, which the sampler reads as output tokens after the
        base's own; empty for a request's own row."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_logprobs_done(self) -> int:
        """Prompt positions whose logprobs were sent already (before a preemption, say)."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...
