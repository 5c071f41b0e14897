"""Speculative decoding, the scheduler's side: prompt lookup, the config, the adaptive
rule, and the scheduler reserving and rolling back draft slots (fake runner outputs)."""

from __future__ import annotations

import pytest

from engine_svc.config import build_parser
from engine_svc.outputs import MODEL_DRAFT, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.request import Request
from engine_svc.sched.scheduler import Scheduler
from engine_svc.sched.spec import Offer, SpeculativeConfig, Speculator, StepCosts, choose_drafts, propose_ngram
from engine_svc.types import SamplingParams

BS = 4


def test_prompt_lookup_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 1, 2, 3]
    # The suffix [1, 2, 3] occurs at 0 and 4; the latest (4) is followed by 8, 7, 5.
    assert propose_ngram(tokens, 3, 1, 3) == [8, 7, 5]
    assert propose_ngram(tokens, 10, 1, 3) == [8, 7, 5, 1, 2, 3]
    # A longer n that matches nowhere falls back to shorter ones.
    assert propose_ngram([5, 6, 4, 6], 2, 1, 3) == [4, 6]
    assert propose_ngram([1, 2, 3, 4], 2, 1, 3) == []
    assert propose_ngram([1, 2, 3, 4], 2, 2, 3) == []
    assert propose_ngram([7], 2, 1, 3) == []


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("not json", "is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle"}', "method 'eagle' is not supported"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min (4) exceeds"),
        ('{"k": 3}', "unknown key(s) ['k']"),
        ('{"min_acceptance": 0.1}', "unknown key(s) ['min_acceptance']"),
        ('{"adaptive": 1}', "adaptive must be true or false"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be a positive integer"),
        ('{"method": "draft_model"}', '"draft_model" needs "model"'),
        ('{"method": "draft_model", "model": "/no/such/model"}', "draft model '/no/such/model' does not exist"),
        ('{"model": "/tmp"}', '"model" is only for method "draft_model"'),
        ('{"method": "draft_model", "model": "/tmp", "quantization": "q2"}', "quantization 'q2' is not one of"),
    ],
)
def test_bad_config_names_what_to_fix(text, fragment):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_json(text)
    assert fragment in str(e.value)


def test_flag_parses_and_refuses(capsys):
    args = build_parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert build_parser().parse_args([]).speculative_config is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative-config", '{"method": "x"}'])
    assert "method 'x' is not supported" in capsys.readouterr().err


def make_request(request_id: str, prompt: list[int], **params) -> Request:
    return Request(request_id, prompt, SamplingParams(**{"max_tokens": 32, **params}), eos_token_ids=(0,))


COPY = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11]  # its suffix [10, 11] is followed by 12, 13, ...


def decoding(request_id: str, prompt: list[int], **params) -> Request:
    """A request whose prompt is computed but its last token: it decodes next."""
    r = make_request(request_id, prompt, **params)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_without_the_cost_model_every_decoding_request_drafts_what_it_can():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, adaptive=False), max_model_len=64)
    r = decoding("a", COPY)
    assert spec.plan([r], 100) == {"a": [12, 13, 14, 15]}
    assert spec.plan([r], 3) == {"a": [12, 13]}  # the budget caps it (one row is the real token)
    assert spec.plan([decoding("b", COPY, max_tokens=3)], 100) == {"b": [12, 13]}  # the bonus token fits
    prefilling = make_request("c", COPY)
    assert spec.plan([prefilling, decoding("d", [1, 2, 3])], 100) == {}  # no lookup match, and a prefill
    capped = Speculator(SpeculativeConfig(adaptive=False, disable_by_batch_size=1), max_model_len=64)
    assert capped.plan([r, decoding("e", COPY)], 100) == {}
    spec.record("a", 4, 3)
    spec.record("a", 4, 1, num_verified=2)  # two drafts cut by a constraint: not counted
    stats = spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_position == [2, 1, 1, 0]
    assert stats.mean_accepted_length == pytest.approx(1 + 4 / 2)


def costs(table: dict[int, float]) -> StepCosts:
    c = StepCosts()
    c.observe_all(table.items())
    return c


