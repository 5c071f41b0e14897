"""Admission: the order of its refusals, the message of each, and the KV rule the scheduler
relies on (an admitted request can always run to its end with the pool to itself)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_svc.outputs import ModelRunnerOutput
from engine_svc.sched.admission import AdmissionLimits, check_admission, check_kv_capacity
from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.request import Request
from engine_svc.sched.scheduler import Scheduler
from engine_svc.types import ErrorCode, FinishReason, SamplingParams

VOCAB = 100
LIMITS = AdmissionLimits(vocab_size=VOCAB, max_model_len=64, max_waiting=2, kv_capacity_tokens=32)


def make_request(prompt: int | list[int] = 4, **params) -> Request:
    prompt_ids = list(range(1, 1 + prompt)) if isinstance(prompt, int) else prompt
    return Request("r", prompt_ids, SamplingParams(**{"max_tokens": 4, **params}), eos_token_ids=(0,))


def admit(request: Request, limits: AdmissionLimits = LIMITS, *, num_waiting: int = 0, draining: bool = False):
    return check_admission(request, limits, num_waiting=num_waiting, draining=draining)


def test_a_valid_request_is_admitted():
    assert admit(make_request()) is None
    assert admit(make_request(), num_waiting=LIMITS.max_waiting - 1) is None


def test_draining_comes_first_even_for_an_invalid_request():
    error = admit(make_request([]), draining=True, num_waiting=LIMITS.max_waiting)
    assert error is not None and error.code == ErrorCode.UNAVAILABLE
    assert "shutting down" in error.message and "retry on another engine" in error.message


def test_an_invalid_request_is_refused_before_a_full_queue():
    error = admit(make_request([]), num_waiting=LIMITS.max_waiting)
    assert error is not None and error.code == ErrorCode.INVALID_ARGUMENT and error.field == "prompt_token_ids"


def test_a_full_queue_refuses_a_valid_request_for_now():
    error = admit(make_request(), num_waiting=LIMITS.max_waiting)
    assert error is not None and error.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "waiting queue is full (2 requests)" in error.message and "retry later" in error.message


@pytest.mark.parametrize(
    "prompt, params, field, message",
    [
        ([], {}, "prompt_token_ids", "is empty"),
        ([1, VOCAB, 2], {}, "prompt_token_ids", f"prompt_token_ids[1] = {VOCAB} is outside the vocabulary"),
        ([1, -1], {}, "prompt_token_ids", "prompt_token_ids[1] = -1"),
        (64, {}, "prompt_token_ids", "shorten the prompt to at most 63 tokens"),
        (4, {"max_tokens": 0}, "sampling_params.max_tokens", "must be at least 1"),
        (4, {"top_p": 1.5}, "sampling_params.top_p", "sampling_params.top_p: must be in"),
    ],
)
def test_an_invalid_request_names_its_field(prompt, params, field, message):
    error = admit(make_request(prompt, **params), AdmissionLimits(VOCAB, 64, 2, kv_capacity_tokens=4096))
    assert error is not None and error.code == ErrorCode.INVALID_ARGUMENT
    assert error.field == field and message in error.message


def test_a_prompt_the_pool_cannot_hold_is_refused_with_the_longest_that_fits():
    error = admit(make_request(32, max_tokens=1))
    assert error is not None and error.code == ErrorCode.INVALID_ARGUMENT and error.field == "prompt_token_ids"
    assert "holds 32 tokens in all" in error.message and "at most 31 tokens" in error.message


def test_max_tokens_beyond_the_pool_is_refused_with_the_largest_that_fits():
    error = admit(make_request(20, max_tokens=13))
    assert error is not None and error.code == ErrorCode.INVALID_ARGUMENT
    assert error.field == "sampling_params.max_tokens"
    assert "may reach 33 tokens" in error.message and "set max_tokens to at most 12" in error.message
    assert admit(make_request(20, max_tokens=12)) is None  # exactly the pool


def test_the_context_caps_what_a_request_can_reach():
    # prompt + max_tokens is past the pool, but the context stops the request first.
    limits = AdmissionLimits(VOCAB, max_model_len=30, max_waiting=2, kv_capacity_tokens=32)
    assert admit(make_request(20, max_tokens=1000), limits) is None
    assert check_kv_capacity(make_request(20, max_tokens=1000), kv_capacity_tokens=29, max_model_len=30) is not None


def test_a_refused_request_is_left_untouched():
    kv = KVCacheManager(num_blocks=2, block_size=16)
    request = make_request(20, max_tokens=13)
    assert admit(request) is not None
    assert not request.is_finished and request.num_computed_tokens == 0  # the core finishes it
    assert kv.num_used_blocks == 0 and kv.get_block_ids(request.request_id) == []


@settings(max_examples=150, deadline=None)
@given(
    num_prompt=st.integers(1, 40),
    max_tokens=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    pool_tokens=st.integers(16, 64),
    max_model_len=st.integers(8, 80),
)
def test_admitted_means_it_runs_to_its_end_alone(num_prompt, max_tokens, block_size, pool_tokens, max_model_len):
    """The KV rule is exactly what the scheduler needs: an admitted request finishes with
    the pool to itself, and a refused one would have needed more blocks than the pool has."""
    num_blocks = pool_tokens // block_size
    limits = AdmissionLimits(VOCAB, max_model_len, max_waiting=1, kv_capacity_tokens=num_blocks * block_size)
    request = make_request(num_prompt, max_tokens=max_tokens, ignore_eos=True)
    error = admit(request, limits)
    if error is not None:
        if error.field == "prompt_token_ids" and num_prompt >= max_model_len:
            return  # longer than the context: not the KV rule
        longest = min(num_prompt + max_tokens, max_model_len)
        assert error.code == ErrorCode.INVALID_ARGUMENT and longest > num_blocks * block_size
        return
    kv = KVCacheManager(num_blocks, block_size)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=max_model_len)
    s.add_request(request)
    for _ in range(200):
        out = s.schedule()
        assert not out.is_empty, "an admitted request waits for blocks that never come"
        sampled = {x.request.request_id: [1] for x in out.scheduled if x.needs_sample}
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        if request.is_finished:
            break
    assert request.finish_reason == FinishReason.LENGTH and request.error is None
    assert request.num_tokens == min(num_prompt + max_tokens, max_model_len) and s.num_preemptions == 0
