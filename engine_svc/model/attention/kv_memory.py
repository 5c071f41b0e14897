"""The KV cache's memory: its size in blocks, and an allocation that is zero without a fill.

    bytes_per_block(...)     K and V of every layer for block_size tokens
    size_kv_cache(...)       --num-kv-blocks, else --kv-cache-bytes, else the default below
    allocate_kv_cache(...)   one (k_cache, v_cache) pair per layer, views of one zeroed tensor
    populate_kv_cache(...)   its pages resident, first blocks first, within a time limit

Default size, when neither --num-kv-blocks nor --kv-cache-bytes is given::

    wanted = max_num_seqs x max_model_len tokens      every running request at full length
    cap    = 40% of the memory available at start      CPU: MemAvailable, or the cgroup's room
           | 80% of free device memory                 CUDA, after the weights are loaded
    floor  = max_model_len tokens                       one full-length request
    blocks = max(floor, min(wanted, cap)) / tokens per block

so a small model gets a small cache, a large one as much as the machine can spare, and
every request that fits the context fits the cache. A floor above the cap is allocated
anyway, with a warning (the pages are touched only as blocks are used); a floor above all
the memory available is refused at start, before anything is allocated, naming
--max-model-len: no request could ever reach it, and a model's context length (a GGUF's
``context_length`` says what the file wants) would otherwise size a map of terabytes.

On CPU the cache is a private anonymous memory map: the kernel hands out zero pages as
they are first touched, so start-up does not write the whole cache and the resident size
grows with the blocks actually used. (It must read as zeros, not garbage: masked padding
reads unused slots, and 0 x NaN is NaN.)

That first touch is not free: a fault and the page's zeroing, and on a virtual machine
often the host's own fault behind it. Measured on a 2-core Zen 5 VM (the 135M benchmark
model, a 2 GiB pool, the standard workload): lazily faulted pages cost the run's steps
0.3-1.2 s of 20-23 (the K/V writes of the step that first uses a block).
``--kv-cache-populate`` (populate_kv_cache below) takes them off the steps: it writes the
pool at start, as servers that reserve their KV memory at start do, block by block in the
order the block manager hands blocks out (lowest ids first), for at most
``--kv-cache-populate-seconds``; the blocks past that fault in on first use. Memory the
host has not backed yet is slow to touch on such a VM: 2 GiB populated in 2-6.5 s in 4 KiB
pages (0.1-0.5 s from memory the guest had used before), and 256 MiB took 2.5-2.8 s in
2 MiB pages (transparent huge pages) where 4 KiB pages took 0.11-0.14 s in the same state,
and faulted in lazily 2 MiB pages cost the steps more too (benchmarks.offline, standard
workload: 391-405 against 429-434 tok/s): the map opts out of huge pages (populated runs
measured the same with and without them).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CPU_MEMORY_FRACTION = 0.4
GPU_MEMORY_FRACTION = 0.8


def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, every layer. ValueError for a block size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def size_kv_cache(
    *,
    num_kv_blocks: int | None,
    kv_cache_bytes: int | None,
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    """The pool size in blocks: ``num_kv_blocks`` if given, else what ``kv_cache_bytes``
    holds, else ``default_num_kv_blocks``. ValueError when that is no block at all."""
    if num_kv_blocks is None and kv_cache_bytes is not None:
        num_kv_blocks = kv_cache_bytes // bytes_per_block
    elif num_kv_blocks is None:
        num_kv_blocks = default_num_kv_blocks(
            bytes_per_block=bytes_per_block,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            device=device,
        )
    if num_kv_blocks < 1:
        raise ValueError(
            f"KV cache holds no block: a block needs {bytes_per_block} bytes "
            f"(got num_kv_blocks={num_kv_blocks}, kv_cache_bytes={kv_cache_bytes})"
        )
    if num_kv_blocks * block_size < max_model_len:
        logger.warning(
            "KV cache holds %d tokens, less than max_model_len %d", num_kv_blocks * block_size, max_model_len
        )
    return num_kv_blocks


def allocate_kv_cache(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].

    Zeroed, not empty: masked padding reads these slots, and softmax weight 0 times a
    garbage NaN would still be NaN."""
    cache = zeroed((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]


POPULATE_CHUNK_BYTES = 64 << 20  # about this much written between looks at the clock


def populate_kv_cache(
    pools: list[tuple[torch.Tensor, torch.Tensor]], seconds: float | None = None, clock=time.perf_counter
) -> int:
    """Makes the CPU pages of ``pools`` (per layer (k, v), [num_blocks, ...] each, every
    pair with the same block count: a target's and its drafter's) resident by writing zeros
    over them, block by block from block 0 (the block manager hands out the lowest free ids
    first), until every block is or ``seconds`` have passed (None or 0: no limit). Returns
    how many of the first blocks are resident; the rest fault in on first use. Only for a
    pool no step has written yet: what it writes is zeros. ``clock``: seconds, for tests."""
    if not pools:
        return 0
    num_blocks = pools[0][0].shape[0]
    if pools[0][0].device.type != "cpu":
        return num_blocks  # device memory is allocated whole
    block_bytes = sum(2 * k[0].numel() * k.element_size() for k, _ in pools)
    chunk = max(1, POPULATE_CHUNK_BYTES // max(1, block_bytes))
    start, done = clock(), 0
    while done < num_blocks and not (seconds and clock() - start >= seconds):
        hi = min(num_blocks, done + chunk)
        for k, v in pools:
            k[done:hi].zero_()  # across torch's threads: the host's page faults overlap
            v[done:hi].zero_()
        done = hi
    return done


def default_num_kv_blocks(
    *, bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int, device: torch.device
) -> int:
    """The default pool size in blocks (see the module docstring); logs how it was chosen."""
    blocks_per_request = -(-max_model_len // block_size)
    wanted = max_num_seqs * blocks_per_request
    available = available_memory(device)
    fraction = GPU_MEMORY_FRACTION if device.type == "cuda" else CPU_MEMORY_FRACTION
    if available is None:
        logger.info("KV cache: %d blocks, enough for %d requests of %d tokens", wanted, max_num_seqs, max_model_len)
        return wanted
    cap = int(available * fraction) // bytes_per_block
    num_blocks = max(blocks_per_request, min(wanted, cap))
    mib = num_blocks * bytes_per_block / 2**20
    check_one_request_fits(
        bytes_per_block=bytes_per_block, block_size=block_size, max_model_len=max_model_len, device=device
    )
    if blocks_per_request > cap:
        logger.warning(
            "KV cache: one request of max_model_len %d tokens needs %.1f MiB, more than %d%% of the %.1f MiB "
            "available; allocating it anyway. Lower --max-model-len or set --kv-cache-bytes",
            max_model_len,
            mib,
            round(fraction * 100),
            available / 2**20,
        )
    elif num_blocks < wanted:
        logger.info(
            "KV cache: %d blocks (%.1f MiB), capped at %d%% of the %.1f MiB available; %d requests of "
            "max_model_len %d would need %d. Set --kv-cache-bytes or --num-kv-blocks to choose",
            num_blocks,
            mib,
            round(fraction * 100),
            available / 2**20,
            max_num_seqs,
            max_model_len,
            wanted,
        )
    else:
        logger.info(
            "KV cache: %d blocks (%.1f MiB), enough for %d requests (--max-num-seqs) of max_model_len %d",
            num_blocks,
            mib,
            max_num_seqs,
            max_model_len,
        )
    return num_blocks


def check_one_request_fits(*, bytes_per_block: int, block_size: int, max_model_len: int, device: torch.device) -> None:
    """ValueError, naming --max-model-len, when one request of ``max_model_len`` tokens needs
    more KV cache than all the memory available (the module docstring; nothing if unknown)."""
    available = available_memory(device)
    needed = -(-max_model_len // block_size) * bytes_per_block
    if available is not None and needed > available:
        raise ValueError(
            f"KV cache: one request of max_model_len {max_model_len} tokens needs {_size(needed)}, more than "
            f"the {_size(available)} available; set --max-model-len (default: the model's context length) "
            "or --kv-cache-bytes"
        )


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def available_memory(device: torch.device) -> int | None:
    """Bytes the KV cache could take now: free device memory, or on CPU the system's
    available memory, bounded by the cgroup's limit (a container's); None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    figures = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    return min(figures) if figures else None


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU backed by pages the kernel zeroes on first touch."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Anonymous and private (mmap's default is shared, which Linux backs with shmem).
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # 4 KiB pages even where the kernel's THP mode is ``always`` (see the module docstring).
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel built without THP
            pass
    # frombuffer keeps ``buffer`` alive as long as the tensor (or a view of it) lives.
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1); None if unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1 reports "no limit" as a huge number
            return None
        return max(0, limit - usage)
    return None
