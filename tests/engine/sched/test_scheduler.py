"""Scheduler: one token budget, chunked prefill, prefix hits, preemption, aborts, errors.

Each test builds requests, calls ``schedule()``, checks the rows, and feeds back a fake
runner output that "samples" a fixed token for every row with ``needs_sample``.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_svc.outputs import EngineOutput, ModelRunnerOutput, SchedulerOutput
from engine_svc.sched.admission import check_kv_capacity
from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.request import Request, RequestStatus, request_output
from engine_svc.sched.scheduler import Scheduler
from engine_svc.types import ErrorCode, FinishReason, Logprob, SamplingParams

BS = 4  # block size in these tests
TOKEN = 7  # what the fake runner samples
EOS = 0


def make_scheduler(
    *,
    num_blocks=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=1024,
    policy="fcfs",
    enable_prefix_caching=True,
    block_size=BS,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
    )


def make_request(
    request_id: str, prompt: int | list[int], *, max_tokens=4, priority=0, arrival=0.0, **params
) -> Request:
    # a prompt of n tokens of its own: requests share a prefix only where a test says so
    # (hits come within a step too: a chunk's full blocks are hittable once scheduled)
    start = 100 + 1000 * (zlib.crc32(request_id.encode()) % 1000)
    prompt_ids = list(range(start, start + prompt)) if isinstance(prompt, int) else prompt
    return Request(
        request_id,
        prompt_ids,
        SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
        arrival_time=arrival,
        eos_token_ids=(EOS,),
    )


def sample(out: SchedulerOutput, token: int = TOKEN) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled_token_ids={s.request.request_id: [token] for s in out.scheduled if s.needs_sample})


def rows(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, num_new_tokens) per row, in batch order."""
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


@dataclass
class Step:
    rows: list[tuple[str, int, int]]  # taken before update_from_output moves the starts
    outputs: dict[str, EngineOutput]
    scheduler_output: SchedulerOutput


def step(scheduler: Scheduler, token: int = TOKEN) -> Step:
    out = scheduler.schedule()
    scheduled = rows(out)
    return Step(scheduled, {o.request_id: o for o in scheduler.update_from_output(out, sample(out, token))}, out)


def run_all(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, list[EngineOutput]]:
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        for request_id, o in step(scheduler).outputs.items():
            outputs.setdefault(request_id, []).append(o)
    raise AssertionError("requests did not finish")


def test_prefill_then_decode_until_max_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 6, max_tokens=3))
    st = step(s)
    assert st.rows == [("a", 0, 6)]
    assert st.scheduler_output.scheduled[0].block_ids == s.kv_cache_manager.get_block_ids("a")
    assert st.outputs["a"].new_token_ids == [TOKEN] and not st.outputs["a"].finished
    assert st.outputs["a"].num_prompt_tokens == 6 and st.outputs["a"].num_cached_tokens == 0
    st = step(s)
    assert st.rows == [("a", 6, 1)]
    st = step(s)
    assert st.outputs["a"].finish_reason == FinishReason.LENGTH
    assert s.kv_cache_manager.num_used_blocks == 0 and not s.has_unfinished_requests()
    assert s.requests.get("a") is None
    assert s.schedule().finished_request_ids == {"a"}


def test_stop_token_finishes_with_its_id():
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=10))
    st = step(s, token=EOS)
    assert st.outputs["a"].finish_reason == FinishReason.STOP and st.outputs["a"].stop_token_id == EOS


def test_budget_is_shared_by_decodes_and_chunked_prefills():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", 4, max_tokens=5, arrival=0))
    s.add_request(make_request("b", 20, max_tokens=5, arrival=1))
    st = step(s)
    assert st.rows == [("a", 0, 4), ("b", 0, 6)]
    assert "b" not in st.outputs  # mid-prompt chunks sample nothing
    st = step(s)
    assert st.rows == [("a", 4, 1), ("b", 6, 9)]
    st = step(s)
    assert st.rows == [("a", 5, 1), ("b", 15, 5)]
    assert st.outputs["b"].new_token_ids == [TOKEN]  # the chunk reached the end of the prompt
    st = step(s)
    assert st.rows == [("a", 6, 1), ("b", 20, 1)]


