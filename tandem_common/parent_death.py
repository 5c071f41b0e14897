"""A child process that dies with its parent: Linux's PR_SET_PDEATHSIG, nothing elsewhere.

Used by ``tandem serve`` (its engine and frontend) and by the frontend's ``--workers``
parent (its workers), so that a parent killed outright (SIGKILL) leaves no process behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A function for the child to call first (a ``preexec_fn``, or the first line of a
    spawned process): the kernel SIGTERMs the child when ``parent_pid`` dies. None where
    that is not available. Resolved here, before any fork: the child only calls into libc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return arm
