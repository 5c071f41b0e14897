"""``--model PATH.gguf``: a GGUF file served through a prepared model directory.

The engine reads its model from a directory in three places: the loader (config.json,
generation_config.json, weights), the tokenizer files handed to frontends, and the
structured-output backend (tokenizer.json). Rather than teach each of them GGUF, a GGUF
file is turned once into a small directory in Tandem's cache that holds those files, plus
``gguf_source.json`` naming the GGUF file the weights are read from at every start::

    <cache>/gguf-v1/<file stem>-<key>/
      config.json  generation_config.json          <- gguf_metadata.py
      tokenizer.json  tokenizer_config.json  chat_template.jinja
                                                   <- transformers' GGUF tokenizer converter
      gguf_source.json                             <- written last: the directory is complete

The key hashes the GGUF's absolute path, size and modification time, so a changed file is
prepared again and the weights (which stay in the GGUF, never copied) always match the
prepared files. Preparing costs a few seconds (the tokenizer conversion imports
transformers); every later start reads only the GGUF's tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine_svc.model.load.gguf_metadata import GGUFError, generation_config, hf_config, open_gguf
from tandem_common.cache import cache_dir

logger = logging.getLogger(__name__)

# Bump when the prepared files change, so directories prepared by older code are not reused.
PREPARED_DIR_NAME = "gguf-v1"
SOURCE_FILE = "gguf_source.json"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``--model path`` names: the file itself, or the one GGUF file in a
    directory that holds no config.json. None for a Hugging Face directory (or nothing)."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise GGUFError(f"--model {path}: a file must be a GGUF (.gguf); otherwise give a model directory")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(f"--model {path}: the directory holds several GGUF files ({names}); name one")
    return found[0] if found else None


def resolve_model_dir(path: str | Path) -> tuple[Path, str]:
    """(directory to serve, model name) for ``--model path``: a Hugging Face directory
    as given, a GGUF file (or a directory with one) through its prepared directory."""
    gguf_path = find_gguf(path)
    if gguf_path is None:
        return Path(path), Path(path).name
    return prepare_gguf_dir(gguf_path), gguf_path.stem


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a prepared directory reads its weights from, or None for an ordinary one."""
    source = Path(model_dir) / SOURCE_FILE
    if not source.is_file():
        return None
    recorded = json.loads(source.read_text())
    path = Path(recorded["path"])
    if not path.is_file() or path.stat().st_size != recorded["size"]:
        raise FileNotFoundError(
            f"{model_dir} was prepared from {path}, which is gone or changed; serve that file again"
        )
    return path


def prepared_dir_for(gguf_path: Path) -> Path:
    gguf_path = gguf_path.absolute()
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / PREPARED_DIR_NAME / f"{gguf_path.stem}-{key}"


def prepare_gguf_dir(gguf_path: str | Path) -> Path:
    """The prepared directory of ``gguf_path``, made on first use (atomically: written under
    a temporary name and renamed, so concurrent engines never see half of one)."""
    gguf_path = Path(gguf_path).absolute()
    out = prepared_dir_for(gguf_path)
    if (out / SOURCE_FILE).is_file():
        return out
    logger.info("preparing %s for serving (config and tokenizer from its metadata)", gguf_path.name)
    reader = open_gguf(gguf_path)
    config = hf_config(reader, gguf_path)  # refuses what we cannot serve, before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(reader))
        del reader  # the tokenizer converter opens the file again
        _write_tokenizer(gguf_path, tmp)
        st = gguf_path.stat()
        _write_json(tmp / SOURCE_FILE, {"path": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        for child in tmp.iterdir():
            child.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / SOURCE_FILE).is_file():  # not merely another engine that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, by transformers'
    GGUF-to-fast-tokenizer converter (the one ``from_pretrained(gguf_file=...)`` uses)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as e:  # an unknown tokenizer model, missing tokenizer.ggml.* keys ...
        raise GGUFError(f"{gguf_path.name}: its tokenizer cannot be converted: {e}") from e
    tokenizer.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise GGUFError(f"{gguf_path.name}: its tokenizer did not convert to a fast tokenizer (tokenizer.json)")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
