"""--kv-cache-dtype bfloat16: K and V rounded to bfloat16 as they are written, attention in
float32 over the rounded values. The attention kernels over a bfloat16 cache give the bits
they give over a float32 cache holding its values; the engine against transformers with a
cache that rounds the same way (its keys after RoPE, as the engine's cache holds them), on
the native kernels (the decode stack among them) and on the PyTorch path."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import DynamicCache

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.native import NativeKernels, cpu_features
from engine_svc.model.native.cpu import ISA_BUILDS, ISA_PREFERENCE
from engine_svc.model.native.kernels import KernelError
from engine_svc.types import SamplingParams
from tests.engine.model.native.test_native_kernels import _caches
from tests.engine.native_builds import session_build
from tests.engine.test_engine_vs_transformers import TIE_EPS, _prompts
from tests.model_factory import load_hf_model, make_model_dir

NUM_NEW = 10


class BFloat16Cache(DynamicCache):
    """transformers' cache, every key and value rounded to bfloat16 as it is stored."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(
            key_states.bfloat16().float(), value_states.bfloat16().float(), layer_idx, *args, **kwargs
        )


# The widest build this CPU runs and the narrowest: the kernels' vector width differs.
BUILDS = sorted({next(i for i in ISA_PREFERENCE if ISA_BUILDS[i][1] <= cpu_features().flags), "avx2"})


@pytest.fixture(scope="module", params=BUILDS)
def kernels(request, build_dir) -> NativeKernels:
    if shutil.which("cc") is None or not ISA_BUILDS["avx2"][1] <= cpu_features().flags:
        pytest.skip("needs a C compiler and AVX2")
    return NativeKernels(session_build(request.param, build_dir), request.param)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (10, 2, 96, 16)])
def test_a_bfloat16_cache_beside_float32_rows_reads_as_its_float32_values(
    kernels, num_heads, num_kv_heads, head_dim, block_size
):
    """--kv-cache-dtype bfloat16: a bfloat16 cache widens exactly, so decode and prefill over
    it give the bits they give over a float32 cache holding the same values."""
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, rows = 40, 5
    k16, v16 = _caches(num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16, g)
    k32, v32 = k16.float(), v16.float()
    lens = torch.tensor([1, block_size + 3, 2 * block_size, 7, 3 * block_size - 2], dtype=torch.int32)
    table = torch.randperm(num_blocks, generator=g)[: rows * 4].view(rows, 4).to(torch.int32).contiguous()
    q = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)[:, : num_heads * head_dim]
    outs = []
    for k, v in ((k16, v16), (k32, v32)):
        outs.append(torch.empty(rows, num_heads, head_dim))
        kernels.decode_attention(outs[-1], q, k, v, table, lens, int(lens.max()), head_dim**-0.5)
    assert torch.equal(outs[0], outs[1])
    if not kernels.supports_prefill_attention(head_dim):
        return
    starts, chunk_lens = torch.tensor([0, 19, 3], dtype=torch.int32), torch.tensor([21, 17, 1], dtype=torch.int32)
    chunk_rows = (torch.cumsum(chunk_lens, 0) - chunk_lens).to(torch.int32)
    qp = torch.randn(int(chunk_lens.sum()), num_heads * head_dim, generator=g)
    outs = []
    for k, v in ((k16, v16), (k32, v32)):
        outs.append(torch.empty(qp.shape[0], num_heads, head_dim))
        kernels.prefill_attention(outs[-1], qp, k, v, table[:3].contiguous(), chunk_rows, starts, chunk_lens, 0.1)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="cache beside torch.bfloat16 rows"):  # only ever narrower
        kernels.decode_attention(outs[0][:rows].bfloat16(), q.bfloat16(), k32, v32, table, lens, 9, 0.1)


@pytest.mark.parametrize("rows", [3, 300])  # one thread; rows split across threads
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_write_kv_stores_what_index_copy_stores(kernels, rows, dtype, cache_dtype):
    """The native K/V write: views of a fused qkv tensor into scattered slots, the same bits
    as torch's index_copy_ of the same rows (a bfloat16 cache: rounded as torch rounds)."""
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, head_dim, blocks, block_size = 9, 3, 64, 40, 16
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    got = [torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    want = [c.clone() for c in got]
    assert kernels.write_kv(*got, k, v, slots)
    for cache, x in zip(want, (k, v)):
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, x.to(cache_dtype))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(KernelError, match="slot outside"):
        kernels.write_kv(*got, k, v, torch.where(slots == slots[-1], blocks * block_size, slots))
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # refused whole: nothing written
    head_major = k.transpose(1, 2).contiguous().transpose(1, 2)  # k's shape, not its rows' layout
    assert not kernels.write_kv(*got, head_major, v, slots)  # the caller copies those


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("kv16") / "model", arch="llama", num_kv_heads=2, vocab_size=512)


def _engine(model_dir, kernels: str, max_num_batched_tokens: int) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir), dtype="float32", kernels=kernels, kv_cache_dtype="bfloat16", num_kv_blocks=256,
            block_size=16, max_num_batched_tokens=max_num_batched_tokens,
        )
    )  # fmt: skip


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_bfloat16_cache_matches_transformers_with_a_rounding_cache(model_dir, kernels):
    hf = load_hf_model(model_dir)
    core = _engine(model_dir, kernels, 64)
    assert core.runner.kv_caches[0][0].dtype == torch.bfloat16 and core.runner.dtype == torch.float32
    prompts = _prompts(9)[::3]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for prompt, result in zip(prompts, core.generate(prompts, params)):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                pad_token_id=0, past_key_values=BFloat16Cache(),
            )  # fmt: skip
        theirs, ours = out[0, len(prompt) :].tolist(), result.output_token_ids
        if ours != theirs:  # only where transformers' own top two nearly tie
            i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + theirs[:i]]), past_key_values=BFloat16Cache()).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            assert (top2[0] - top2[1]).item() < TIE_EPS, f"diverged at output {i}: {ours} vs {theirs}"


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_prompt_logprobs_are_transformers_with_a_rounding_cache(model_dir, kernels):
    """Each prompt token's logprob (prefill in chunks of 24 tokens: later chunks read the
    earlier ones' rounded K/V from the cache) against transformers with the rounding cache,
    to float32's summation order; against transformers' float32 cache they differ by far
    more, so the rounding is what is measured."""
    hf = load_hf_model(model_dir)
    core = _engine(model_dir, kernels, 24)
    prompt = list(range(3, 80))
    (result,) = core.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    ours = torch.tensor([lp.logprob for lp in result.prompt_logprobs])

    def theirs(cache) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt]), past_key_values=cache).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]

    rounded, exact = theirs(BFloat16Cache()), theirs(DynamicCache())
    assert ours.shape == rounded.shape
    err, unrounded = (ours - rounded).abs().max().item(), (ours - exact).abs().max().item()
    assert err < 2e-5, err
    assert unrounded > 10 * err and unrounded > 2e-4, (err, unrounded)


def test_a_bfloat16_cache_holds_twice_the_tokens_in_the_same_bytes(model_dir):
    sizes = {}
    for dtype in ("auto", "bfloat16"):
        config = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_dtype=dtype, kv_cache_bytes=8 << 20)
        sizes[dtype] = EngineCore(config).runner.num_kv_blocks
    assert sizes["bfloat16"] == 2 * sizes["auto"]
