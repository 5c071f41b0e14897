"""Speculative decoding with a draft model, end to end in the engine: greedy and seeded
outputs equal outputs without drafts, sampled outputs keep their distribution (rejection
sampling against the draft's q), every constraint stays valid, and a draft model with
another vocabulary is refused by name.

Drafts: the target itself (every greedy draft right), a copy with noise on its weights
(often right), another random model with the same vocabulary (almost never right). Every
comparison runs the same requests on two cores, draft model off and on, in float32, with
``adaptive: false``, so that every decoding request drafts whatever the step costs.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2_contingency, chisquare
from tokenizers import Tokenizer

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.demo_model import VOCAB_SIZE as DEMO_VOCAB
from engine_svc.model.sample.sampler_stages import exponential_race, rejection_sample
from engine_svc.sched.spec import SpeculativeConfig
from engine_svc.types import FinishReason, SamplingParams
from tests.engine.sched.spec.test_spec_decode import CASES, GREEDY, PATTERN, VOCAB, prompts_of, run, tokens
from tests.model_factory import make_model_dir
from tests.structured_cases import CONSTRAINTS, VALID

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def spec(draft_dir, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=k, adaptive=False)


def noisy_copy(source, target, scale: float):
    """``source``'s checkpoint with Gaussian noise of ``scale`` x each matrix's spread."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    noisy = {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in weights.items()
    }
    save_file(noisy, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-draft")
    loop = make_model_dir(root / "loop", vocab_size=VOCAB, initializer_range=0.02, seed=1)
    return {
        "target": loop,
        "other": make_model_dir(root / "other", vocab_size=VOCAB, initializer_range=0.02, seed=7),
        "noisy": noisy_copy(loop, root / "noisy", 0.2),
    }


@pytest.fixture(scope="module")
def without_drafts(models):
    """Greedy outputs of every case without speculation, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(case: str) -> list[list[int]]:
        if case not in cache:
            kw = dict(CASES[case])
            cache[case] = tokens(run(models["target"], kw.pop("prompts"), GREEDY, None, **kw)[0])
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("draft", ["target", "other"])
def test_greedy_outputs_identical_with_a_draft_model(models, without_drafts, draft, case):
    kw = dict(CASES[case])
    prompts = kw.pop("prompts")
    on, stats, core = run(models["target"], prompts, GREEDY, spec(models[draft]), **kw)
    assert tokens(on) == without_drafts(case)
    assert stats is not None and stats.num_draft_tokens > 100, stats
    if draft == "target":  # the same model in the same arithmetic: every draft is its argmax
        assert stats.acceptance_rate == 1.0, stats
    else:
        assert stats.acceptance_rate < 0.1, stats
    if case == "preemption":
        assert core.scheduler.num_preemptions > 0
    if case == "prefix-cache hits":
        assert all(c.num_cached_tokens >= 32 for c in on)


def test_rejection_sampling_draws_from_p():
    """The stage alone: drafts drawn from q, judged against p, are distributed as p
    (chi-square goodness of fit over 200,000 draws), and kept sum(min(p, q)) of the time."""
    g = torch.Generator().manual_seed(0)
    n, vocab = 200_000, 8
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    draft = exponential_race(q.expand(n, vocab).contiguous(), torch.rand(n, vocab, generator=g))
    tokens_, kept = rejection_sample(
        p.expand(n, vocab), q.expand(n, vocab), draft, torch.rand(n, generator=g), torch.rand(n, vocab, generator=g)
    )
    counts = torch.bincount(tokens_, minlength=vocab).double()
    p_value = chisquare(counts.numpy(), (p.double() * n).numpy()).pvalue
    assert p_value > 1e-3, (p_value, counts / n, p)
    assert kept.double().mean().item() == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.005)


def test_sampled_distribution_kept_with_a_draft_model(models):
    """Chi-square test of homogeneity (scipy's chi2_contingency) of the tokens at output
    positions 1-3 (the ones drafts are verified for), 3000 unseeded runs per arm; the noisy
    draft is accepted about half the time, so both kept drafts and residual draws count.
    Tokens seen fewer than 10 times in all are pooled."""
    num_runs = 3000
    prompts = [PATTERN * 4 + [5]] * num_runs
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=4, ignore_eos=True)
    off, _, _ = run(models["target"], prompts, params, None, max_waiting=num_runs)
    on, stats, _ = run(models["target"], prompts, params, spec(models["noisy"], k=3), max_waiting=num_runs)
    assert all(len(c.output_token_ids) == 4 for c in off + on)
    assert stats is not None and 0.3 < stats.acceptance_rate < 0.9, stats
    for position in (1, 2, 3):
        a = Counter(c.output_token_ids[position] for c in off)
        b = Counter(c.output_token_ids[position] for c in on)
        common = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
        table = [[a[t] for t in common], [b[t] for t in common]]
        rest = [num_runs - sum(row) for row in table]
        if sum(rest):
            table = [row + [r] for row, r in zip(table, rest)]
        p_value = chi2_contingency(table).pvalue
        print(f"position {position}: chi-square p = {p_value:.3f} over {len(table[0])} bins")
        assert p_value > 1e-3, (position, p_value, table)


def test_seeded_sampling_logprobs_and_penalties_identical(models):
    """Seeded rows keep their own draws (a draft is kept where it equals them), so their
    tokens equal those without drafts; logprobs are the target's, within 1e-5."""
    prompts = prompts_of(7, 12, 5, 30)
    params = [
        SamplingParams(
            max_tokens=32,
            ignore_eos=True,
            temperature=0.0 if i % 3 == 0 else 0.8,
            seed=i,
            logprobs=2,
            repetition_penalty=(1.0, 1.2)[i % 2],
            presence_penalty=(0.0, 0.3, 0.0, 0.5)[i % 4],
        )
        for i in range(12)
    ]
    off, _, _ = run(models["target"], prompts, params, None)
    on, stats, _ = run(models["target"], prompts, params, spec(models["noisy"]))
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert tokens(on) == tokens(off)
    for a, b in zip(on, off):
        assert len(a.logprobs) == len(b.logprobs) == len(a.output_token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [lp for _, lp in x.top] == pytest.approx([lp for _, lp in y.top], abs=1e-5)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, demo_model_dir):
    """A target and a different draft with the demo vocabulary and tokenizer, so grammars compile."""
    root = tmp_path_factory.mktemp("spec-draft-tok")
    target = make_model_dir(root / "target", vocab_size=DEMO_VOCAB, initializer_range=0.02, seed=2)
    draft = noisy_copy(target, root / "draft", 0.2)
    for path in (target, draft):
        for name in TOKENIZER_FILES:
            shutil.copy(demo_model_dir / name, path / name)
        # The tokenizer's BOS / EOS, not the factory's ids 1 / 2 (plain characters here: a
        # sampled "#" would end a JSON string as if it were EOS).
        for name in ("config.json", "generation_config.json"):
            config, demo = (json.loads((d / name).read_text()) for d in (path, demo_model_dir))
            config.update({k: demo[k] for k in ("bos_token_id", "eos_token_id")})
            (path / name).write_text(json.dumps(config))
    return target, draft


def test_structured_output_valid_with_a_draft_model(tokenized, demo_model_dir):
    """Every constraint kind: greedy and seeded outputs equal without drafts, unseeded
    sampled ones (rejection sampling) valid too."""
    target, draft = tokenized
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    prompts, params = [], []
    for kind, constraint in CONSTRAINTS.items():
        for i in range(6):
            prompts.append(tokenizer.encode(f"item {i} of {kind}: ").ids)
            temperature, seed = ((0.0, None), (0.8, i), (0.8, None))[i % 3]
            params.append(SamplingParams(max_tokens=80, temperature=temperature, seed=seed, structured=constraint))
    off, _, core_off = run(target, prompts, params, None)
    on, stats, core_on = run(target, prompts, params, spec(draft))
    for core in (core_off, core_on):
        core.structured.shutdown()
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    exact = [i for i, p in enumerate(params) if p.seed is not None or p.temperature == 0.0]
    assert [on[i].output_token_ids for i in exact] == [off[i].output_token_ids for i in exact]
    kinds = [kind for kind in CONSTRAINTS for _ in range(6)]
    for kind, c in zip(kinds, on):
        assert c.error is None, c.error
        if c.finish_reason == FinishReason.STOP:
            text = tokenizer.decode(c.output_token_ids[:-1], skip_special_tokens=True)
            assert VALID[kind](text), (kind, text)


def test_a_draft_model_with_another_vocabulary_is_refused(models, tokenized, tmp_path):
    small = make_model_dir(tmp_path / "small", vocab_size=VOCAB // 2, initializer_range=0.02)
    with pytest.raises(ValueError, match=r"the draft model's vocabulary has 256 ids, the target's 512"):
        EngineCore(EngineConfig(model=str(models["target"]), dtype="float32", speculative_config=spec(small)))
    target, draft = tokenized
    renamed = tmp_path / "renamed"
    shutil.copytree(draft, renamed)
    tokenizer = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[first], vocab[second] = 301, 300  # two ids swapped: a different vocabulary of the same size
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=rf"token id 300 is {second!r} for the draft model and {first!r}"):
        EngineCore(EngineConfig(model=str(target), dtype="float32", speculative_config=spec(renamed)))


def test_warm_up_times_the_steps_the_adaptive_rule_weighs(models):
    """Start-up calibration fills the cost tables (the target's steps by rows, the draft's
    passes by rows); whatever the rule then decides, greedy outputs stay the same."""
    config = SpeculativeConfig(method="draft_model", model=str(models["noisy"]), num_speculative_tokens=2)
    settings = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    core = EngineCore(EngineConfig(model=str(models["target"]), speculative_config=config, **settings))
    core.warmup()
    speculator = core.scheduler.speculator
    assert speculator is not None
    steps, passes = speculator.step_costs.table(), speculator.draft_costs.table()
    assert list(steps)[:8] == list(range(1, 9)) and max(steps) == 4 * 3 and all(t > 0 for t in steps.values())
    assert list(passes) == [1, 2, 3, 4] and all(t > 0 for t in passes.values())
    prompts = prompts_of(8, 6, 5, 30)
    adaptive = tokens(core.generate(prompts, GREEDY))
    assert adaptive == tokens(run(models["target"], prompts, GREEDY, None, **settings)[0])
