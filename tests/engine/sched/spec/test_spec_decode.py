"""Speculative decoding end to end in the engine: outputs with drafts equal outputs
without, on real random-weight models, across the features that move KV and counters.

Two models: a small-init one whose greedy output falls into loops, so prompt lookup is
mostly right (high acceptance), and the demo model, whose output wanders (low
acceptance). Every comparison runs the same requests on two cores, speculation off and
on, in float32.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter

import pytest
from scipy.stats import chi2_contingency
from tokenizers import Tokenizer

from engine_svc.config import EngineConfig
from engine_svc.core import Completion, EngineCore
from engine_svc.demo_model import VOCAB_SIZE as DEMO_VOCAB
from engine_svc.lora_registry import LoraConfig
from engine_svc.sched.spec import SpecStats, SpeculativeConfig
from engine_svc.types import FinishReason, SamplingParams
from tests.lora_factory import make_adapter
from tests.model_factory import make_model_dir
from tests.structured_cases import CONSTRAINTS, VALID

VOCAB = 512
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)


@pytest.fixture(scope="module")
def loop_model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("spec") / "loop", vocab_size=VOCAB, initializer_range=0.02, seed=1)


def run(
    model_dir, prompts, params, spec: SpeculativeConfig | None, *, repeat: int = 1, lora_names=None, **config
) -> tuple[list[Completion], SpecStats | None, EngineCore]:
    settings = {"num_kv_blocks": 512, "block_size": 16, "dtype": "float32", "max_num_seqs": 64, **config}
    core = EngineCore(EngineConfig(model=str(model_dir), speculative_config=spec, **settings))
    for _ in range(repeat):  # later rounds hit the prefix cache
        completions = core.generate(prompts, params, lora_names)
    speculator = core.scheduler.speculator
    return completions, None if spec is None else speculator.stats, core


def prompts_of(seed: int, num: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


def tokens(completions: list[Completion]) -> list[list[int]]:
    return [c.output_token_ids for c in completions]


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

CASES = {
    "batch of 64": dict(prompts=prompts_of(0, 64, 4, 40)),
    "chunked prefill": dict(prompts=prompts_of(1, 6, 40, 90), max_num_batched_tokens=24),
    "prefix-cache hits": dict(
        prompts=[p + q for p, q in zip(prompts_of(2, 4, 40, 41) * 2, prompts_of(3, 8, 3, 9))], repeat=2
    ),
    "preemption": dict(prompts=prompts_of(4, 8, 30, 40), num_kv_blocks=14),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_identical_with_speculation(loop_model_dir, case):
    kw = dict(CASES[case])
    prompts = kw.pop("prompts")
    off, _, core_off = run(loop_model_dir, prompts, GREEDY, None, **kw)
    on, stats, core_on = run(loop_model_dir, prompts, GREEDY, SPEC, **kw)
    assert tokens(on) == tokens(off)
    assert stats is not None and stats.num_accepted_tokens > 0 and stats.acceptance_rate > 0.3, stats
    if case == "preemption":
        assert core_off.scheduler.num_preemptions > 0 and core_on.scheduler.num_preemptions > 0
    if case == "prefix-cache hits":
        assert all(c.num_cached_tokens >= 32 for c in on)


def test_low_acceptance_model_is_exact_too(demo_model_dir):
    prompts = prompts_of(5, 8, 20, 60)
    off, _, _ = run(demo_model_dir, prompts, GREEDY, None)
    on, stats, _ = run(demo_model_dir, prompts, GREEDY, SPEC)
    assert tokens(on) == tokens(off)
    assert stats is not None and stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.3, stats


def test_stop_tokens_max_tokens_and_logprobs_hold(loop_model_dir):
    prompts = prompts_of(6, 8, 5, 30)
    probe, _, _ = run(loop_model_dir, prompts, GREEDY, None)
    # Stop tokens each request meets in the middle of its loop, and a max_tokens inside a draft.
    params = [
        SamplingParams(temperature=0.0, max_tokens=5 + i, stop_token_ids=[c.output_token_ids[20]], logprobs=3)
        for i, c in enumerate(probe)
    ]
    params += [
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, stop_token_ids=[c.output_token_ids[3]])
        for c in probe
    ]
    off, _, _ = run(loop_model_dir, prompts * 2, params, None)
    on, stats, _ = run(loop_model_dir, prompts * 2, params, SPEC)
    assert stats is not None and stats.num_accepted_tokens > 0
    assert tokens(on) == tokens(off)
    assert [(c.finish_reason, c.stop_token_id) for c in on] == [(c.finish_reason, c.stop_token_id) for c in off]
    for a, b in zip(on, off):
        assert len(a.logprobs) == len(b.logprobs) == (len(a.output_token_ids) if a.logprobs else 0)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and x.rank == y.rank
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [lp for _, lp in x.top] == pytest.approx([lp for _, lp in y.top], abs=1e-5)


# A repeated pattern, and a bias towards its tokens: drafts (the pattern's next tokens)
# are often but not always what the sampler picks, so both acceptance and rejection happen.
PATTERN = [5, 6, 7, 8]
BIAS = {t: 4.0 for t in PATTERN}


def test_seeded_sampling_identical_with_speculation(loop_model_dir):
    prompts = [PATTERN * 4 + [5]] * 16
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i, max_tokens=24, logit_bias=BIAS)
        for i in range(16)
    ]
    off, _, _ = run(loop_model_dir, prompts, params, None)
    on, stats, _ = run(loop_model_dir, prompts, params, SPEC)
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert tokens(on) == tokens(off)


def test_sampled_distribution_kept(loop_model_dir):
    """Chi-square test of homogeneity (scipy's chi2_contingency) of the tokens at output
    positions 1-3 (the ones drafts are verified for), 3000 unseeded runs per arm; tokens
    seen fewer than 10 times in all are pooled. The arms' draws are independent, so a true
    equality fails each position's test with probability 1e-3."""
    num_runs = 3000
    prompts = [PATTERN * 4 + [5]] * num_runs
    # Two likely tokens (about 40% each): the draft after 5, 6 is 7, right that often.
    bias = {6: 7.0, 7: 7.0}
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias=bias)
    off, _, _ = run(loop_model_dir, prompts, params, None, max_waiting=num_runs)
    on, stats, _ = run(loop_model_dir, prompts, params, SPEC, max_waiting=num_runs)
    assert all(len(c.output_token_ids) == 4 for c in off + on)
    assert stats is not None and stats.num_accepted_tokens > 300 and stats.num_accepted_tokens < stats.num_draft_tokens
    for position in (1, 2, 3):
        a = Counter(c.output_token_ids[position] for c in off)
        b = Counter(c.output_token_ids[position] for c in on)
        common = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
        rest_a = num_runs - sum(a[t] for t in common)
        rest_b = num_runs - sum(b[t] for t in common)
        table = [[a[t] for t in common] + [rest_a], [b[t] for t in common] + [rest_b]]
        p_value = chi2_contingency(table).pvalue
        print(f"position {position}: chi-square p = {p_value:.3f} over {len(common) + 1} bins")
        assert p_value > 1e-3, (position, p_value, table)


