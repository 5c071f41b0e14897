"""The native CPU kernels against plain PyTorch, on every build this CPU can run.

Each kernel is compared with the op it replaces (the plain-PyTorch path of the model):
float32 to float32 rounding, bfloat16 to one bfloat16 rounding step. Every ISA build must
compile on any x86-64 machine (AVX512 ones too); only those the CPU can run are loaded.
The dispatcher's choices are tested on /proc/cpuinfo samples of the CPU kinds it meets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_svc.model.arch.layers import RMSNorm
from engine_svc.model.arch.rope import RotaryEmbedding
from engine_svc.model.native import BuildError
from engine_svc.model.native.cpu import ISA_BUILDS, parse_cpuinfo
from tests.engine.native_builds import DTYPES, RUNNABLE, _close, session_build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


# -- builds and dispatch --------------------------------------------------------------------


def _compiler_takes(isa: str) -> bool:
    probe = subprocess.run(
        [shutil.which("cc") or "cc", *ISA_BUILDS[isa][0], "-x", "c", "-c", "/dev/null", "-o", "/dev/null"],
        capture_output=True,
        timeout=60,
    )
    return probe.returncode == 0


@pytest.mark.parametrize("isa", list(ISA_BUILDS))
def test_every_build_compiles(build_dir, isa):
    """AVX512 builds too, on any x86-64 machine whose compiler knows the flags: compiled,
    never loaded where the CPU lacks them (see the dispatch tests); with every warning of
    -Wall -Wextra an error."""
    if not _compiler_takes(isa):
        pytest.skip(f"this compiler cannot target {isa}")
    assert session_build(isa, build_dir).stat().st_size > 10_000  # the one the kernel tests load, where runnable


ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx f16c fma avx2 bmi2\n"
ZEN4 = (
    "model name\t: AMD EPYC 9B14\n"
    "flags\t\t: avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16\n"
)
SPR = (
    "model name\t: Intel Xeon 8481C\n"
    "flags\t\t: f16c fma avx2 avx_vnni avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile\n"
)
CASCADE_LAKE = (
    "model name\t: Intel Xeon 8273CL\nflags\t\t: f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni\n"
)
SKYLAKE_X = "model name\t: Intel Xeon 8175M\nflags\t\t: f16c fma avx2 avx512f avx512dq avx512bw avx512vl\n"
SIERRA_FOREST = "model name\t: Intel Xeon 6780E\nflags\t\t: f16c fma avx2 avx_vnni\n"
OLD = "model name\t: Old x86\nflags\t\t: sse2 avx\n"


@pytest.mark.parametrize(
    "cpuinfo,isa,native_bf16",
    [
        (ZEN3, "avx2", False),
        (ZEN4, "avx512_bf16", True),
        (SPR, "avx512_bf16", True),
        (CASCADE_LAKE, "avx512_vnni", False),
        (SKYLAKE_X, "avx512", False),
        (SIERRA_FOREST, "avx2_vnni", False),
        (OLD, None, False),
    ],
)
def test_dispatch_follows_the_cpu_flags(cpuinfo, isa, native_bf16):
    features = parse_cpuinfo(cpuinfo)
    assert features.kernel_isa == isa and features.native_bf16 == native_bf16
    assert features.model_name != "unknown"


@pytest.mark.parametrize("cpuinfo,dtype", [(ZEN3, torch.float32), (ZEN4, torch.bfloat16), (SPR, torch.bfloat16)])
def test_dtype_auto_follows_the_cpu(monkeypatch, caplog, cpuinfo, dtype):
    from engine_svc.model.load import loader

    monkeypatch.setattr(loader, "cpu_features", lambda: parse_cpuinfo(cpuinfo))
    with caplog.at_level("INFO", logger=loader.__name__):
        assert loader.resolve_dtype("auto", "cpu") == dtype
    assert "dtype auto: " + str(dtype).removeprefix("torch.") in caplog.text  # the choice is logged, with why
    assert loader.resolve_dtype("auto", "cuda") == torch.float32  # the GPU default is unchanged
    assert loader.resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # explicit choices stand


_LOAD = "from engine_svc.model.native import load_kernels as k; x = k(); print(x.isa if x else None)"


def _loads(kernel_dir, cc: str | None, isa: str | None = None, log: list[str] | None = None) -> str:
    """The ISA of the kernels a fresh engine process loads ("None": the PyTorch path)."""
    env = {**os.environ, "TANDEM_KERNEL_DIR": str(kernel_dir), "CC": cc or "/nonexistent/cc"}
    env.pop("TANDEM_KERNEL_ISA", None)
    if isa:
        env["TANDEM_KERNEL_ISA"] = isa
    out = subprocess.run(
        [sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    if log is not None:
        log.append(out.stderr)
    return out.stdout.strip()


def test_prebuilt_kernels_load_without_a_compiler_and_none_falls_back(tmp_path):
    best = RUNNABLE[0]
    log: list[str] = []
    # Nothing cached, nothing to build with: the PyTorch path, and the log says why.
    assert _loads(tmp_path / "empty", cc=None, log=log) == "None"
    assert "no C compiler" in log[-1] and "PyTorch path" in log[-1]
    # A cache folder that cannot be made: the same, not a crash.
    assert _loads("/dev/null/kernels", cc=shutil.which("cc"), log=log) == "None"
    assert "/dev/null/kernels" in log[-1] and "PyTorch path" in log[-1]
    assert _loads(tmp_path / "kernels", cc=shutil.which("cc")) == best  # builds
    assert _loads(tmp_path / "kernels", cc=None) == best  # the cached build, no compiler needed
    # A build the CPU cannot run is never chosen, whatever is asked for.
    assert _loads(tmp_path / "kernels", cc=None, isa="avx512_bf16") == best
    assert _loads(tmp_path / "kernels", cc=shutil.which("cc"), isa="avx2") == "avx2"


@pytest.mark.parametrize(
    "cpuinfo,wanted,isa",
    [
        (ZEN3, None, "avx2"),
        (ZEN3, "avx512_bf16", "avx2"),  # asked for more than the CPU has: not given
        (ZEN4, "avx2", "avx2"),  # less than it has: given, to compare builds
        (ZEN4, "sse", "avx512_bf16"),  # not a build: ignored
        (ZEN4, "avx2_vnni", "avx512_bf16"),  # a lesser build whose flags it lacks (AVX-VNNI): not given
        (CASCADE_LAKE, "avx512", "avx512"),
        (OLD, "avx2", None),  # no AVX2: no build at all
    ],
)
def test_a_cpu_never_gets_a_build_it_cannot_run(monkeypatch, cpuinfo, wanted, isa):
    from engine_svc.model import native

    if wanted:
        monkeypatch.setenv("TANDEM_KERNEL_ISA", wanted)
    else:
        monkeypatch.delenv("TANDEM_KERNEL_ISA", raising=False)
    assert native._choose_isa(parse_cpuinfo(cpuinfo)) == isa


def test_no_avx2_and_failed_builds_fall_back(monkeypatch, caplog):
    """A CPU without AVX2 gets the PyTorch path; where the best build fails (a compiler too
    old for AVX512-BF16), the next one the CPU runs is loaded."""
    from engine_svc.model import native

    monkeypatch.delenv("TANDEM_KERNEL_ISA", raising=False)
    monkeypatch.setattr(native, "_kernels", native._UNSET)
    monkeypatch.setattr(native, "cpu_features", lambda: parse_cpuinfo(OLD))
    with caplog.at_level("WARNING", logger=native.__name__):
        assert native.load_kernels() is None
    assert "no AVX2" in caplog.text

    def build_fails_above_avx2(isa):
        if isa != "avx2":
            raise native.BuildError(f"cc: unrecognized -m flag for {isa}")
        return real_build(isa)

    real_build = native.build
    monkeypatch.setattr(native, "_kernels", native._UNSET)
    monkeypatch.setattr(native, "cpu_features", lambda: parse_cpuinfo(ZEN4))
    monkeypatch.setattr(native, "build", build_fails_above_avx2)
    caplog.clear()
    with caplog.at_level("WARNING", logger=native.__name__):
        loaded = native.load_kernels()
    assert loaded is not None and loaded.isa == "avx2"
    for isa in ("avx512_bf16", "avx512_vnni", "avx512"):
        assert f"{isa} kernels unavailable" in caplog.text
    assert "avx2_vnni" not in caplog.text  # Zen 4 has no AVX-VNNI: never tried


def test_a_build_others_could_write_is_not_loaded(tmp_path, build_dir):
    folder = tmp_path / "kernels"
    folder.mkdir()
    lib = Path(shutil.copy2(session_build("avx2", build_dir), folder))  # a cached build, not compiled again
    assert session_build("avx2", folder) == lib
    folder.chmod(0o777)  # anyone may swap the file
    with pytest.raises(BuildError, match="another user"):
        session_build("avx2", folder)
    folder.chmod(0o1777)  # sticky, like /tmp: only the owner may replace it
    assert session_build("avx2", folder) == lib
    lib.chmod(0o666)
    with pytest.raises(BuildError, match="another user"):
        session_build("avx2", folder)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (3, 40), (300, 576)])
def test_rms_norm_with_and_without_residual(kernels, dtype, rows, dim):
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    with torch.inference_mode():
        want, want_sum = norm(x, residual)
        got_sum = residual.clone()
        got = kernels.rms_norm(x, norm.weight, norm.eps, residual=got_sum)
        _close(got_sum, want_sum, dtype)
        assert torch.equal(got_sum, want_sum)  # an add rounds the same everywhere
        _close(got, want, dtype)
        _close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x)[0], dtype)


@pytest.mark.parametrize("cols", [1, 15, 16, 31, 33, 100, 49152])
def test_argmax_rows_is_torchs_first_maximum(kernels, cols):
    """The greedy sampler's argmax: the first of equal maxima, a NaN counting as the maximum
    (the first NaN), -inf rows, and rows that lie further apart than their width."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(40, cols + 3, generator=g)[:, :cols]  # a slice of wider rows
    x[1] = 2.0  # all equal: index 0
    x[2] = float("-inf")
    x[3, cols // 2] = float("nan")
    x[4, -1] = float("nan")
    x[5, cols // 3 :] = 50.0  # a tie well after the start: its first index
    x[6, : cols // 2 + 1] = -0.0  # -0.0 and 0.0 equal: the first
    x[6, cols // 2 + 1 :] = 0.0
    x[7, (cols * 2) // 3] = float("inf")
    x[8] = torch.randint(0, 3, (cols,), generator=g).float()  # many ties
    x[9, 0] = float("nan")
    x[9, -1] = float("nan")
    want = x.max(dim=-1).indices
    assert torch.equal(kernels.argmax_rows(x), want)
    assert torch.equal(kernels.argmax_rows(x[:1]), want[:1])  # one row: no parallel region
    with pytest.raises(ValueError, match="rows are contiguous"):
        kernels.argmax_rows(x.t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(kernels, dtype):
    gu = (torch.randn(7, 2 * 100) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(kernels.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16, 12])
def test_rope_in_place_matches_the_torch_path(kernels, dtype, head_dim):
    nh, nkv, max_position = 4, 2, 300
    rotary = RotaryEmbedding(head_dim)
    rotary.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.tensor([0, 1, 17, 299, 5, 128])
    qkv = torch.randn(len(positions), (nh + 2 * nkv) * head_dim).to(dtype)
    want = rotary(positions, dtype).split(qkv, nh, nkv, head_dim)
    cos, sin = rotary.cos_sin(torch.arange(max_position), dtype)
    got = qkv.clone()
    kernels.rope(got, positions, torch.cat((cos, sin), -1).float().contiguous(), nh + nkv, head_dim)
    n = len(positions)
    q, k, v = got.split((nh * head_dim, nkv * head_dim, nkv * head_dim), dim=-1)
    for a, b in zip((q.view(n, nh, head_dim), k.view(n, nkv, head_dim), v.view(n, nkv, head_dim)), want):
        _close(a, b, dtype)
        if dtype == torch.bfloat16:  # each product rounded as torch's ops round it: the same bits
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="rope"):  # a position past the table
        kernels.rope(got, positions + max_position, torch.cat((cos, sin), -1).float().contiguous(), nh, head_dim)


# -- attention ------------------------------------------------------------------------------


def _context(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    return cache[table_row.long()].flatten(0, 1)[:n].float()  # [n, kv_heads, hd]


def _reference_decode(q, k_cache, v_cache, table, lens, scale):
    """Per row: gather its context, repeat KV heads, one SDPA in float32."""
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape)
    for i, n in enumerate(lens.tolist()):
        k = _context(k_cache, table[i], n).transpose(0, 1).repeat_interleave(group, 0)  # [heads, n, hd]
        v = _context(v_cache, table[i], n).transpose(0, 1).repeat_interleave(group, 0)
        out[i] = F.scaled_dot_product_attention(q[i].float().view(num_heads, 1, -1), k, v, scale=scale)[:, 0]
    return out


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, g):
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return k, v


ATTENTION_SHAPES = [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 16, 8), (6, 2, 32, 1), (4, 2, 12, 16), (10, 2, 96, 16)]
# (10, 2, 96, 16): a group of 5 heads and a head_dim of 6 (AVX512) or 12 (AVX2) vectors, so
# the weighted sum of V takes heads and vectors in whole passes and in remainders


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", ATTENTION_SHAPES)
def test_decode_attention_matches_sdpa(kernels, dtype, num_heads, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(num_heads * head_dim)
    num_blocks, rows = 64, 7
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, g)
    # Contexts from 1 token to several blocks, not multiples of the block size; blocks in
    # random order, shared between rows (as prefix caching does).
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 5, 4 * block_size], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size) + 1  # one spare column: the kernel must not read it
    table = torch.randint(0, num_blocks, (rows, max_blocks), generator=g, dtype=torch.int32)
    # q as the kernel meets it: the leading heads of wider rows (the fused qkv).
    qkv = (torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(dtype)  # peaked softmax
    q = qkv[:, : num_heads * head_dim]
    out = torch.full((rows, num_heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    kernels.decode_attention(out, q, k_cache, v_cache, table, lens, int(lens.max()), scale)
    want = _reference_decode(q.reshape(rows, num_heads, head_dim), k_cache, v_cache, table, lens, scale)
    _close(out, want, dtype, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_bits_do_not_depend_on_the_thread_count(kernels, dtype):
    g = torch.Generator().manual_seed(5)
    rows, num_blocks, block_size = 11, 80, 16
    k_cache, v_cache = _caches(num_blocks, block_size, 3, 64, dtype, g)
    lens = torch.randint(1, 7 * block_size, (rows,), generator=g, dtype=torch.int32)
    table = torch.randint(0, num_blocks, (rows, 7), generator=g, dtype=torch.int32)
    q = torch.randn(rows, 9 * 64, generator=g).to(dtype)
    outs, before = [], torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            outs.append(torch.empty(rows, 9, 64, dtype=dtype))
            kernels.decode_attention(outs[-1], q, k_cache, v_cache, table, lens, int(lens.max()), 0.125)
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16))


def _reference_prefill(q, k_cache, v_cache, table, starts, lens, scale):
    """Per chunk: its whole context gathered, an offset causal mask, one SDPA in float32."""
    group = q.shape[1] // k_cache.shape[2]
    out, row = [], 0
    for c, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        k = _context(k_cache, table[c], s + n).transpose(0, 1).repeat_interleave(group, 0)  # [heads, s + n, hd]
        v = _context(v_cache, table[c], s + n).transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None]  # [n, s + n]
        qc = q[row : row + n].float().transpose(0, 1)  # [heads, n, hd]
        out.append(F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", ATTENTION_SHAPES)
def test_prefill_attention_matches_sdpa(kernels, dtype, num_heads, num_kv_heads, head_dim, block_size):
    if not kernels.supports_prefill_attention(head_dim):
        pytest.skip(f"head_dim {head_dim} is not a whole number of vectors for this build")
    g = torch.Generator().manual_seed(num_heads + head_dim)
    # Chunks: a fresh prompt, a continuation after a cached prefix, one token, one that ends
    # mid-tile and mid-block, one long enough for many tiles.
    starts = torch.tensor([0, 37, 5, 16, 0], dtype=torch.int32)
    lens = torch.tensor([20, 23, 1, 17, 70], dtype=torch.int32)
    max_blocks = -(-int((starts + lens).max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, g)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).contiguous()
    num_decodes = 3  # rows before the chunks, as in a mixed batch: the kernel leaves them alone
    total = num_decodes + int(lens.sum())
    qkv = (torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2).to(dtype)
    q = qkv[:, : num_heads * head_dim]
    rows = (torch.cumsum(lens, 0) - lens + num_decodes).to(torch.int32)
    out = torch.full((total, num_heads, head_dim), 7.0, dtype=dtype)
    scale = head_dim**-0.5
    kernels.prefill_attention(out, q, k_cache, v_cache, table, rows, starts, lens, scale)
    want = _reference_prefill(
        q[num_decodes:].reshape(-1, num_heads, head_dim), k_cache, v_cache, table, starts, lens, scale
    )
    assert torch.all(out[:num_decodes] == 7.0)
    _close(out[num_decodes:], want, dtype, rtol=2e-5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", ATTENTION_SHAPES + [(9, 3, 64, 32)])
def test_a_prefill_row_has_its_decode_rows_bits(kernels, dtype, num_heads, num_kv_heads, head_dim, block_size):
    """Every token of a prefill chunk gets the bits of the decode row of the same position
    (what speculative decoding's exactness rests on: a draft verified as a decode row, an
    output token recomputed in a prefill chunk after a preemption, a prompt cut into chunks
    of another length when drafts take part of a step's budget), and so the same bits in
    chunks of any length."""
    if not kernels.supports_prefill_attention(head_dim):
        pytest.skip(f"head_dim {head_dim} is not a whole number of vectors for this build")
    g = torch.Generator().manual_seed(3 * num_heads + head_dim)
    starts = torch.tensor([0, 37, 5, 16, 0, 3], dtype=torch.int32)
    lens = torch.tensor([20, 23, 1, 17, 70, 130], dtype=torch.int32)
    max_blocks = -(-int((starts + lens).max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, g)
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)[: len(lens) * max_blocks]
    table = table.view(len(lens), max_blocks).contiguous()
    total = int(lens.sum())
    qkv = (torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[:, : num_heads * head_dim]
    rows = (torch.cumsum(lens, 0) - lens).to(torch.int32)
    scale = head_dim**-0.5
    prefill = torch.empty(total, num_heads, head_dim, dtype=dtype)
    kernels.prefill_attention(prefill, q, k_cache, v_cache, table, rows, starts, lens, scale)
    # The same tokens as decode rows: row i of chunk c at position starts[c] + i.
    chunk_of = torch.repeat_interleave(torch.arange(len(lens)), lens)
    ctx = torch.cat([torch.arange(s + 1, s + n + 1) for s, n in zip(starts.tolist(), lens.tolist())]).to(torch.int32)
    decode = torch.empty_like(prefill)
    kernels.decode_attention(decode, q, k_cache, v_cache, table[chunk_of].contiguous(), ctx, int(ctx.max()), scale)
    assert torch.equal(_bits(prefill), _bits(decode))
    # One chunk cut in two at any point: the same bits again.
    c = 5
    for cut in (1, 15, 16, 17, 64, 129):
        two = torch.empty(int(lens[c]), num_heads, head_dim, dtype=dtype)
        qc = q[int(rows[c]) : int(rows[c]) + int(lens[c])]
        kernels.prefill_attention(
            two, qc, k_cache, v_cache, table[[c, c]].contiguous(), torch.tensor([0, cut], dtype=torch.int32),
            torch.tensor([int(starts[c]), int(starts[c]) + cut], dtype=torch.int32),
            torch.tensor([cut, int(lens[c]) - cut], dtype=torch.int32), scale,
        )  # fmt: skip
        assert torch.equal(_bits(two), _bits(prefill[int(rows[c]) : int(rows[c]) + int(lens[c])]))


def test_kernels_refuse_wrong_inputs(kernels):
    q = torch.zeros(2, 4 * 16)
    out = torch.zeros(2, 4, 16)
    cache = torch.zeros(4, 16, 2, 16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.decode_attention(out.double(), q.double(), cache.double(), cache.double(), table, lens, 1, 0.25)
    with pytest.raises(ValueError, match="int32"):
        kernels.decode_attention(out, q, cache, cache, table.long(), lens, 1, 0.25)
    with pytest.raises(ValueError, match="one block-table row"):
        kernels.decode_attention(out, q, cache, cache, table[:1], lens, 1, 0.25)
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.decode_attention(out, q.bfloat16(), cache, cache, table, lens, 1, 0.25)
    with pytest.raises(ValueError, match="gemm"):
        kernels.gemm(torch.zeros(3, 5), kernels.pack(torch.zeros(4, 6), None, torch.float32))
    with pytest.raises(ValueError, match="pack it in x's dtype"):
        kernels.gemm(torch.zeros(3, 6), kernels.pack(torch.zeros(4, 6), None, torch.bfloat16))
