"""Resident memory of a running process, from Linux's /proc: what a server really holds.

    resident(pid, file=PATH)   {"rss_mib", "anon_mib", "file_mib", "peak_rss_mib", "file_mapped_mib"}

``rss_mib`` is the process's resident set now (anonymous plus file-backed pages),
``peak_rss_mib`` its high-water mark, ``file_mapped_mib`` the resident pages of the
mappings of ``file`` (a memory-mapped model file's weights: what a reader of the file
keeps in memory without copying it).
"""

from __future__ import annotations

import os
from pathlib import Path

MIB = 2**20


def _kib_fields(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key.strip()] = int(parts[0])
    return out


def file_mapped_kib(smaps: str, file: str) -> int:
    """Resident KiB of every mapping of ``file`` in a /proc/PID/smaps text."""
    target, total, inside = os.path.realpath(file), 0, False
    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
            inside = len(head) == 6 and os.path.realpath(head[5].strip()) == target
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def resident(pid: int, file: str | None = None) -> dict[str, float]:
    proc = Path(f"/proc/{pid}")
    rollup = _kib_fields((proc / "smaps_rollup").read_text())
    status = _kib_fields((proc / "status").read_text())
    out = {
        "rss_mib": rollup["Rss"] / 1024,
        "anon_mib": rollup.get("Anonymous", 0) / 1024,
        "file_mib": (rollup["Rss"] - rollup.get("Anonymous", 0)) / 1024,
        "peak_rss_mib": status.get("VmHWM", 0) / 1024,
    }
    if file is not None:
        out["file_mapped_mib"] = file_mapped_kib((proc / "smaps").read_text(), file) / 1024
    return out
