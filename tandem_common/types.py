"""Values both services speak of: why a request ended, in-band error classes, logprobs.

Plain Python (no protobuf, no torch): each service converts its protobuf messages into
these at its boundary.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a request ended. The values are the metric and log labels."""

    STOP = "stop"  # EOS, a stop token id or (frontend side) a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the client or because its stream ended
    ERROR = "error"  # refused or failed; the output carries the error
    TOOL_CALLS = "tool_calls"  # (frontend side) a STOP whose answer holds tool calls


class ErrorCode(enum.Enum):
    """In-band error classes; each maps one to one onto the gRPC status of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"  # a LoRA adapter (a model name) the engine does not hold
    # Never in band: answers of the engines' LoRA admin RPCs.
    ALREADY_EXISTS = "ALREADY_EXISTS"
    # Never in band: a frontend that cannot serve until its operator acts (no tokenizer).
    FAILED_PRECONDITION = "FAILED_PRECONDITION"


@dataclass
class Logprob:
    """The chosen token's log-probability, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
