"""The decode stack (model/backends/decode_stack.py, native/stack.c) against the layers run one by
one: a decode-only step's hidden states bit for bit, on packed float32 and on int8 / int4
weights, from 1 to 9 rows over blocks in any order; and only where it applies."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine_svc.model.native import load_kernels
from engine_svc.model.runner import ModelRunner
from engine_svc.outputs import ScheduledRequest
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams
from tests.family_factory import make_family_dir
from tests.model_factory import make_model_dir

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(
        tmp_path_factory.mktemp("stack") / "model", arch="llama", num_kv_heads=2, num_heads=4, vocab_size=512
    )


def _runner(
    model_dir, quantization: str | None = None, max_model_len: int | None = None, dtype: str = "float32", **kwargs
) -> ModelRunner:
    return ModelRunner(str(model_dir), device="cpu", dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=256,
                       kv_cache_bytes=None, max_model_len=max_model_len, quantization=quantization,
                       **kwargs)  # fmt: skip


def _hidden(runner: ModelRunner, batch: list[ScheduledRequest]) -> torch.Tensor:
    with torch.inference_mode():
        input_ids, positions, meta = runner._prepare_inputs(batch)
        return runner.model(input_ids, positions, runner.kv_caches, meta)


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "int4+a8", "+kv16", "int4+kv16", "+bf16"])
def test_decode_steps_equal_the_layer_by_layer_path_bit_for_bit(model_dir, quantization):
    """``+a8``: int8 activations; ``+kv16``: a bfloat16 KV cache (written by the stack in C,
    by torch's copy on the layer path: the same rounding); ``+bf16``: a bfloat16 model
    (bfloat16 rows, panels and cache)."""
    weights, _, extra = (quantization or "").partition("+")
    kernels = load_kernels()
    if extra == "a8" and (kernels is None or not kernels.int8_dot_products):
        pytest.skip("no int8 dot products on this CPU")
    runner = _runner(
        model_dir,
        weights or None,
        activation_quantization="int8" if extra == "a8" else "none",
        kv_cache_dtype="bfloat16" if extra == "kv16" else "auto",
        dtype="bfloat16" if extra == "bf16" else "float32",
    )
    assert runner.kv_caches[0][0].dtype == (torch.bfloat16 if extra in ("kv16", "bf16") else torch.float32)
    if extra == "bf16" and runner.matmuls != "native":
        pytest.skip(f"bfloat16 matmuls run on {runner.matmuls} here (no bfloat16 dot products in this build)")
    stack = runner.model.decode_stack
    assert stack is not None
    gen = torch.Generator().manual_seed(0)
    requests = [Request(f"r{i}", torch.randint(3, 512, (5 + 7 * i,), generator=gen).tolist(), GREEDY) for i in range(9)]
    # Each request's blocks scattered and reversed, none shared.
    blocks = {r.request_id: list(range(100 + 12 * i, 112 + 12 * i))[::-1] for i, r in enumerate(requests)}
    runner.model.decode_stack = None
    _hidden(runner, [ScheduledRequest(r, r.num_tokens, blocks[r.request_id]) for r in requests])  # prefill
    for r in requests:
        r.num_computed_tokens = r.num_tokens
        r.append_output_token((11 * r.num_tokens) % 512)
    for rows in (1, 2, 5, 9, 3):
        batch = [ScheduledRequest(r, 1, blocks[r.request_id]) for r in requests[:rows]]
        runner.model.decode_stack = stack
        got = _hidden(runner, batch).clone()
        # The same step layer by layer: it writes the same K/V at the same slots again.
        runner.model.decode_stack = None
        want = _hidden(runner, batch)
        assert torch.equal(got, want), f"{rows} rows: max difference {(got - want).abs().max().item()}"
        for s in batch:
            s.request.num_computed_tokens += 1
            s.request.append_output_token((3 * s.request.num_tokens) % 512)


def test_steps_with_prefill_rows_take_the_layer_by_layer_path(model_dir):
    runner = _runner(model_dir)
    calls = []
    stack = runner.model.decode_stack
    assert stack is not None
    run = stack.run
    stack.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]
    a, b = Request("a", [5, 6, 7, 8, 9], GREEDY), Request("b", [9, 8, 7], GREEDY)
    _hidden(runner, [ScheduledRequest(a, 5, [0]), ScheduledRequest(b, 3, [1])])
    assert calls == []
    a.num_computed_tokens, b.num_computed_tokens = 5, 3
    a.append_output_token(3)
    _hidden(runner, [ScheduledRequest(a, 1, [0]), ScheduledRequest(b, 0, [1])][:1])
    assert calls == [1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_llama_shaped_families_take_it_exactly(tmp_path, arch, dtype):
    """qkv biases (Qwen2), Mistral: the same bits both ways."""
    runner = _runner(make_model_dir(tmp_path / arch, arch=arch), dtype=dtype)
    if runner.matmuls != "native":
        pytest.skip(f"{dtype} matmuls run on {runner.matmuls} here")
    stack = runner.model.decode_stack
    assert stack is not None
    r = Request("a", list(range(3, 40)), GREEDY)
    runner.model.decode_stack = None
    _hidden(runner, [ScheduledRequest(r, r.num_tokens, [7, 3, 9, 1, 5])])
    r.num_computed_tokens = r.num_tokens
    r.append_output_token(17)
    batch = [ScheduledRequest(r, 1, [7, 3, 9, 1, 5])]
    runner.model.decode_stack = stack
    got = _hidden(runner, batch).clone()
    runner.model.decode_stack = None
    assert torch.equal(got, _hidden(runner, batch))


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mistral_sliding", "mixtral", "phi3", "phi4_mini"])
def test_models_it_does_not_implement_have_none(tmp_path, family):
    """q/k norms, Gemma's norms, a sliding window (Mistral's, Phi-3's), experts, partial
    RoPE: the layers run one by one."""
    assert (
        _runner(make_family_dir(tmp_path / family, family), max_model_len=256).model.decode_stack is None
    )  # 256: Phi's longrope


def test_no_stack_without_the_native_kernels_or_with_adapters(model_dir):
    assert _runner(model_dir, kernels="torch").model.decode_stack is None
    assert _runner(model_dir, lora_slots=2).model.decode_stack is None  # adapters' terms are not in it
