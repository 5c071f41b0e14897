"""The KV cache's default size and its lazily zeroed memory (issue 18, item 14)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine_svc.model.attention import kv_memory
from engine_svc.model.attention.kv_memory import (
    allocate_kv_cache,
    bytes_per_block,
    default_num_kv_blocks,
    populate_kv_cache,
    size_kv_cache,
    zeroed,
)

CPU = torch.device("cpu")
MiB = 2**20


def blocks(monkeypatch, available: int | None, **kw) -> int:
    monkeypatch.setattr(kv_memory, "available_memory", lambda device: available)
    args = dict(bytes_per_block=MiB, block_size=16, max_num_seqs=8, max_model_len=1024, device=CPU)
    return default_num_kv_blocks(**{**args, **kw})


def test_enough_for_every_running_request_at_full_length(monkeypatch):
    # 8 requests x 1024 tokens / 16 per block = 512 blocks of 1 MiB, well under 40% of 10 GiB.
    assert blocks(monkeypatch, 10 * 1024 * MiB) == 512
    assert blocks(monkeypatch, None) == 512  # memory unknown: what the scheduler can use


def test_capped_by_the_memory_available(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="engine_svc.model.attention.kv_memory"):
        assert blocks(monkeypatch, 500 * MiB) == 200  # 40% of 500 MiB
    assert "capped at 40% of the 500.0 MiB available" in caplog.text


def test_never_below_one_full_length_request(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="engine_svc.model.attention.kv_memory"):
        assert blocks(monkeypatch, 100 * MiB) == 64  # 1024 tokens need 64 blocks, more than 40% of 100 MiB
    assert "allocating it anyway" in caplog.text


def test_a_full_length_request_beyond_all_the_memory_is_refused(monkeypatch):
    # A context of 2^32 tokens (a GGUF's context_length can say so) would map 256 TiB here.
    with pytest.raises(ValueError, match=r"one request of max_model_len 4294967296 tokens needs 262144.0 GiB, more "
                       r"than the 100.0 MiB available; set --max-model-len"):  # fmt: skip
        blocks(monkeypatch, 100 * MiB, max_model_len=2**32)
    with pytest.raises(ValueError, match="needs 64.0 MiB, more than the 64.0 MiB available"):
        blocks(monkeypatch, 64 * MiB - 1)  # 64 blocks of 1 MiB: just over


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident size from /proc")
def test_zeroed_cpu_memory_is_not_written_up_front():
    before = _rss_bytes()
    cache = zeroed((2, 256, 16, 16, 1024), torch.float32, CPU)  # 512 MiB
    assert _rss_bytes() - before < 64 * MiB  # torch.zeros would have written all of it
    assert cache.shape == (2, 256, 16, 16, 1024) and cache.is_contiguous()
    assert float(cache[1, 255].abs().sum()) == 0.0 and float(cache[0, 0, 0, 0, 0]) == 0.0
    cache[1, 2] = 1.5
    assert float(cache[1, 2].mean()) == 1.5 and float(cache[1, 3].sum()) == 0.0


def _pool(num_layers: int, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pool whose blocks take 1 MiB in each layer's K and V (16 tokens x 8 heads x 2048 floats)."""
    return allocate_kv_cache(
        num_layers=num_layers, num_blocks=num_blocks, block_size=16, num_kv_heads=8, head_dim=2048,
        dtype=torch.float32, device=CPU,
    )  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident size from /proc")
def test_populated_pool_is_resident_at_once_and_zero():
    pool = _pool(2, 32)  # 2 layers x 2 x 32 blocks x 1 MiB = 128 MiB
    before = _rss_bytes()
    assert populate_kv_cache(pool) == 32
    assert _rss_bytes() - before > 120 * MiB  # without populate: under 64 MiB (the test above)
    assert not any(t.any() for kv in pool for t in kv)
    pool[1][0][2] = 1.5
    assert float(pool[1][0][2].mean()) == 1.5 and float(pool[1][0][3].sum()) == 0.0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's resident size from /proc")