def test_step_costs_interpolate_and_bound_what_was_not_measured():
    c = costs({1: 0.020, 5: 0.024, 64: 0.128})
    assert c.seconds(3) == pytest.approx(0.022)
    assert c.seconds(128) == pytest.approx(0.256)  # beyond: in proportion to the rows
    c.observe(5, 0.050)  # a slower measurement moves the estimate a little
    assert 0.024 < c.seconds(5) < 0.030
    c.observe(5, 0.020)  # a faster one at once, by half
    assert c.seconds(5) < 0.025


# Measured on this project's 2-core Zen 5 machine: SmolLM2-135M Q4_1, float32, 256-token contexts.
SMOLLM2 = {1: 0.0199, 2: 0.0211, 4: 0.0267, 5: 0.0237, 8: 0.0331, 16: 0.0439, 20: 0.0517, 32: 0.0642,
           64: 0.1286, 128: 0.2167, 192: 0.3157, 256: 0.4209, 320: 0.5651}  # fmt: skip


def test_the_rule_drafts_where_it_pays_and_not_where_it_costs():
    step = costs(SMOLLM2).seconds

    def plan(num_requests: int, acceptance: float, k: int = 4) -> dict[str, int]:
        offers = [Offer(f"r{i}", acceptance, k) for i in range(num_requests)]
        return choose_drafts(offers, num_rows=num_requests, num_outputs=num_requests, step_seconds=step).counts

    assert plan(1, 0.86) == {"r0": 4}  # one request: 4 rows cost 19% more and yield ~3x
    assert plan(1, 0.2) == {"r0": 1}  # the first draft still pays, barely; longer ones do not
    assert sum(plan(4, 0.86).values()) >= 8
    assert plan(64, 0.5) == {}  # every row costs what a token does: drafts never pay
    assert plan(16, 0.1) == {}
    # A draft model's passes cost on top of the rows.
    draft = costs({1: 0.020, 64: 0.128}).seconds
    offers = [Offer("r0", 0.9, 4)]
    assert choose_drafts(offers, num_rows=1, num_outputs=1, step_seconds=step, draft_pass_seconds=draft).counts == {}
    cheap = costs({1: 0.002, 64: 0.02}).seconds
    assert choose_drafts(offers, num_rows=1, num_outputs=1, step_seconds=step, draft_pass_seconds=cheap).counts == {
        "r0": 4
    }
    # A gain asked for: 4 drafts at 0.9 promise 4.1x the tokens for 1.6x the seconds (2.57x).
    for min_gain, want in ((1.1, {"r0": 4}), (2.5, {"r0": 4}), (2.6, {})):
        got = choose_drafts(
            offers, num_rows=1, num_outputs=1, step_seconds=step, draft_pass_seconds=cheap, min_gain=min_gain
        ).counts
        assert got == want, min_gain


def test_a_draft_models_catch_up_is_priced_and_followed():
    """A draft model's first pass computes every position its cache lacks: a request far
    behind pays that (spread over the steps it has left), one that drafted last step not."""
    config = SpeculativeConfig(method="draft_model", model="/tmp", num_speculative_tokens=4)
    spec = Speculator(config, max_model_len=4096)
    spec.step_costs.observe_all(SMOLLM2.items())
    spec.draft_costs.observe_all({1: 0.002, 64: 0.02, 2048: 0.6}.items())  # a draft 10x cheaper
    every = [MODEL_DRAFT] * 4
    assert spec.plan([decoding("a", list(range(1, 12)))], 4000) == {"a": every}  # 10 behind: cheap
    for _ in range(6):
        spec.record("a", 4, 4)  # its drafts are all accepted
    # 1998 positions behind (0.58 s of draft): worth it over a long answer, not for 1 token.
    assert spec.plan([decoding("a", list(range(1, 2000)), max_tokens=2000)], 4000) == {"a": every}
    assert spec.plan([decoding("a", list(range(1, 2000)), max_tokens=2)], 4000) == {}
    # Having drafted 1 at 1999 tokens and kept it, its cache is 1 position behind: drafts pay.
    spec.record("a", 1, 1, num_tokens=1999)
    assert spec.plan([decoding("a", list(range(1, 2002)), max_tokens=2)], 4000) == {"a": [MODEL_DRAFT]}
    spec.drop_draft_cache("a")  # preempted: the draft starts it again from its first token
    assert spec.plan([decoding("a", list(range(1, 2002)), max_tokens=2)], 4000) == {}


