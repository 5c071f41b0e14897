"""Who made a call and how it ended: the plain values a face hands the call's lifecycle.

    gRPC context  ── caller_of (servicer) ──▶ Caller(metadata, peer, deadline)
    HTTP request  ── caller_of (http)     ──▶ Caller(headers, peer)
    GenerateCall ... ──▶ Outcome            (metrics label, log line, span; each face answers in its own words)

An Outcome is numbered and named as the gRPC status of the same meaning, the one
vocabulary both faces' figures are kept in: the span's ``rpc.grpc.status_code`` is its
number, the requests counter and the log line its name. No grpc here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from tandem_common.types import ErrorCode

# gRPC's deadline timer and the clock this reads may disagree a little.
DEADLINE_SLACK_S = 0.05


class Outcome(enum.Enum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, code: ErrorCode) -> Outcome:
        return cls[code.value]  # ErrorCode values are the status names


@dataclass(frozen=True)
class Caller:
    """The client of one call: its metadata or headers as (name, value) pairs (trace
    context, API key), its address as gRPC writes a peer (``ipv4:1.2.3.4:5678``), and the
    ``time.monotonic()`` at which its deadline passes (None: it set none)."""

    metadata: tuple[tuple[str, str | bytes], ...] = ()
    peer: str = ""
    deadline: float | None = None

    def gone(self) -> Outcome:
        """How a call the client ended did end: its deadline passed (gRPC cancels the handler
        then, as for a cancel), or it was cancelled."""
        if self.deadline is not None and time.monotonic() > self.deadline - DEADLINE_SLACK_S:
            return Outcome.DEADLINE_EXCEEDED
        return Outcome.CANCELLED