def test_decodes_come_before_prefill_chunks():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("long", 20, arrival=0))
    st = step(s)
    s.add_request(make_request("short", 2, arrival=1))
    st = step(s)
    assert st.rows == [("long", 8, 8)]  # the running chunk takes the whole budget
    s.max_num_batched_tokens = 10
    st = step(s)
    assert st.rows == [("long", 16, 4), ("short", 0, 2)]
    st = step(s)
    assert st.rows == [("long", 20, 1), ("short", 2, 1)]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 3, max_tokens=2, arrival=i))
    st = step(s)
    assert [r[0] for r in st.rows] == ["r0", "r1"] and s.num_running == 2 and s.num_waiting == 1
    st = step(s)
    assert {o.finish_reason for o in st.outputs.values()} == {FinishReason.LENGTH}
    st = step(s)
    assert st.rows == [("r2", 0, 3)]


def test_prefix_hit_on_first_scheduling():
    s = make_scheduler()
    prompt = list(range(1, 10))  # 9 tokens: two full blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_all(s)
    s.add_request(make_request("b", prompt[:8] + [50, 51], max_tokens=1))
    st = step(s)
    assert st.rows == [("b", 8, 2)]
    assert st.outputs["b"].num_cached_tokens == 8
    assert s.kv_cache_manager.num_hits == 8
    assert s.kv_cache_manager.num_used_blocks == 0


def test_prompt_logprobs_disable_hits_and_are_counted():
    s = make_scheduler(max_num_batched_tokens=5)
    prompt = list(range(1, 10))
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_all(s)
    s.add_request(make_request("b", prompt, max_tokens=1, prompt_logprobs=0))
    out = s.schedule()
    assert rows(out) == [("b", 0, 5)]
    lps = [Logprob(t, -1.0, 1) for t in prompt[1:6]]
    outputs = s.update_from_output(out, ModelRunnerOutput(prompt_logprobs={"b": lps}))
    assert outputs[0].prompt_logprobs == lps and not outputs[0].new_token_ids
    assert s.requests.get("b").num_prompt_logprobs_done == 5


def pool_pressure(policy: str, **a_b_kw) -> Scheduler:
    """Two 7-token requests in a 4-block pool: both fit until the 9th token of one."""
    s = make_scheduler(num_blocks=4, policy=policy)
    kw_a, kw_b = a_b_kw.get("a", {}), a_b_kw.get("b", {})
    s.add_request(make_request("a", 7, max_tokens=6, **{"arrival": 0, **kw_a}))
    s.add_request(make_request("b", 7, max_tokens=6, **{"arrival": 1, **kw_b}))
    assert sorted(step(s).rows) == [("a", 0, 7), ("b", 0, 7)]
    assert sorted(step(s).rows) == [("a", 7, 1), ("b", 7, 1)]
    assert s.kv_cache_manager.num_free_blocks == 0
    return s


def test_preemption_by_recompute_takes_the_latest_request():
    s = pool_pressure("fcfs")
    st = step(s)  # both need a third block; b arrived last and gives its blocks back
    assert st.rows == [("a", 8, 1)] and st.scheduler_output.finished_request_ids == {"b"}
    b = s.requests.get("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.num_preemptions == 1 and s.num_waiting == 1 and "b" not in st.outputs
    outputs = run_all(s)
    assert [t for o in outputs["b"] for t in o.new_token_ids] == [TOKEN] * 4  # 2 before, 4 after
    assert outputs["b"][-1].finish_reason == FinishReason.LENGTH
    assert s.requests.get("b") is None and s.kv_cache_manager.num_used_blocks == 0


def test_preempted_request_goes_to_the_front_of_the_queue():
    s = pool_pressure("fcfs")
    s.add_request(make_request("c", 2, arrival=2))
    step(s)
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_request_preempts_itself_when_it_is_the_latest():
    s = pool_pressure("fcfs", a={"arrival": 5})  # a was admitted first but arrived last
    st = step(s)
    assert st.rows == [("b", 8, 1)] and s.requests.get("a").status == RequestStatus.PREEMPTED


def test_priority_policy_serves_lower_values_first_then_by_arrival():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("low", 2, max_tokens=1, priority=5, arrival=0))
    s.add_request(make_request("high-late", 2, max_tokens=1, priority=0, arrival=2))
    s.add_request(make_request("high-early", 2, max_tokens=1, priority=0, arrival=1))
    order = [step(s).rows[0][0] for _ in range(3)]
    assert order == ["high-early", "high-late", "low"]


