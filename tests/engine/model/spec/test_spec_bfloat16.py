"""Speculative decoding is exact in bfloat16 too: greedy and seeded outputs equal the
outputs without drafts, with prompt lookup and with a draft model.

A bfloat16 value's step is 2^-8 to 2^-7 of it, so two computations of a token that differ
in their last float32 bit now and then differ by a whole bfloat16 step, enough to turn a
near tie. Speculation moves work between the engine's kernels: a draft is verified
as a decode row, a request preempted at another moment recomputes its output tokens in a
prefill chunk, and a prompt is cut into other chunks when drafts take part of a step's
budget. So every token must get the same bits whichever kernel computes it and whatever
rows share its step (model/native/attention_row.h). The case that shows it: a KV cache
small enough that requests are preempted, and recomputed, at other moments with drafts
than without.

The model: random weights at initializer_range 0.1, untied embeddings (its greedy output
wanders, so prompt lookup is often wrong and its drafts are rejected as often as kept); the
draft model is the target itself, whose every greedy draft the target keeps.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.native import load_kernels
from engine_svc.sched.spec import SpeculativeConfig
from engine_svc.types import SamplingParams
from tests.model_factory import make_model_dir

pytestmark = pytest.mark.skipif(
    load_kernels() is None,
    reason="bfloat16 speculation is exact on the native kernels only (a C compiler and AVX2)",
)

VOCAB = 512
NUM_REQUESTS = 24
# 24 blocks of 16 tokens for 24 requests of 20-40 prompt tokens and 48 output tokens:
# every request is preempted at least once, with drafts and without.
SETTINGS = {"dtype": "bfloat16", "num_kv_blocks": 24, "block_size": 16, "max_num_seqs": 64}
PROMPTS = [[random.Random(8 + i).randrange(3, VOCAB) for _ in range(20 + i % 20)] for i in range(NUM_REQUESTS)]
PARAMS = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * NUM_REQUESTS,
    "seeded": [
        SamplingParams(temperature=0.3, seed=100 + i, max_tokens=48, ignore_eos=True) for i in range(NUM_REQUESTS)
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("spec-bf16") / "model", vocab_size=VOCAB, seed=1)


def spec_config(method: str, model_dir) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)
    return SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=3, adaptive=False)


def run(model_dir, sampling: str, spec: SpeculativeConfig | None) -> tuple[list[list[int]], EngineCore]:
    core = EngineCore(EngineConfig(model=str(model_dir), speculative_config=spec, **SETTINGS))
    completions = core.generate(PROMPTS, PARAMS[sampling])
    return [c.output_token_ids for c in completions], core


@pytest.fixture(scope="module")
def without_drafts(model_dir):
    cache: dict[str, list[list[int]]] = {}

    def get(sampling: str) -> list[list[int]]:
        if sampling not in cache:
            outputs, core = run(model_dir, sampling, None)
            assert core.runner.dtype == torch.bfloat16
            assert core.scheduler.num_preemptions >= NUM_REQUESTS // 2
            cache[sampling] = outputs
        return cache[sampling]

    return get


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_outputs_identical_with_speculation_in_bfloat16(model_dir, without_drafts, method, sampling):
    on, core = run(model_dir, sampling, spec_config(method, model_dir))
    off = without_drafts(sampling)
    changed = [i for i, (a, b) in enumerate(zip(on, off)) if a != b]
    assert not changed, f"{len(changed)} of {len(off)} outputs changed with speculation (requests {changed})"
    stats = core.scheduler.speculator.stats
    assert core.scheduler.num_preemptions >= NUM_REQUESTS // 2
    if method == "draft_model" and sampling == "greedy":
        # The target as its own draft, in the same arithmetic: every draft is the target's argmax.
        assert stats.acceptance_rate == 1.0, stats
    else:  # drafts kept and rejected
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
