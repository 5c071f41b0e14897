"""Every model family through the whole engine against ``transformers``.

For each family (tests/family_factory.py) greedy continuations of 12 prompts of mixed
lengths equal ``generate()`` of transformers on the same random weights, in float32,
on the PyTorch path and on the native kernels (experts included), with all prompts in one batch, with every
prefill chunked, and with prompts served from the prefix cache. Where the two part at a
position whose top two logits lie within 1e-4 (a near tie), the comparison accepts it.

Both sides keep EOS out until ``NUM_NEW`` tokens (``min_new_tokens`` / ``min_tokens``).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.arch.moe import SparseMoE
from engine_svc.model.backends.native_layers import NativeExperts
from engine_svc.model.load.loader import read_config
from engine_svc.types import FinishReason, SamplingParams
from tests.family_factory import FAMILIES, VOCAB_SIZE, WINDOW, make_family_dir

NUM_NEW = 10
MAX_MODEL_LEN = 256  # within the LongRoPE models' original context
TIE_EPS = 1e-4
LENGTHS = [1, 3, 8, 15, 16, 17, 31, 40, 64, 65, 100, 130]
REGIMES = {
    "one_batch": dict(max_num_batched_tokens=4096),
    "chunked_prefill": dict(max_num_batched_tokens=24),
    "prefix_cache": dict(max_num_batched_tokens=512),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = make_family_dir(tmp_path_factory.mktemp(request.param) / "model", request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf, {}


def _prompts(*, shared_prefix: int) -> list[list[int]]:
    rng = random.Random(11)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in LENGTHS]


def _hf_greedy(hf, cache: dict, prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in cache:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
            )
        cache[key] = out[0, len(prompt) :].tolist()
    return cache[key]


def _assert_same_or_near_tie(hf, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    if ours == theirs:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < TIE_EPS, f"diverged at output {i} with a top-2 logit gap of {gap:.2e}: {ours} vs {theirs}"


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(family, regime, kernels):
    name, path, hf, cache = family
    prompts = _prompts(shared_prefix=40 if regime == "prefix_cache" else 0)
    core = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            num_kv_blocks=256,
            block_size=16,
            kernels=kernels,
            max_model_len=MAX_MODEL_LEN,
            **REGIMES[regime],
        )
    )
    assert (core.runner.kernels is None) == (kernels == "torch")
    experts = [m for m in core.runner.model.modules() if isinstance(m, SparseMoE)]
    assert all(isinstance(m.run_expert, NativeExperts) == (kernels == "auto") for m in experts)
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    if regime == "prefix_cache":
        core.generate([prompts[0]], params)  # the shared prefix is cached before the rest arrive
    results = core.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == FinishReason.LENGTH
        _assert_same_or_near_tie(hf, prompt, result.output_token_ids, _hf_greedy(hf, cache, prompt))
    if regime == "prefix_cache":
        assert all(r.num_cached_tokens >= 32 for r in results[1:]), [r.num_cached_tokens for r in results]
    assert core.kv_cache.num_used_blocks == 0


def test_family_options_are_read_from_config(family):
    name, path, _, _ = family
    args = ModelArgs.from_hf_config(read_config(path))
    assert args.architecture == FAMILIES[name][1].__name__
    windows = {
        "qwen3_sliding": (None, WINDOW),
        "mistral_sliding": (WINDOW,) * 2,
        "qwen2_sliding": (WINDOW,) * 2,
        "gemma3": (WINDOW, None),
        "phi3": (WINDOW,) * 2,
    }
    assert args.sliding_windows == windows.get(name, (WINDOW,) * 2 if name == "mixtral" else (None, None))
    assert args.qk_norm == name.startswith(("qwen3", "gemma3"))
    assert (args.norm_offset, args.sandwich_norms) == ((1.0, True) if name == "gemma3" else (0.0, False))
    assert args.moe_layers == {"mixtral": (True, True), "qwen3_moe": (False, True)}.get(name, (False, False))


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}, "architectures"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope"),
        ({"layer_types": ["full_attention", "chunked_attention"], "sliding_window": 8}, "layer_types"),
    ],
)
def test_unservable_config_is_refused_naming_the_field(tmp_path, edit, field):
    config = json.loads(json.dumps(read_config(make_family_dir(tmp_path / "m", "qwen3_sliding"))))
    config.update(edit)
    with pytest.raises((ValueError, NotImplementedError), match=field):
        ModelArgs.from_hf_config(config)


def test_longrope_past_the_original_context_is_refused(tmp_path):
    args = ModelArgs.from_hf_config(read_config(make_family_dir(tmp_path / "m", "phi4_mini")))
    assert (args.rotary_dim, args.head_dim) == (12, 16)
    args.check_max_model_len(256)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        args.check_max_model_len(257)