def test_priority_policy_preempts_the_lowest_priority():
    s = pool_pressure("priority", a={"priority": 3}, b={"priority": 1})
    st = step(s)  # a arrived first, but b is more important
    assert st.rows == [("b", 8, 1)] and s.requests.get("a").status == RequestStatus.PREEMPTED


def test_abort_waiting_running_twice_and_unknown():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", 5, max_tokens=10))
    s.add_request(make_request("wait", 5))
    step(s)
    assert s.kv_cache_manager.num_used_blocks == 2
    outputs = s.abort_requests(["wait", "run", "run", "nope"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("wait", FinishReason.ABORT),
        ("run", FinishReason.ABORT),
    ]
    assert s.abort_requests(["run"]) == []
    assert s.kv_cache_manager.num_used_blocks == 0 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.is_empty and out.finished_request_ids == {"wait", "run"}


def test_abort_between_schedule_and_update_drops_the_runner_output():
    s = make_scheduler()
    s.add_request(make_request("a", 5, arrival=0))
    s.add_request(make_request("b", 5, arrival=1))
    out = s.schedule()
    assert [o.request_id for o in s.abort_requests(["a"])] == ["a"]
    outputs = s.update_from_output(out, sample(out))
    assert [o.request_id for o in outputs] == ["b"]
    assert s.kv_cache_manager.get_block_ids("a") == [] and s.kv_cache_manager.num_used_blocks == 2
    assert rows(s.schedule()) == [("b", 5, 1)]


def test_a_request_that_skipped_admission_and_can_never_fit_is_a_caller_bug():
    # Admission owns the KV-pool rule (tests/engine/sched/test_admission.py); the scheduler only
    # refuses to queue a request that could wait for blocks forever.
    s = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="skipped admission"):
        s.add_request(make_request("big", 17))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request("grows", 15, max_tokens=10))
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_used_blocks == 0


def test_a_request_that_fills_the_pool_alone_runs_to_its_end():
    s = make_scheduler(num_blocks=4)
    s.add_request(make_request("a", 15, max_tokens=1))
    outputs = run_all(s)
    assert [t for o in outputs["a"] for t in o.new_token_ids] == [TOKEN]
    assert outputs["a"][-1].finish_reason == FinishReason.LENGTH
    assert s.num_preemptions == 0 and s.kv_cache_manager.num_used_blocks == 0


def test_missing_sampled_token_finishes_with_internal_error():
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    out = s.schedule()
    [o] = s.update_from_output(out, ModelRunnerOutput())
    assert o.finish_reason == FinishReason.ERROR and o.error.code == ErrorCode.INTERNAL
    assert s.num_running == 0 and s.kv_cache_manager.num_used_blocks == 0


# -- property: random workloads always drain ---------------------------------------------


