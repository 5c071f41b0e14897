"""An engine started on a GGUF file that lies about its shape refuses it at start: one line
naming the file and the key, no traceback, exit code 1, within seconds and without building
anything the lie asks for (peak RSS that of an engine that has loaded nothing).

The files are written here (tests/gguf_factory.py); the honest one is served, so each
refusal is the lie's alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.gguf_factory import write_tiny_gguf
from tests.services import start_engine

LIES = {
    "block_count": (dict(metadata={"llama.block_count": 10**6}), "llama.block_count is 1000000"),
    "head_count": (dict(metadata={"llama.attention.head_count": 0}), "llama.attention.head_count is 0"),
    "vocab_size": (dict(metadata={"llama.vocab_size": 10**8}), "llama.vocab_size is 100000000"),
    "tensor_shape": (dict(shapes={"blk.1.attn_q.weight": (48, 64)}), "tensor blk.1.attn_q.weight is [48, 64]"),
    "context_length": (dict(metadata={"llama.context_length": 2**32}), "llama.context_length is 4294967296"),
}
PEAK_RSS_BOUND_MIB = 1536  # an engine that has imported torch and read the header: ~250-650 MiB


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_gguf_is_refused_at_start_in_one_line(tmp_path, lie):
    options, words = LIES[lie]
    path = write_tiny_gguf(tmp_path / "lying.gguf", **options)
    engine = start_engine(path, env={"TANDEM_CACHE_DIR": str(tmp_path / "cache")})
    peak, deadline = 0.0, time.monotonic() + 120
    try:
        while engine.proc.poll() is None and time.monotonic() < deadline:
            try:
                peak = max(peak, _peak_rss_mib(engine.proc.pid))
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.05)
        assert engine.proc.poll() == 1, f"still running (peak RSS {peak:.0f} MiB):\n{engine.log()[-2000:]}"
    finally:
        engine.terminate(timeout=10)
    log = engine.log()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"failed to load the model: lying.gguf: {words}" in errors[0], log
    assert "Traceback" not in log, log
    assert peak < PEAK_RSS_BOUND_MIB, peak


def test_the_honest_file_is_served(tmp_path):
    engine = start_engine(write_tiny_gguf(tmp_path / "honest.gguf"), env={"TANDEM_CACHE_DIR": str(tmp_path / "c")})
    try:
        engine.wait_serving(180)
    finally:
        engine.terminate()
