"""Checks an incoming request before it reaches the scheduler.

Every refusal names the field and says what to fix; the request then finishes at once
with an in-band error and never touches the KV cache.
"""

from __future__ import annotations

import math

from engine_svc.sched.request import ErrorCode, Request, RequestError

MAX_LOGPROBS = 20


def _invalid(field: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, message, field)


def _finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


def validate_request(request: Request, *, vocab_size: int, max_model_len: int) -> RequestError | None:
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
    return _validate_sampling(request, vocab_size)


def _validate_sampling(request: Request, vocab_size: int) -> RequestError | None:
    p = request.sampling_params
    f = "sampling_params."
    checks: list[tuple[bool, str, str]] = [
        (p.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {p.max_tokens}"),
        (p.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {p.min_tokens}"),
        (p.min_tokens <= p.max_tokens, "min_tokens",
         f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})"),
        (_finite(p.temperature) and 0.0 <= p.temperature <= 100.0, "temperature",
         f"temperature must be in [0, 100], got {p.temperature}"),
        (_finite(p.top_p) and 0.0 < p.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, "top_k", f"top_k must be -1, 0 (all tokens) or positive, got {p.top_k}"),
        (_finite(p.min_p) and 0.0 <= p.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {p.min_p}"),
        (_finite(p.presence_penalty) and -2.0 <= p.presence_penalty <= 2.0, "presence_penalty",
         f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (_finite(p.frequency_penalty) and -2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty",
         f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (_finite(p.repetition_penalty) and 0.0 < p.repetition_penalty <= 2.0, "repetition_penalty",
         f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
         f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}"),
    ]
    for ok, name, message in checks:
        if not ok:
            return _invalid(f + name, message)
    for t in p.stop_token_ids:
        if not 0 <= t < vocab_size:
            return _invalid(f + "stop_token_ids", f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
    for t, bias in p.logit_bias.items():
        if not 0 <= t < vocab_size:
            return _invalid(f + "logit_bias", f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
        if not (_finite(bias) and -100.0 <= bias <= 100.0):
            return _invalid(f + "logit_bias", f"logit_bias[{t}] must be in [-100, 100], got {bias}")
    return None
