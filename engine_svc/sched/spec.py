"""Speculative decoding, the scheduler's side: which draft tokens a decoding request gets
this step, and what verification made of them. No torch here.

    schedule():  Speculator.propose(request, num_budget_left) -> draft_token_ids
                 (prompt lookup: the tokens that followed the latest earlier occurrence
                 of the request's last n tokens, n from prompt_lookup_max down to min)
    runner:      verifies the 1 + k positions in one step (``engine_svc/model/spec/``)
    update:      Speculator.record(request_id, num_drafted, num_accepted)

A draft costs its KV slots and k rows of the token budget for one step; the scheduler
reserves them with the real token (``allocate_slots(request, 1 + k)``) and gives the
slots of rejected positions back implicitly: ``num_computed_tokens`` only moves past the
accepted drafts, so a rejected position is never part of a committed (hashed) block and
is overwritten by the next step.

Adaptive rule (``propose``), so that no load is meaningfully slower than without drafts:
* off when more than ``disable_by_batch_size`` requests run: at that batch the step is
  bound by arithmetic, not by reading the weights, and every draft row costs about what
  a real token does;
* per request, the draft length follows its measured acceptance ``a`` (an exponential
  average over its verifications, starting at 1): ``k = ceil(k_max * a)``; under
  ``min_acceptance`` it stops drafting and probes with one draft every
  ``PROBE_INTERVAL`` steps, so a request whose text starts copying gets drafts again;
* never past ``max_tokens`` or ``max_model_len``, and never more than the budget left.

Every sampling parameter and output constraints stay exact (docs/speculative.md).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

from engine_svc.outputs import SpecDecodeStats
from engine_svc.sched.request import Request

logger = logging.getLogger(__name__)

METHODS = ("ngram",)
# Verifications between two log lines with the running acceptance.
LOG_INTERVAL = 1000
# Weight of the newest verification in a request's acceptance average.
ACCEPTANCE_EWMA = 0.3
# Steps between one-token probes of a request whose acceptance fell under min_acceptance.
PROBE_INTERVAL = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: a JSON object, keys as vLLM spells them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 16
    min_acceptance: float = 0.1

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse and check; a ValueError names the key to fix."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError('--speculative-config must be a JSON object, e.g. \'{"method": "ngram"}\'')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"--speculative-config: method {self.method!r} is not supported; expected one of {METHODS}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not isinstance(self.min_acceptance, (int, float)) or not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"--speculative-config: min_acceptance must be in [0, 1], got {self.min_acceptance!r}")


def propose_ngram(token_ids: list[int], num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup: up to ``num_tokens`` tokens that followed the latest earlier
    occurrence of the last n tokens of ``token_ids``, trying the longest n first.

    The latest occurrence, not the first: in a copy the text being reproduced is the
    nearest one. O(len(token_ids)) per n; the first-token test skips most positions.
    """
    length = len(token_ids)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = token_ids[length - n :]
        first = suffix[0]
        # A match at i covers [i, i + n) and must leave at least one token after it.
        for i in range(length - n - 1, -1, -1):
            if token_ids[i] == first and token_ids[i : i + n] == suffix:
                return token_ids[i + n : i + n + num_tokens]
    return []


@dataclass
class SpecStats:
    """Speculation since the engine started (totals), kept by the step thread; metrics
    read ``snapshot()``."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose position i was accepted
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> SpecDecodeStats:
        """A frozen copy for other threads (``EngineStats.spec_decode``)."""
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_position)
        )


@dataclass
class _RequestSpec:
    acceptance: float = 1.0
    num_skipped: int = 0  # steps since the last draft while under min_acceptance


class Speculator:
    """Proposes drafts for the scheduler and keeps the acceptance figures."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        config.check()
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._requests: dict[str, _RequestSpec] = {}

    def propose(self, request: Request, num_running: int, num_budget_left: int) -> list[int]:
        """Draft tokens for ``request``'s next step (it decodes one token), or []."""
        config = self.config
        if num_running > config.disable_by_batch_size:
            return []
        params = request.sampling_params
        num_max = min(
            config.num_speculative_tokens,
            params.max_tokens - request.num_output_tokens - 1,  # the bonus token comes on top
            self.max_model_len - request.num_tokens - 1,
            num_budget_left,
        )
        if num_max <= 0:
            return []
        state = self._requests.setdefault(request.request_id, _RequestSpec())
        if state.acceptance < config.min_acceptance:
            state.num_skipped += 1
            if state.num_skipped < PROBE_INTERVAL:
                return []
            state.num_skipped = 0
            num_max = 1
        else:
            num_max = min(num_max, max(1, math.ceil(config.num_speculative_tokens * state.acceptance)))
        return propose_ngram(request.all_token_ids, num_max, config.prompt_lookup_min, config.prompt_lookup_max)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """One verification of ``num_drafted`` drafts, of which the first ``num_accepted`` held."""
        if num_drafted == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_position[i] += 1
        state = self._requests.get(request_id)
        if state is not None:
            state.acceptance += ACCEPTANCE_EWMA * (num_accepted / num_drafted - state.acceptance)
        if stats.num_drafts % LOG_INTERVAL == 0:
            logger.info(
                "speculative decoding: %d drafts, acceptance %.1f%%, mean accepted length %.2f",
                stats.num_drafts,
                100 * stats.acceptance_rate,
                stats.mean_accepted_length,
            )

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
