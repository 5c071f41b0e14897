"""Structured output through EngineCore on the demo model (random weights, gibberish text).

The demo model's raw output is invalid for every constraint here, which the first test
shows on the same prompts; with a constraint every finished output must parse. All
requests of a test run in one batch. Preemption and prefix-cache hits are tested through
the public API (tests/rpc/test_structured_output_rpc.py).
"""

from __future__ import annotations

import re
import threading

import pytest
from tokenizers import Tokenizer

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.types import ErrorCode, FinishReason, SamplingParams
from tandem_common.sampling import StructuredOutput
from tests.structured_cases import CONSTRAINTS, VALID

NUM_PROMPTS = 20


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def core(demo_model_dir) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(demo_model_dir), num_kv_blocks=1024, max_num_seqs=256))
    yield core
    core.structured.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(f"Request {i}: describe item {i * 7} of the order").ids for i in range(NUM_PROMPTS)]


def _text(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def test_every_finished_output_follows_its_constraint_and_free_text_does_not(core, tokenizer, prompts):
    """20 prompts x (greedy, seeded temperature 1) x 4 constraints, plus the same prompts
    unconstrained, in one batch."""
    jobs = []  # (kind, mode, params)
    for kind, constraint in CONSTRAINTS.items():
        for mode in ("greedy", "sampled"):
            for i in range(NUM_PROMPTS):
                temperature = 0.0 if mode == "greedy" else 1.0
                params = SamplingParams(max_tokens=80, temperature=temperature, seed=i, structured=constraint)
                jobs.append((kind, mode, params))
    for mode in ("greedy", "sampled"):
        for i in range(NUM_PROMPTS):
            params = SamplingParams(max_tokens=24, temperature=0.0 if mode == "greedy" else 1.0, seed=i)
            jobs.append(("free", mode, params))
    results = core.generate([prompts[i % NUM_PROMPTS] for i in range(len(jobs))], [p for _, _, p in jobs])

    free = [_text(tokenizer, c.output_token_ids) for (kind, _, _), c in zip(jobs, results) if kind == "free"]
    for kind, valid in VALID.items():
        assert not any(valid(text) for text in free), f"unconstrained output passes the {kind} check"

    for kind in CONSTRAINTS:
        for mode in ("greedy", "sampled"):
            done = [c for (k, m, _), c in zip(jobs, results) if (k, m) == (kind, mode)]
            assert all(c.error is None for c in done), [c.error for c in done if c.error]
            finished = [c for c in done if c.finish_reason == FinishReason.STOP]
            # A JSON number's fraction and the arithmetic grammar's recursion have no bound,
            # so a few outputs may run into max_tokens; most must end.
            assert len(finished) >= NUM_PROMPTS * 3 // 4, (kind, mode, len(finished))
            for c in finished:
                text = _text(tokenizer, c.output_token_ids)
                assert VALID[kind](text), (kind, mode, text)
                assert c.stop_token_id in core.eos_token_ids  # the grammar's end is an EOS
            if kind == "choice" and mode == "greedy":
                assert len({_text(tokenizer, c.output_token_ids) for c in done}) >= 2, (
                    "the mask must not pick for the model"
                )


def test_bad_constraints_fail_alone_in_band(core, prompts):
    bad = {
        "json_schema": StructuredOutput("json_schema", '{"type": "strng"}'),
        "regex": StructuredOutput("regex", "[a-"),
        "grammar": StructuredOutput("grammar", "start: expr\n"),
        "gbnf": StructuredOutput("grammar", 'root ::= "a" missing', grammar_syntax="gbnf"),
    }
    good = SamplingParams(max_tokens=8, temperature=0.0, structured=CONSTRAINTS["regex"])
    params = (
        [good] + [SamplingParams(max_tokens=8, structured=c) for c in bad.values()] + [SamplingParams(max_tokens=8)]
    )
    results = core.generate([prompts[0]] * len(params), params)
    assert results[0].error is None and results[0].finish_reason == FinishReason.STOP
    assert results[-1].error is None and len(results[-1].output_token_ids) == 8
    messages = {}
    for name, c in zip(bad, results[1:-1]):
        assert c.finish_reason == FinishReason.ERROR and c.output_token_ids == []
        assert c.error.code == ErrorCode.INVALID_ARGUMENT
        messages[name] = c.error.message
    assert messages["json_schema"] == "sampling_params.json_schema: Invalid type: strng"
    assert messages["regex"].startswith("sampling_params.regex:") and "unclosed character class" in messages["regex"]
    assert messages["grammar"].startswith("sampling_params.grammar:") and 'unknown name: "expr"' in messages["grammar"]
    assert "missing" in messages["gbnf"]
    # Compile errors are cached like grammars: the same bad schema fails again without a compile.
    hits = core.structured.stats().num_cache_hits
    again = core.generate([prompts[0]], SamplingParams(structured=bad["json_schema"]))
    assert again[0].error.message == messages["json_schema"] and core.structured.stats().num_cache_hits == hits + 1


class _GatedBackend:
    """The real backend, whose compiles wait until the test opens the gate."""

    def __init__(self, backend) -> None:
        self.backend, self.gate = backend, threading.Event()
        self.name = backend.name

    def compile(self, constraint):
        assert self.gate.wait(30)
        return self.backend.compile(constraint)


def test_a_compiling_request_waits_outside_the_scheduler_while_others_run(core, prompts):
    real = core.structured.backend
    gated = core.structured.backend = _GatedBackend(real)
    try:
        fresh = StructuredOutput("regex", r"[a-z]{3}-waiting")
        assert core.add_request(core.make_request("waits", prompts[0], SamplingParams(structured=fresh))) is None
        assert core.add_request(core.make_request("runs", prompts[1], SamplingParams(max_tokens=3))) is None
        outputs = [o for _ in range(3) for o in core.step()]
        assert [o.request_id for o in outputs] == ["runs"] * 3 and outputs[-1].finished
        assert core.structured.num_waiting == 1 and core.scheduler.num_waiting == 0
        assert core.make_stats().num_waiting == 1 and core.has_unfinished_requests() and not core.has_work()
        gated.gate.set()
        core.structured.wait(30)
        assert core.has_work()
        texts = []
        while core.has_unfinished_requests():
            texts += [t for o in core.step() for t in o.new_token_ids]
        assert texts and core.structured.num_waiting == 0
    finally:
        gated.gate.set()
        core.structured.backend = real


def test_a_compile_past_the_timeout_fails_its_request_and_an_abort_reaches_a_waiting_request(core, prompts):
    real = core.structured.backend
    gated = core.structured.backend = _GatedBackend(real)
    timeout = core.structured.timeout_s
    core.structured.timeout_s = 0.05
    try:
        slow = SamplingParams(structured=StructuredOutput("regex", r"[0-9]{2}-timeout"))
        aborted = SamplingParams(structured=StructuredOutput("regex", r"[0-9]{2}-aborted"))
        core.add_request(core.make_request("slow", prompts[0], slow))
        core.add_request(core.make_request("aborted", prompts[0], aborted))
        core.add_request(core.make_request("free", prompts[1], SamplingParams(max_tokens=2)))
        [out] = core.abort(["aborted"])
        assert out.finish_reason == FinishReason.ABORT
        assert 0 < core.seconds_to_next_event() <= 0.05
        results = {}
        while core.has_unfinished_requests():
            if not core.has_work():
                core.structured.wait(core.seconds_to_next_event())
            results.update({o.request_id: o for o in core.step() if o.finished})
        assert results["free"].error is None and results["free"].finish_reason == FinishReason.LENGTH
        assert results["slow"].error.code == ErrorCode.INVALID_ARGUMENT
        assert (
            "longer than this engine's limit of 0.05 s (--structured-output-timeout-s)" in results["slow"].error.message
        )
        assert core.structured.stats().num_timeouts >= 1
    finally:
        gated.gate.set()
        core.structured.timeout_s = timeout
        core.structured.backend = real


def test_the_grammar_end_wins_over_min_tokens_and_ignore_eos(core, tokenizer, prompts):
    choice = StructuredOutput("choice", choices=("yes", "no"))
    letters = StructuredOutput("regex", "[ab]{1,5}")
    params = [
        SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0, structured=choice),
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, structured=choice),
        # ignore_eos holds EOS back while the grammar may go on: the output is as long as it allows.
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=3, structured=letters),
        SamplingParams(max_tokens=20, min_tokens=20, temperature=1.0, seed=4, structured=letters),
    ]
    results = core.generate([prompts[0]] * len(params), params)
    texts = [_text(tokenizer, c.output_token_ids) for c in results]
    assert all(c.finish_reason == FinishReason.STOP for c in results), [c.finish_reason for c in results]
    assert texts[0] in ("yes", "no") and texts[1] in ("yes", "no")
    assert re.fullmatch("[ab]{5}", texts[2]) and re.fullmatch("[ab]{5}", texts[3]), texts