@pytest.fixture(scope="module")
def loop_model_with_tokenizer(tmp_path_factory, demo_model_dir):
    """The loop-prone model with the demo vocabulary and tokenizer, so grammars compile."""
    path = make_model_dir(tmp_path_factory.mktemp("spec") / "loop-tok", vocab_size=DEMO_VOCAB, initializer_range=0.02)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / name, path / name)
    return path


def test_structured_output_valid_and_identical(loop_model_with_tokenizer, demo_model_dir):
    """Every constraint kind, greedy and seeded: outputs equal with drafts on and off, all
    valid, and drafts were accepted inside constrained outputs (the grammar advanced
    through them) and cut or rejected where it forbids them."""
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    prompts, params = [], []
    for kind, constraint in CONSTRAINTS.items():
        for i in range(6):
            prompts.append(tokenizer.encode(f"item {i} of {kind}: ").ids)
            temperature = 0.0 if i % 2 == 0 else 0.8
            params.append(SamplingParams(max_tokens=80, temperature=temperature, seed=i, structured=constraint))
    off, _, core_off = run(loop_model_with_tokenizer, prompts, params, None)
    on, stats, core_on = run(loop_model_with_tokenizer, prompts, params, SPEC)
    for core in (core_off, core_on):
        core.structured.shutdown()
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert tokens(on) == tokens(off)
    kinds = [kind for kind in CONSTRAINTS for _ in range(6)]
    for kind, c in zip(kinds, on):
        assert c.error is None, c.error
        if c.finish_reason == FinishReason.STOP:
            # This model's EOS id (2) is an ordinary token of the demo tokenizer: drop it.
            assert c.output_token_ids[-1] == c.stop_token_id
            text = tokenizer.decode(c.output_token_ids[:-1], skip_special_tokens=True)
            assert VALID[kind](text), (kind, text)


