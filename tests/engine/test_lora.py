"""LoRA adapters in the whole engine against PEFT itself, on random weights.

Adapters are made with ``peft`` (tests/lora_factory.py: r = 4, 8, 16, one with rsLoRA, all
seven targets or a few; B drawn at random, so each adapter changes the greedy output) on a
random-weight Llama with initializer_range 0.1 whose MLP width (96) is not a whole number
of the native GEMM's panels. Greedy ids must equal ``PeftModel``'s token for token (a near
tie of the top two logits, within 1e-4, may break either way), on the native kernels and
on the PyTorch path; a batch mixing the base model and three adapters must give each
request what it gives alone; the prefix cache must never hand one adapter's K/V to
another, nor to a new version of the same name.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import transformers

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.lora_registry import LoraConfig, LoraRefusedError
from engine_svc.types import ErrorCode, SamplingParams
from tests.lora_factory import load_peft_model, make_adapter
from tests.model_factory import make_model_dir

NUM_NEW = 10
TIE_EPS = 1e-4
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW
)  # EOS held back, as min_new_tokens does
ADAPTERS = {  # name -> make_adapter options
    "r4": dict(r=4, alpha=8, seed=1),
    "r8-rslora-qvd": dict(r=8, alpha=16, seed=2, use_rslora=True, targets=("q_proj", "v_proj", "down_proj")),
    "r16": dict(r=16, alpha=32, seed=3),
}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = make_model_dir(root / "model", vocab_size=512, intermediate_size=96)
    adapters = {name: make_adapter(model_dir, root / name, **opts) for name, opts in ADAPTERS.items()}
    references = {None: transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()}
    references.update({name: load_peft_model(model_dir, path) for name, path in adapters.items()})
    return model_dir, adapters, references


def _prompts(seed: int, lengths=(1, 5, 16, 17, 40, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _assert_same_or_near_tie(model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    if ours == theirs:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.inference_mode():
        top2 = torch.topk(model(torch.tensor([prompt + theirs[:i]])).logits[0, -1], 2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < TIE_EPS, f"diverged at output {i} with a top-2 logit gap of {gap:.2e}: {ours} vs {theirs}"


def _engine(model_dir, adapters: dict, *, kernels: str = "auto", **lora) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            kernels=kernels,
            num_kv_blocks=lora.pop("num_kv_blocks", 512),
            block_size=16,
            max_num_seqs=64,
            enable_lora=True,
            lora=LoraConfig(modules=tuple((n, str(p)) for n, p in adapters.items()), **lora),
        )
    )


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_greedy_ids_equal_peft_for_every_adapter_in_one_batch(lora_setup, kernels):
    model_dir, adapters, references = lora_setup
    core = _engine(model_dir, adapters, kernels=kernels)
    prompts = _prompts(0)
    names = [None, *adapters]
    jobs = [(name, p) for name in names for p in prompts]
    results = core.generate([p for _, p in jobs], GREEDY, [name for name, _ in jobs])
    outputs_by_name: dict = {}
    for (name, prompt), result in zip(jobs, results):
        assert result.error is None, result.error
        want = _reference(references[name], prompt)
        _assert_same_or_near_tie(references[name], prompt, result.output_token_ids, want)
        outputs_by_name.setdefault(name, []).append(result.output_token_ids)
    # Each adapter changes what the model says: the test could fail if the term were dropped.
    for name in adapters:
        assert outputs_by_name[name] != outputs_by_name[None], name


def test_64_concurrent_requests_mixing_base_and_three_adapters_equal_their_solo_runs(lora_setup):
    model_dir, adapters, _ = lora_setup
    core = _engine(model_dir, adapters, max_loras=4)
    rng = random.Random(5)
    names = [None, *adapters]
    jobs = [(names[i % 4], [rng.randrange(3, 512) for _ in range(rng.randrange(1, 70))]) for i in range(64)]
    together = core.generate([p for _, p in jobs], GREEDY, [n for n, _ in jobs])
    for (name, prompt), result in zip(jobs, together):
        alone = core.generate([prompt], GREEDY, [name])[0]
        assert result.output_token_ids == alone.output_token_ids, (name, prompt)


def test_prefix_cache_is_shared_within_an_adapter_and_never_across(lora_setup):
    model_dir, adapters, _ = lora_setup
    core = _engine(model_dir, adapters)
    prompt = _prompts(7, lengths=(70,))[0]  # 4 full blocks of 16
    first = core.generate([prompt], GREEDY, ["r4"])[0]
    again = core.generate([prompt], GREEDY, ["r4"])[0]
    other = core.generate([prompt], GREEDY, ["r16"])[0]
    base = core.generate([prompt], GREEDY, [None])[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64 and again.output_token_ids == first.output_token_ids
    assert other.num_cached_tokens == 0
    assert base.num_cached_tokens == 0
    # ... and the base model's blocks are not an adapter's either.
    assert core.generate([prompt], GREEDY, ["r8-rslora-qvd"])[0].num_cached_tokens == 0


def test_a_reload_under_the_same_name_with_new_weights_gets_no_stale_hit(lora_setup, tmp_path):
    model_dir, adapters, references = lora_setup
    core = _engine(model_dir, {"a": adapters["r4"]})
    prompt = _prompts(9, lengths=(50,))[0]
    old = core.generate([prompt], GREEDY, ["a"])[0]
    core.unload_lora("a")
    core.load_lora(core.read_lora("a", str(adapters["r16"])))
    new = core.generate([prompt], GREEDY, ["a"])[0]
    assert new.num_cached_tokens == 0
    _assert_same_or_near_tie(references["r16"], prompt, new.output_token_ids, _reference(references["r16"], prompt))
    assert new.output_token_ids != old.output_token_ids


def test_adapters_evicted_from_memory_are_read_back_and_stay_exact(lora_setup):
    model_dir, adapters, references = lora_setup
    core = _engine(model_dir, adapters, max_cpu_loras=1, max_loras=1)
    prompts = _prompts(11, lengths=(3, 30))
    for name in ["r4", "r16", "r4", "r8-rslora-qvd"]:
        for prompt, result in zip(prompts, core.generate(prompts, GREEDY, [name] * len(prompts))):
            _assert_same_or_near_tie(
                references[name], prompt, result.output_token_ids, _reference(references[name], prompt)
            )
    assert {kind for kind, _ in core.lora.take_events()} >= {"load", "reload"}


def test_requests_of_more_adapters_than_slots_wait_or_are_refused_never_mixed_up(lora_setup):
    model_dir, adapters, _ = lora_setup
    core = _engine(model_dir, adapters, max_cpu_loras=1, max_loras=1)
    prompt = _prompts(12, lengths=(8,))[0]
    # One slot: the first adapter holds it while its request runs, the second is refused (retryable).
    results = core.generate([prompt, prompt], GREEDY, ["r4", "r16"])
    assert results[0].error is None
    assert results[1].error is not None and results[1].error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "--max-cpu-loras" in results[1].error.message


def test_unknown_adapter_names_and_engines_without_lora_fail_the_request_in_band(lora_setup):
    model_dir, adapters, _ = lora_setup
    core = _engine(model_dir, adapters)
    result = core.generate([[5, 6, 7]], GREEDY, ["nope"])[0]
    assert result.error.code is ErrorCode.NOT_FOUND and "r4" in result.error.message
    plain = EngineCore(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64))
    result = plain.generate([[5, 6, 7]], GREEDY, ["r4"])[0]
    assert result.error.code is ErrorCode.NOT_FOUND and "--enable-lora" in result.error.message
    with pytest.raises(LoraRefusedError, match="--enable-lora"):
        plain.unload_lora("r4")


def test_unload_is_refused_while_requests_use_the_adapter(lora_setup):
    model_dir, adapters, _ = lora_setup
    core = _engine(model_dir, adapters)
    request = core.make_request("held", [5, 6, 7], GREEDY, lora_name="r4")
    assert core.add_request(request) is None
    with pytest.raises(LoraRefusedError, match="1 unfinished requests") as refused:
        core.unload_lora("r4")
    assert refused.value.code is ErrorCode.FAILED_PRECONDITION
    while core.has_unfinished_requests():
        core.step()
    core.unload_lora("r4")
    with pytest.raises(LoraRefusedError) as missing:
        core.unload_lora("r4")
    assert missing.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(LoraRefusedError) as twice:
        core.load_lora(core.read_lora("r16", str(adapters["r16"])))
    assert twice.value.code is ErrorCode.ALREADY_EXISTS


def test_the_operator_is_told_when_lora_turns_the_decode_stack_off(lora_setup, caplog):
    model_dir, adapters, _ = lora_setup
    plain = EngineCore(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16))
    if plain.runner.model.decode_stack is None:
        pytest.skip("no decode stack on this machine's kernels: nothing for LoRA to turn off")
    with caplog.at_level(logging.INFO, logger="engine_svc.model.lora.slots"):
        core = _engine(model_dir, adapters, num_kv_blocks=64)
    assert core.runner.model.decode_stack is None
    assert any("the decode stack is off" in r.getMessage() for r in caplog.records), caplog.text
