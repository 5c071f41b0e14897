"""Admission: the one place that decides whether a new request may enter the engine.

    EngineCore.add_request ─▶ check_admission ─▶ None: the scheduler queues it
                                              └▶ RequestError: it finishes at once, in band

In order: the engine is draining (UNAVAILABLE), the request is invalid (INVALID_ARGUMENT,
naming the field), including one the KV pool can never hold, the waiting queue is full
(RESOURCE_EXHAUSTED). A refused request never touches the KV cache.

The KV rule: a request must be able to hold all its tokens at once, its prompt plus
max_tokens (up to the context), so the pool must have room for that many. One that could
not would stream part of its output and then fail, or preempt everything else for
nothing; it is refused up front instead, with the largest max_tokens that would fit.
Retrying cannot help (the pool does not grow), hence INVALID_ARGUMENT, like a prompt
longer than the context.

This is the rule's only owner. The scheduler relies on it: a request it queues never
needs more than the whole pool, so a request that waits for blocks waits for other
requests to give theirs back, never forever (``Scheduler.add_request`` refuses one that
skipped admission, as a caller bug).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_svc.sched.request import Request
from engine_svc.types import ErrorCode, RequestError
from tandem_common.sampling import check_sampling_params


@dataclass(frozen=True)
class AdmissionLimits:
    vocab_size: int
    max_model_len: int
    max_waiting: int  # waiting-queue length beyond which new requests are refused
    kv_capacity_tokens: int  # the whole KV pool: blocks x block size


def check_admission(
    request: Request, limits: AdmissionLimits, *, num_waiting: int, draining: bool
) -> RequestError | None:
    """Why ``request`` may not enter now, or None."""
    if draining:
        return RequestError(ErrorCode.UNAVAILABLE, "the engine is shutting down; retry on another engine")
    error = check_request(request, vocab_size=limits.vocab_size, max_model_len=limits.max_model_len)
    if error is None:
        error = check_kv_capacity(
            request, kv_capacity_tokens=limits.kv_capacity_tokens, max_model_len=limits.max_model_len
        )
    if error is not None:
        return error
    if num_waiting >= limits.max_waiting:
        return RequestError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"the engine's waiting queue is full ({limits.max_waiting} requests); retry later",
        )
    return None


def check_kv_capacity(request: Request, *, kv_capacity_tokens: int, max_model_len: int) -> RequestError | None:
    """Whether a KV pool of ``kv_capacity_tokens`` (blocks x block size) can ever hold the
    request at its longest (see the module docstring)."""
    capacity = kv_capacity_tokens
    num_prompt = request.num_prompt_tokens
    if num_prompt >= capacity:
        return _invalid(
            "prompt_token_ids",
            f"the prompt has {num_prompt} tokens but this engine's KV cache holds {capacity} tokens in all; "
            f"shorten the prompt to at most {capacity - 1} tokens",
        )
    longest = min(num_prompt + request.sampling_params.max_tokens, max_model_len)
    if longest > capacity:
        field = "sampling_params.max_tokens"
        return _invalid(
            field,
            f"{field}: the prompt ({num_prompt} tokens) plus max_tokens ({request.sampling_params.max_tokens}) "
            f"may reach {longest} tokens but this engine's KV cache holds {capacity} tokens in all; "
            f"set max_tokens to at most {capacity - num_prompt}",
        )
    return None


def check_request(request: Request, *, vocab_size: int, max_model_len: int) -> RequestError | None:
    """The request's own validity: prompt ids, prompt length and sampling parameters."""
    prompt = request.prompt_token_ids
    if not prompt:
        return _invalid("prompt_token_ids", "prompt_token_ids is empty: send at least one token")
    bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab_size), None)
    if bad is not None:
        return _invalid(
            "prompt_token_ids",
            f"prompt_token_ids[{bad}] = {prompt[bad]} is outside the vocabulary [0, {vocab_size})",
        )
    if len(prompt) >= max_model_len:
        return _invalid(
            "prompt_token_ids",
            f"the prompt has {len(prompt)} tokens but the model's context is {max_model_len} tokens; "
            f"shorten the prompt to at most {max_model_len - 1} tokens so one token can be generated",
        )
    error = check_sampling_params(request.sampling_params, vocab_size)
    if error is not None:
        field = f"sampling_params.{error.name}"
        return _invalid(field, f"{field}: {error.message}")
    return None


def _invalid(field: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, message, field)