def test_steps_with_drafts_dearer_than_their_costs_say_correct_the_rule():
    """Whatever the row-count costs miss, steps with drafts that measure 3x what they were
    expected to cost, while plain steps cost what they should, make drafting rarer."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=64)
    spec.step_costs.observe_all(SMOLLM2.items())
    requests = [decoding(f"r{i}", COPY) for i in range(4)]
    before = spec.plan(requests, 100)
    assert sum(map(len, before.values())) >= 8
    for _ in range(40):
        drafts = spec.plan(requests, 100)
        if not drafts:
            break
        out = SchedulerOutput([ScheduledRequest(r, 1, [0], drafts.get(r.request_id, [])) for r in requests])
        spec.observe(out, ModelRunnerOutput(execute_s=3 * spec.step_costs.seconds(out.num_tokens)))
        plain = SchedulerOutput([ScheduledRequest(r, 1, [0]) for r in requests])
        spec.observe(plain, ModelRunnerOutput(execute_s=spec.step_costs.seconds(4)))
    assert spec.cost_factor > 1.3
    assert sum(map(len, spec.plan(requests, 100).values())) < sum(map(len, before.values())) / 2
    for _ in range(300):  # plain steps only: the correction fades and drafting resumes
        spec.observe(plain, ModelRunnerOutput(execute_s=spec.step_costs.seconds(4)))
    assert spec.plan(requests, 100) == before


def test_adaptive_plan_follows_acceptance():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=64)
    spec.step_costs.observe_all(SMOLLM2.items())
    r = decoding("a", COPY)
    assert spec.plan([r], 100) == {"a": [12, 13, 14, 15]}
    for _ in range(6):
        spec.record("a", 4, 0)
    assert len(spec.plan([r], 100).get("a", [])) <= 1  # acceptance fell: one draft at most
    spec.forget("a")
    others = [decoding(f"b{i}", [1, 2, 3, 4, 5]) for i in range(64)]
    assert spec.plan(others, 1024) == {}  # no lookup matches: nothing to offer


def make_scheduler(num_blocks=64, budget=64, **config) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BS),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        speculator=Speculator(SpeculativeConfig(**{"adaptive": False, **config}), max_model_len=256),
    )


def runner_output(out: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """What a runner would return: ``tokens`` for the requests with drafts, 99 otherwise."""
    result = ModelRunnerOutput()
    for s in out.scheduled:
        if s.needs_sample:
            rid = s.request.request_id
            result.sampled_token_ids[rid] = tokens[rid] if s.draft_token_ids else tokens.get(rid, [99])[:1]
    return result


def test_draft_slots_reserved_and_rolled_back():
    sched = make_scheduler(num_speculative_tokens=4)
    r = make_request("a", COPY)  # 10 tokens: blocks [0..3] [4..7] [8, 9]
    sched.add_request(r)
    out = sched.schedule()  # the prefill: no drafts
    assert [s.draft_token_ids for s in out.scheduled] == [[]]
    sched.update_from_output(out, runner_output(out, {}))  # emits 99: no match any more
    assert r.all_token_ids[-1] == 99 and r.num_computed_tokens == 10
    r.all_token_ids[-1] = r.output_token_ids[-1] = 11  # make the suffix copy again: [.., 10, 11, 11]
    r.all_token_ids[-2] = 10
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 1 and s.draft_token_ids == [12, 13, 14, 15]
    assert out.num_tokens == 5 and len(s.block_ids) == 4  # slots for 11 + 4 drafts: positions up to 14
    # Two drafts accepted, then 50 instead of 14: three tokens out, num_computed moves 1 + 2.
    outputs = sched.update_from_output(out, runner_output(out, {"a": [12, 13, 50]}))
    assert outputs[0].new_token_ids == [12, 13, 50]
    assert r.num_computed_tokens == 13 and r.num_tokens == 14
    # Only blocks whose tokens are committed are hashed: [0..3], [4..7], [8..11]; not [12..].
    kv = sched.kv_cache_manager
    assert [kv.blocks[b].block_hash is not None for b in s.block_ids] == [True, True, True, False]
    assert sched.speculator is not None and sched.speculator.stats.num_accepted_tokens == 2


def test_stop_inside_the_accepted_drafts_ends_there():
    sched = make_scheduler(num_speculative_tokens=4)
    r = make_request("a", [5, 6, 7, 5, 6], stop_token_ids=[8])
    r.all_token_ids = [5, 6, 7, 5, 6]
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {}))
    r.all_token_ids[-1] = r.output_token_ids[-1] = 7  # [5, 6, 7, 5, 6, 7]: drafts 5, 6, 7
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [5, 6, 7]
    (o,) = sched.update_from_output(out, runner_output(out, {"a": [5, 8, 3, 4]}))
    assert o.new_token_ids == [5, 8] and o.stop_token_id == 8 and r.is_finished


def test_drafts_give_way_before_preemption_and_respect_the_budget():
    # 4 blocks of 4: "a" holds 3 blocks (11 tokens + 1 output), "b" holds 1 block.
    sched = make_scheduler(num_blocks=4, num_speculative_tokens=4)
    a = make_request("a", COPY + [12], max_tokens=4)
    b = make_request("b", [1, 2], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {}))
    a.all_token_ids[-1] = a.output_token_ids[-1] = 13  # suffix [12, 13] -> drafts 14, 15 (max_tokens)
    out = sched.schedule()
    # Drafts would need a 4th block for "a" (positions 12, 13); none is free, so "a"
    # decodes without them, and nobody is preempted for a draft.
    assert {s.request.request_id: s.draft_token_ids for s in out.scheduled} == {"a": [], "b": []}
    assert sched.num_preemptions == 0

    tight = make_scheduler(budget=3, num_speculative_tokens=4)
    c = make_request("c", COPY)
    tight.add_request(c)
    for _ in range(3):  # the prompt's first 9 tokens, in chunks of 3
        out = tight.schedule()
        assert [s.draft_token_ids for s in out.scheduled] == [[]]
        tight.update_from_output(out, runner_output(out, {}))
    # The last prompt token reaches the end: it may carry drafts, as many as the budget leaves.
    out = tight.schedule()
    assert out.scheduled[0].draft_token_ids == [12, 13] and out.num_tokens == 3


def test_draft_rows_sample_as_if_the_drafts_were_output(monkeypatch):
    """A draft row's view shows the earlier drafts as output tokens to every stage:
    penalties (presence, frequency, repetition), min_tokens and logprobs, against a
    request that really holds those tokens, on the same logits."""
    import torch

    from engine_svc.model.sample.sampler import Sampler
    from engine_svc.model.spec import PositionView

    vocab = 16
    logits = torch.zeros(1, vocab)
    logits[0, 5] = 1.0  # the best token, unless a penalty or a rule pushes it down
    logits[0, 6] = 0.9
    for params in (
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(repetition_penalty=2.0),
        dict(min_tokens=3, stop_token_ids=[5]),
    ):
        base = Request("r", [1, 2], SamplingParams(temperature=0.0, **params), eos_token_ids=(0,))
        base.append_output_token(3)
        view = PositionView(base, [5, 4])
        real = Request("r", [1, 2], SamplingParams(temperature=0.0, **params), eos_token_ids=(0,))
        for t in (3, 5, 4):
            real.append_output_token(t)
        got = Sampler(vocab, "cpu").sample(logits.repeat(2, 1), [base, view])
        want = Sampler(vocab, "cpu").sample(logits, [real])
        if "min_tokens" in params:  # 3 outputs with the drafts: the stop token is free again
            assert (got.token_ids, want.token_ids) == ([6, 5], [5]), params
        else:  # 5 is penalised where the drafts count, not in the base row
            assert (got.token_ids, want.token_ids) == ([5, 6], [6]), params