def test_populate_stops_at_its_time_limit_with_the_first_blocks_resident(monkeypatch):
    monkeypatch.setattr(kv_memory, "POPULATE_CHUNK_BYTES", 8 * MiB)  # 2 blocks of 2 layers' K and V
    pool = _pool(2, 64)  # 256 MiB
    ticks = iter(range(100))  # each look at the clock one "second" after the last
    assert populate_kv_cache(pool, seconds=3.0, clock=lambda: float(next(ticks))) == 4  # 2 chunks in time
    for k, v in pool:  # blocks 0-3 resident in every layer's K and V, the rest not touched
        for t in (k, v):
            assert _resident_mib(t[:4]) == 4 and _resident_mib(t[4:]) == 0
    assert populate_kv_cache(pool, seconds=0) == 64  # 0: no limit
    assert all(_resident_mib(t) == 64 for kv in pool for t in kv) and not any(t.any() for kv in pool for t in kv)


def _resident_mib(t: torch.Tensor) -> int:
    """MiB of ``t``'s pages (page-aligned, contiguous) that are resident, from mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    nbytes = t.numel() * t.element_size()
    assert t.is_contiguous() and t.data_ptr() % page == 0 and nbytes % page == 0
    vec = (ctypes.c_ubyte * (nbytes // page))()
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page // MiB


def _smaps(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address`` (Size, Rss ...
    in kB, VmFlags)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                fields = {}
                for rest in lines[i + 1 :]:
                    key, _, value = rest.partition(":")
                    fields[key] = value.strip()
                    if key == "VmFlags":
                        return fields
    raise AssertionError(f"no mapping holds {address:#x}")


def _smaps_flags(address: int) -> set[str]:
    return set(_smaps(address)["VmFlags"].split())


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's flags from /proc")
def test_zeroed_cpu_memory_is_private_without_huge_pages():
    cache = zeroed((4, 1024, 1024), torch.float32, CPU)  # kept: freed, it would be unmapped
    flags = _smaps_flags(cache.data_ptr())
    assert "sh" not in flags  # private: a shared anonymous map is shmem
    # 4 KiB pages: faulted lazily they cost a step less than 2 MiB ones, and memory the host
    # has not backed yet took far longer to populate in 2 MiB pages (model/attention/kv_memory.py)
    assert "hg" not in flags
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "nh" in flags  # MADV_NOHUGEPAGE: not even where THP's mode is "always"


def test_zeroed_in_half_precision():
    cache = zeroed((4, 3), torch.bfloat16, CPU)
    assert cache.dtype == torch.bfloat16 and torch.equal(cache, torch.zeros(4, 3, dtype=torch.bfloat16))


# -- the pool size from the flags, and the allocation -------------------------------------


def size(monkeypatch, **kw) -> int:
    monkeypatch.setattr(kv_memory, "available_memory", lambda device: None)
    args = dict(
        num_kv_blocks=None, kv_cache_bytes=None, bytes_per_block=MiB, block_size=16, max_num_seqs=8,
        max_model_len=1024, device=CPU,
    )  # fmt: skip
    return size_kv_cache(**{**args, **kw})


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    # 2 (K, V) x 3 layers x 16 tokens x 2 kv heads x 8 dims x 2 bytes (bfloat16)
    got = bytes_per_block(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert got == 2 * 3 * 16 * 2 * 8 * 2
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        bytes_per_block(num_layers=3, block_size=0, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_the_flags_choose_the_pool_size_before_the_default(monkeypatch, caplog):
    assert size(monkeypatch, num_kv_blocks=7, kv_cache_bytes=100 * MiB) == 7  # blocks win over bytes
    assert size(monkeypatch, kv_cache_bytes=100 * MiB + 5) == 100  # whole blocks only
    assert size(monkeypatch) == 512  # neither: the default (8 requests x 64 blocks)
    with caplog.at_level(logging.WARNING, logger="engine_svc.model.attention.kv_memory"):
        assert size(monkeypatch, num_kv_blocks=10) == 10
    assert "KV cache holds 160 tokens, less than max_model_len 1024" in caplog.text


def test_a_pool_of_no_block_says_what_a_block_needs(monkeypatch):
    with pytest.raises(ValueError, match="a block needs 1048576 bytes .*kv_cache_bytes=1000"):
        size(monkeypatch, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="num_kv_blocks=0"):
        size(monkeypatch, num_kv_blocks=0)


def test_every_layer_gets_its_own_zeroed_k_and_v():
    caches = allocate_kv_cache(
        num_layers=3, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, device=CPU
    )
    assert len(caches) == 3
    assert all(t.shape == (4, 2, 1, 8) and not t.any() for kv in caches for t in kv)
    caches[1][0].fill_(1.0)  # views of one tensor, but no two layers (or K and V) share memory
    assert caches[1][0].all() and not caches[1][1].any() and not caches[0][0].any() and not caches[2][0].any()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's resident size from /proc")
def test_engine_flag_populates_its_pool(demo_model_dir):
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.core import EngineCore

    def resident_fraction(*flags: str) -> float:
        argv = ["--model", str(demo_model_dir), "--num-kv-blocks", "256", "--block-size", "16", *flags]
        core = EngineCore(EngineConfig.from_args(build_parser().parse_args(argv)))
        fields = _smaps(core.runner.kv_caches[0][0].data_ptr())
        return int(fields["Rss"].split()[0]) / int(fields["Size"].split()[0])

    assert resident_fraction("--kv-cache-populate") == 1.0
    assert resident_fraction() < 0.5  # the default: pages come as blocks are first used


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    from tests.model_factory import make_model_dir

    # 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes: 512 bytes of float32 KV cache per token.
    return make_model_dir(tmp_path_factory.mktemp("long") / "model", vocab_size=256, max_position_embeddings=1 << 20)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the native rotary table needs the native kernels")
def test_max_model_len_sizes_the_rope_table_not_the_models_context(long_context_model):
    from engine_svc.model.runner import ModelRunner

    runner = ModelRunner(str(long_context_model), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
                         kv_cache_bytes=None, max_model_len=512)  # fmt: skip
    assert runner.model.rotary.cos_sin.shape[0] == 512  # not the 1,048,576 positions of the model's context


@pytest.mark.skipif(shutil.which("cc") is None, reason="the native rotary table needs the native kernels")
@pytest.mark.parametrize("pool", [{"num_kv_blocks": 64}, {"kv_cache_bytes": 64 * 16 * 512}])
def test_a_pool_given_by_flag_bounds_the_rope_table(long_context_model, pool):
    from engine_svc.model.runner import ModelRunner

    # No --max-model-len: the model's context, 1,048,576 tokens, is served; but a pool of 64
    # blocks of 16 holds 1,024 tokens, and no request can ever reach a position past them.
    runner = ModelRunner(str(long_context_model), device="cpu", dtype="float32", block_size=16,
                         **{"num_kv_blocks": None, "kv_cache_bytes": None, **pool}, max_model_len=None)  # fmt: skip
    assert runner.max_model_len == 1 << 20
    assert runner.model.rotary.cos_sin.shape[0] == 1024


def test_a_context_no_memory_holds_is_refused_before_the_weights_load(long_context_model, monkeypatch):
    from engine_svc.model.runner import ModelRunner

    # One request of 1,048,576 tokens needs 512 MiB of KV cache; say 100 MiB are available.
    monkeypatch.setattr(kv_memory, "available_memory", lambda device: 100 * MiB)
    with pytest.raises(ValueError, match=r"one request of max_model_len 1048576 tokens needs 512.0 MiB, more than the "
                       r"100.0 MiB available; set --max-model-len"):  # fmt: skip
        ModelRunner(str(long_context_model), device="cpu", dtype="float32", block_size=16, num_kv_blocks=None,
                    kv_cache_bytes=None, max_model_len=None)  # fmt: skip