class SlotCheckingRunner:
    """Writes each computed position's prefix into its KV slot and checks, before every
    chunk, that the slots of already computed positions still hold the request's prefix.
    Catches a block freed or evicted while in use, or a wrong prefix hit."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, out: SchedulerOutput, vocab: int) -> ModelRunnerOutput:
        bs, result = self.block_size, ModelRunnerOutput()
        for s in out.scheduled:
            tokens = s.request.all_token_ids
            assert s.num_new_tokens >= 1 and s.start + s.num_new_tokens <= len(tokens)
            assert len(s.block_ids) * bs >= s.start + s.num_new_tokens
            for pos in range(s.start + s.num_new_tokens):
                slot = s.block_ids[pos // bs] * bs + pos % bs
                if pos < s.start:
                    assert self.slots.get(slot) == tuple(tokens[: pos + 1]), (s.request, pos)
                else:
                    self.slots[slot] = tuple(tokens[: pos + 1])
            if s.needs_sample:
                result.sampled_token_ids[s.request.request_id] = [sum(tokens) * 31 % vocab]
        return result


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5]]

request_spec = st.tuples(
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 20), max_size=10),  # prompt = prefix + tail
    st.integers(1, 8),
    st.integers(0, 2),
    st.integers(0, 8),  # max_tokens, priority, arrival step
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(request_spec, min_size=1, max_size=8),
    aborts=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 7), st.booleans()), max_size=6),
    block_size=st.sampled_from([1, 2, 4]),
    pool_tokens=st.integers(12, 48),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.booleans(),
)
def test_random_workloads_always_drain(
    specs, aborts, block_size, pool_tokens, max_num_seqs, budget, policy, prefix_caching
):
    num_blocks = pool_tokens // block_size
    s = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        enable_prefix_caching=prefix_caching,
        block_size=block_size,
        max_model_len=64,
    )
    kv, runner = s.kv_cache_manager, SlotCheckingRunner(block_size)
    requests = [
        make_request(f"r{i}", prefix + tail, max_tokens=m, priority=p, arrival=float(t))
        for i, (prefix, tail, m, p, t) in enumerate(specs)
    ]
    finished: dict[str, EngineOutput] = {}
    num_tokens: dict[str, int] = {}

    def collect(outputs):
        for o in outputs:
            assert o.request_id not in finished, "output after the request finished"
            num_tokens[o.request_id] = num_tokens.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o

    for t in range(2000):
        for r in requests:
            if r.arrival_time == t:
                # As the engine core does: admission refuses what the pool can never hold.
                error = check_kv_capacity(r, kv_capacity_tokens=num_blocks * block_size, max_model_len=64)
                if error is None:
                    s.add_request(r)
                else:
                    r.finish(FinishReason.ERROR, error=error)
                    collect([request_output(r)])
        collect(s.abort_requests(f"r{i % len(specs)}" for at, i, between in aborts if at == t and not between))
        if t > max(r.arrival_time for r in requests) and not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.num_tokens <= budget and len(out.scheduled) <= max_num_seqs
        assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
        assert s.num_running <= max_num_seqs
        runner_output = runner.execute(out, vocab=21)
        collect(s.abort_requests(f"r{i % len(specs)}" for at, i, between in aborts if at == t and between))
        collect(s.update_from_output(out, runner_output))
        # Only running requests hold blocks, and each reference is one block-table entry.
        refs = Counter(b for r in s.running for b in kv.get_block_ids(r.request_id))
        assert [b.ref_count for b in kv.blocks] == [refs[i] for i in range(num_blocks)]
        assert kv.num_used_blocks == len(refs)
    else:
        raise AssertionError("the workload did not drain")

    for label, happened in [
        ("preempted", s.num_preemptions),
        ("prefix hit", kv.num_hits),
        ("aborted", any(o.finish_reason == FinishReason.ABORT for o in finished.values())),
        ("refused", any(o.error for o in finished.values())),
    ]:
        event(f"{label}: {bool(happened)}")
    assert kv.num_used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0
    assert set(finished) == {r.request_id for r in requests}
    for r in requests:
        o = finished[r.request_id]
        assert r.is_finished and num_tokens.get(r.request_id, 0) == r.num_output_tokens <= r.sampling_params.max_tokens
        if o.finish_reason == FinishReason.LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= 64
        if o.finish_reason == FinishReason.ERROR:  # refused before it ran, never half way
            assert o.error.code == ErrorCode.INVALID_ARGUMENT and r.num_output_tokens == 0
            assert min(r.num_prompt_tokens + r.sampling_params.max_tokens, 64) > num_blocks * block_size
