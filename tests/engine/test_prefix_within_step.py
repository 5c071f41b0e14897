"""Prefix-cache hits within one step, on the demo model: a request admitted in the same
step as another that computes their shared prefix reads that prefix's K/V in the same
pass (every layer writes the step's K/V before attending), and a step that fails leaves
no such hit behind."""

from __future__ import annotations

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.types import ErrorCode, RequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARED = list(range(3, 51))  # three blocks of 16
PROMPTS = [SHARED + [60, 61, 62], SHARED + [70, 71], SHARED[:40] + [80]]


def _core(model_dir, prefix_caching: bool = True) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=64,
            block_size=16,
            enable_prefix_caching=prefix_caching,
        )  # fmt: skip
    )


def test_requests_admitted_together_share_the_prefix_one_of_them_computes(demo_model_dir):
    together = _core(demo_model_dir).generate(PROMPTS, GREEDY)
    # all three in the first step: the later two hit the first one's full blocks
    assert [c.num_cached_tokens for c in together] == [0, 48, 32]
    alone = _core(demo_model_dir, prefix_caching=False)
    for prompt, got in zip(PROMPTS, together):
        (want,) = alone.generate([prompt], GREEDY)
        assert got.output_token_ids == want.output_token_ids


def test_a_failed_step_leaves_no_hit_on_blocks_it_never_wrote(demo_model_dir, monkeypatch):
    core = _core(demo_model_dir)
    assert core.add_request(core.make_request("a", PROMPTS[0], GREEDY)) is None

    def fail(scheduler_output):
        raise RuntimeError("injected fault")

    with monkeypatch.context() as m:
        m.setattr(core.runner, "execute", fail)
        with pytest.raises(RuntimeError, match="injected fault"):
            core.step()
    (failed,) = core.fail(["a"], RequestError(ErrorCode.INTERNAL, "engine step failed"))
    assert failed.error is not None
    (again,) = core.generate([PROMPTS[1]], GREEDY)
    assert again.num_cached_tokens == 0  # the failed step's blocks were never hittable
    (want,) = _core(demo_model_dir, prefix_caching=False).generate([PROMPTS[1]], GREEDY)
    assert again.output_token_ids == want.output_token_ids
