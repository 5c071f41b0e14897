"""The whole model on the native kernels against the plain-PyTorch path, step by step.

Two runners on the same weights, one with ``--kernels auto`` and one with ``torch``, get
the same steps: prefill chunks (from position 0 and after earlier chunks), a mixed step
(decodes, a continued prompt and a new one) and a decode-only step. Every row's logits
must agree: in float32 as tightly as the transformers comparisons ask (1e-4), in
bfloat16 to its rounding (the two paths round in different places: the torch path's
attention rounds its probabilities to bfloat16, the kernels keep them in float32).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine_svc.model.backends.backend import uses_native_kernels
from engine_svc.model.runner import ModelRunner
from engine_svc.outputs import ScheduledRequest
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams
from tests.model_factory import make_model_dir

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("native") / "model", arch="llama", num_kv_heads=2, num_heads=4)


def _runner(model_dir, dtype: str, kernels: str) -> ModelRunner:
    return ModelRunner(str(model_dir), device="cpu", dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=256,
                       kv_cache_bytes=None, max_model_len=None, kernels=kernels)  # fmt: skip


def _logits(runner: ModelRunner, batch: list[ScheduledRequest]) -> torch.Tensor:
    """All rows' logits of one step, in the runner's batch order (decodes first)."""
    with torch.inference_mode():
        input_ids, positions, meta = runner._prepare_inputs(batch)
        hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
        return runner.model.compute_logits(hidden).float()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_mixed_and_decode_steps_match_the_torch_path(model_dir, dtype):
    native, reference = _runner(model_dir, dtype, "auto"), _runner(model_dir, dtype, "torch")
    assert native.kernels is not None and native.matmuls != "torch" and native.native_prefill
    assert reference.kernels is None and reference.matmuls == "torch"

    a, b, c = (
        Request("a", _prompt(1, 41), GREEDY),
        Request("b", _prompt(2, 30), GREEDY),
        Request("c", _prompt(3, 26), GREEDY),
    )
    blocks = {"a": list(range(0, 12))[::-1], "b": list(range(20, 32)), "c": list(range(40, 52))[::-1]}

    def step(*parts: tuple[Request, int]) -> None:
        batch = [ScheduledRequest(r, n, blocks[r.request_id]) for r, n in parts]
        decodes = sorted((s for s in batch if s.num_new_tokens == 1), key=lambda s: s.start)
        batch = decodes + [s for s in batch if s.num_new_tokens != 1]  # the runner's order
        got, want = _logits(native, batch), _logits(reference, batch)
        if dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        else:
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 0.05 * scale
            assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75
        for s in batch:  # what the scheduler would do: advance, and append a token once a prompt is in
            s.request.num_computed_tokens += s.num_new_tokens
            if s.request.num_computed_tokens == s.request.num_tokens:
                s.request.append_output_token((7 * s.request.num_tokens) % 512)

    step((a, 41), (b, 20))  # a whole prompt and a first chunk
    step((a, 1), (b, 10), (c, 26))  # mixed: a decode, a continued prompt, a new prompt
    step((a, 1), (b, 1), (c, 1))  # decodes only
    step((a, 1), (c, 1))


def test_only_auto_on_cpu_uses_the_native_kernels():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert uses_native_kernels("auto", cpu, torch.float32) and uses_native_kernels("auto", cpu, torch.bfloat16)
    assert not uses_native_kernels("torch", cpu, torch.float32)  # the reference path stays plain PyTorch
    assert not any(uses_native_kernels("auto", cuda, dtype) for dtype in (torch.float32, torch.bfloat16))
    assert not uses_native_kernels("auto", cpu, torch.float16)
