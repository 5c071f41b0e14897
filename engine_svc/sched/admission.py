"""Admission: the one place that decides whether a new request may enter the engine.

    EngineCore.add_request ─▶ check_admission ─▶ None: the scheduler queues it
                                              └▶ RequestError: it finishes at once, in band

In order: the engine is draining (UNAVAILABLE), the request is invalid (INVALID_ARGUMENT,
naming the field), the waiting queue is full or the KV pool can never hold it
(RESOURCE_EXHAUSTED). A refused request never touches the KV cache.
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


def check_admission(
    request: Request, limits: AdmissionLimits, *, num_waiting: int, draining: bool, pool_error: str | None
) -> RequestError | None:
    """Why ``request`` may not enter now, or None. ``pool_error`` is the KV manager's
    answer to whether the request's tokens could ever fit the pool."""
    if draining:
        return RequestError(ErrorCode.UNAVAILABLE, "the engine is shutting down; retry on another engine")
    error = check_request(request, vocab_size=limits.vocab_size, max_model_len=limits.max_model_len)
    if error is not None:
        return error
    if num_waiting >= limits.max_waiting:
        return RequestError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"the engine's waiting queue is full ({limits.max_waiting} requests); retry later",
        )
    if pool_error is not None:
        return RequestError(ErrorCode.RESOURCE_EXHAUSTED, pool_error)
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
