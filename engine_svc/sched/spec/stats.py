"""Speculation's totals since the engine started, and each request's acceptance estimate."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.outputs import SpecDecodeStats

# Weight kept by a request's (and the engine's) acceptance counts at each verification:
# a request's estimate follows its last few verifications, the engine's its last hundred.
REQUEST_DECAY = 0.7
POOL_DECAY = 0.99
# Trials of the engine-wide rate a request's estimate starts from (and keeps as a prior).
PRIOR_WEIGHT = 2.0
# The engine-wide rate before any verification: optimistic enough that a first draft is tried.
INITIAL_ACCEPTANCE = 0.7


@dataclass
class SpecStats:
    """Totals, kept by the step thread; metrics read ``snapshot()``. Drafts an output
    constraint cut before verification are not counted: they were never verified."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose position i was accepted
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.snapshot().acceptance_rate

    @property
    def mean_accepted_length(self) -> float:
        return self.snapshot().mean_accepted_length

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        """A frozen copy for other threads (``EngineStats.spec_decode``)."""
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_position)
        )


@dataclass
class Acceptance:
    """The chance that a draft token is accepted given the ones before it were: a draft
    position is a trial, accepted ones succeed, the first rejected one fails, later ones
    were never reached. Counts decay at each verification, so the estimate follows change."""

    decay: float
    successes: float = 0.0
    failures: float = 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.successes = self.decay * self.successes + num_accepted
        self.failures = self.decay * self.failures + (1.0 if num_accepted < num_drafted else 0.0)

    def rate(self, prior: float, prior_weight: float) -> float:
        """The estimate, with ``prior_weight`` trials of ``prior`` mixed in."""
        return (self.successes + prior_weight * prior) / (self.successes + self.failures + prior_weight)
