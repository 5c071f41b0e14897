"""Where Tandem keeps files it builds for itself (the demo model, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR`` or ``$XDG_CACHE_HOME/tandem`` or ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tandem"
    return Path.home() / ".cache" / "tandem"
