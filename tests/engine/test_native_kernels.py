"""The CPU fast paths against plain PyTorch: the native decode-attention kernel and the
oneDNN-packed linear layers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.model.native import load_decode_attention
from engine_svc.model.packed_linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def kernel():
    k = load_decode_attention()
    assert k is not None, "the decode kernel did not build (see the log)"
    return k


def _reference(q, k_cache, v_cache, table, lens, scale):
    """Per row: gather its context, repeat KV heads, one SDPA."""
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for i, n in enumerate(lens.tolist()):
        k = k_cache[table[i].long()].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(group, 0)  # [heads, n, hd]
        v = v_cache[table[i].long()].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(group, 0)
        out[i] = F.scaled_dot_product_attention(q[i].view(num_heads, 1, -1), k, v, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 12, 8), (6, 2, 32, 1)],
)
def test_decode_kernel_matches_sdpa(kernel, num_heads, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(num_heads * head_dim)
    num_blocks, rows = 64, 7
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    # Contexts from 1 token to several blocks, not multiples of the block size; blocks
    # in random order, shared between rows (as prefix caching does).
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 5, 4 * block_size], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size) + 1  # one spare column: the kernel must not read it
    table = torch.randint(0, num_blocks, (rows, max_blocks), generator=g, dtype=torch.int32)
    q = torch.randn(rows, num_heads, head_dim, generator=g) * 3  # peaked softmax
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    kernel(out, q, k_cache, v_cache, table, lens, int(lens.max()), scale)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, table, lens, scale), atol=2e-6, rtol=1e-5)


def test_decode_kernel_refuses_wrong_inputs(kernel):
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(4, 16, 2, 16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.zeros_like(q), q.double(), cache, cache, table, lens, 1, 0.25)
    with pytest.raises(ValueError, match="int32"):
        kernel(torch.zeros_like(q), q, cache, cache, table.long(), lens, 1, 0.25)
    with pytest.raises(ValueError, match="one block-table row"):
        kernel(torch.zeros_like(q), q, cache, cache, table[:1], lens, 1, 0.25)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
def test_packed_linears_match_plain_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 40, bias=False))
    x = torch.randn(5, 48)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model, batch_size_hint=8) == 2
        assert all(isinstance(model[i], PackedLinear) for i in (0, 2))
        for rows in (1, 5):
            torch.testing.assert_close(model(x[:rows]), want[:rows], atol=1e-5, rtol=1e-5)


_LOAD = "from engine_svc.model.native import load_decode_attention as k; print(k() is not None)"


def _loads(kernel_dir, cc: str | None) -> bool:
    env = {**os.environ, "TANDEM_KERNEL_DIR": str(kernel_dir), "CC": cc or "/nonexistent/cc"}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip() == "True"


def test_prebuilt_kernel_loads_without_a_compiler_and_none_falls_back(tmp_path):
    assert not _loads(tmp_path / "empty", cc=None)  # nothing cached, nothing to build with
    assert _loads(tmp_path / "kernels", cc=shutil.which("cc"))  # builds
    assert _loads(tmp_path / "kernels", cc=None)  # the cached build, no compiler needed
