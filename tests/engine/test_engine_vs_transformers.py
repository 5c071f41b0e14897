"""The whole engine (scheduler + KV cache + runner + sampler) against ``transformers``.

Greedy continuations of 24 prompts of mixed lengths must equal ``generate()`` of
transformers on the same random weights, in float32, under four scheduling regimes:
all prompts in one batch; a token budget small enough to chunk every prefill; shared
prefixes served from the prefix cache; a KV pool so small that requests are preempted
and recomputed. Where the two part at a position whose top two logits lie within 1e-4
(a near tie that float rounding may break either way), the comparison accepts it.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.types import FinishReason, SamplingParams
from tests.model_factory import load_hf_model, make_model_dir

NUM_NEW = 12
TIE_EPS = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp(request.param) / "model", arch=request.param, vocab_size=512)
    hf = load_hf_model(path)
    hf.greedy_cache = {}  # prompt -> continuation, shared by the regimes
    return path, hf


def _prompts(seed: int, *, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared_prefix)]
    lengths = [1, 2, 3, 5, 8, 13, 15, 16, 17, 31, 32, 33, 47, 64, 65, 90, 100, 127, 128, 129, 150, 180, 200, 255]
    return [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in hf.greedy_cache:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
            )
        hf.greedy_cache[key] = out[0, len(prompt) :].tolist()
    return hf.greedy_cache[key]


def _assert_same_or_near_tie(hf, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    if ours == theirs:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < TIE_EPS, f"diverged at output {i} with a top-2 logit gap of {gap:.2e}: {ours} vs {theirs}"


def _engine(path, **overrides) -> EngineCore:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        num_kv_blocks=overrides.pop("num_kv_blocks", 512),
        block_size=16,
        max_num_seqs=overrides.pop("max_num_seqs", 64),
        **overrides,
    )
    return EngineCore(config)


REGIMES = {
    "one_batch": dict(max_num_batched_tokens=8192),
    "chunked_prefill": dict(max_num_batched_tokens=24),
    "prefix_cache": dict(max_num_batched_tokens=512),
    "preemption": dict(max_num_batched_tokens=256, num_kv_blocks=28),
}


def _assert_kernels(core: EngineCore, kernels: str) -> None:
    """The path under test is the one that ran: with ``auto`` the native kernels (a C
    compiler is part of the test set-up) for matmuls, norms, RoPE and both attentions;
    with ``torch`` none of them."""
    runner = core.runner
    if kernels == "torch":
        assert runner.matmuls == "torch" and runner.kernels is None
    else:
        assert runner.kernels is not None and runner.matmuls != "torch" and runner.native_prefill


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(model, regime, kernels):
    path, hf = model
    prompts = _prompts(7, shared_prefix=40 if regime == "prefix_cache" else 0)
    core = _engine(path, kernels=kernels, **REGIMES[regime])
    _assert_kernels(core, kernels)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    if regime == "prefix_cache":
        # Warm the cache with the shared prefix first, so every prompt then hits it.
        core.generate([prompts[0]], params)
    results = core.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == FinishReason.LENGTH
        _assert_same_or_near_tie(hf, prompt, result.output_token_ids, _hf_greedy(hf, prompt))
    if regime == "prefix_cache":
        assert all(r.num_cached_tokens >= 32 for r in results[1:]), [r.num_cached_tokens for r in results]
    if regime == "preemption":
        assert core.scheduler.num_preemptions > 0
    assert core.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_prompt_and_output_logprobs_match_transformers(model, kernels):
    path, hf = model
    core = _engine(path, max_num_batched_tokens=40, kernels=kernels)  # prompts arrive in chunks
    _assert_kernels(core, kernels)
    prompts = _prompts(3)[8:14]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for prompt, result in zip(prompts, core.generate(prompts, params)):
        full = prompt + result.output_token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
        assert [lp.token_id for lp in result.prompt_logprobs] == prompt[1:]
        for pos, lp in enumerate(result.prompt_logprobs):
            assert abs(lp.logprob - ref[pos, prompt[pos + 1]].item()) < 1e-4
            assert len(lp.top) == 2 and abs(lp.top[0][1] - ref[pos].max().item()) < 1e-4
        for i, lp in enumerate(result.logprobs):
            pos = len(prompt) - 1 + i
            assert lp.token_id == full[pos + 1] and lp.rank == 1  # greedy picks the best
            assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-4
            assert len(lp.top) == 3


def test_seeded_sampling_is_reproducible(model):
    path, _ = model
    prompts = _prompts(5)[4:12]
    seeded = [
        SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    first = [r.output_token_ids for r in _engine(path).generate(prompts, seeded)]
    # A different batch composition and a different engine instance.
    second = [
        r.output_token_ids for r in _engine(path, max_num_batched_tokens=32).generate(prompts[::-1], seeded[::-1])
    ]
    assert first == second[::-1]
    other = _engine(path).generate(
        prompts,
        [SamplingParams(max_tokens=10, temperature=1.0, seed=999 + i, ignore_eos=True) for i in range(len(prompts))],
    )
    assert [r.output_token_ids for r in other] != first