def test_a_choice_cut_by_max_tokens_ends_with_length_and_incomplete_text(core, tokenizer, prompts):
    long_choice = StructuredOutput("choice", choices=("a rather long answer that needs many tokens", "x"))
    bias_to_long = {tokenizer.encode("a").ids[0]: 100.0}
    [c] = core.generate(
        [prompts[0]], SamplingParams(max_tokens=3, temperature=0.0, logit_bias=bias_to_long, structured=long_choice)
    )
    text = _text(tokenizer, c.output_token_ids)
    assert c.finish_reason == FinishReason.LENGTH and len(c.output_token_ids) == 3
    assert (
        "a rather long answer that needs many tokens".startswith(text)
        and text != "a rather long answer that needs many tokens"
    )


def test_logit_bias_cannot_bring_back_a_masked_token_but_steers_among_allowed_ones(core, tokenizer, prompts):
    choice = StructuredOutput("choice", choices=("yes", "no"))
    forbidden = tokenizer.encode("maybe").ids[0]
    no = tokenizer.encode("no").ids[0]
    results = core.generate(
        [prompts[0]] * 2,
        [
            SamplingParams(max_tokens=4, temperature=0.0, logit_bias={forbidden: 100.0}, structured=choice),
            SamplingParams(max_tokens=4, temperature=0.0, logit_bias={no: 100.0}, structured=choice),
        ],
    )
    assert _text(tokenizer, results[0].output_token_ids) in ("yes", "no")
    assert _text(tokenizer, results[1].output_token_ids) == "no"


def test_seeded_sampling_is_reproducible_under_a_constraint(core, prompts):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=42, structured=CONSTRAINTS["json_schema"])
    first, second = core.generate([prompts[3], prompts[3]], [params, params])
    assert first.output_token_ids == second.output_token_ids


def test_an_engine_without_structured_output_refuses_constraints(demo_model_dir, prompts):
    core = EngineCore(EngineConfig(model=str(demo_model_dir), num_kv_blocks=16, structured_output=False))
    [c] = core.generate([prompts[0]], SamplingParams(structured=CONSTRAINTS["regex"]))
    assert c.error.code == ErrorCode.INVALID_ARGUMENT
    assert c.error.message == (
        "sampling_params.regex: this engine serves no structured output: it was started with --no-structured-output"
    )