def test_penalties_identical_with_speculation(loop_model_dir):
    """Repetition, presence and frequency penalties count each draft row's earlier drafts
    as output tokens: greedy and seeded outputs equal with drafts on and off."""
    prompts = prompts_of(7, 12, 5, 30)
    params = [
        SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            temperature=0.0 if i % 2 == 0 else 0.7,
            seed=i,
            repetition_penalty=(1.0, 1.1, 1.3)[i % 3],
            frequency_penalty=(0.0, 0.2)[i % 2],
            presence_penalty=(0.0, 0.3, 0.0, 0.5)[i % 4],
        )
        for i in range(12)
    ]
    off, _, _ = run(loop_model_dir, prompts, params, None)
    on, stats, _ = run(loop_model_dir, prompts, params, SPEC)
    assert stats is not None and 0 < stats.num_accepted_tokens, stats
    assert tokens(on) == tokens(off)


def test_lora_adapters_identical_with_speculation(loop_model_dir, tmp_path):
    """Draft rows are computed under their request's adapter: a batch mixing the base
    model and two adapters, each prompt under all three, gives the same greedy outputs
    with drafts on and off. The adapters' B is drawn small (b_scale 0.3), so that their
    outputs still loop and prompt lookup's drafts for them are accepted too; they still
    change every output."""
    adapters = {
        name: str(make_adapter(loop_model_dir, tmp_path / name, r=r, alpha=2 * r, seed=seed, b_scale=0.3))
        for name, r, seed in (("a", 4, 1), ("b", 8, 2))
    }
    lora = dict(enable_lora=True, lora=LoraConfig(modules=tuple(adapters.items())))
    names = [None, "a", "b"] * 4
    prompts = [p for p in prompts_of(8, 4, 5, 30) for _ in range(3)]
    off, _, _ = run(loop_model_dir, prompts, GREEDY, None, lora_names=names, **lora)
    on, stats, _ = run(loop_model_dir, prompts, GREEDY, SPEC, lora_names=names, **lora)
    assert tokens(on) == tokens(off)
    assert stats is not None and stats.acceptance_rate > 0.3, stats
    base, a, b = tokens(on)[0::3], tokens(on)[1::3], tokens(on)[2::3]
    assert all(x != y and x != z for x, y, z in zip(base, a, b))  # each adapter changes each output
    # Drafts were accepted under the adapters, not only for the base model's requests.
    _, adapter_stats, _ = run(loop_model_dir, prompts[1::3], GREEDY, SPEC, lora_names=names[1::3], **lora)
    assert adapter_stats is not None and adapter_stats.acceptance_rate > 0.2, adapter_stats
