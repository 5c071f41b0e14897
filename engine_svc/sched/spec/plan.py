"""The adaptive rule: how many draft tokens each decoding request verifies this step.

A step of ``R`` rows takes ``T(R)`` seconds (``costs.py``, measured); a request whose
drafts are accepted with chance ``a`` each (given the ones before were: ``stats.py``)
yields ``1 + a + a^2 + ... + a^k`` tokens from ``k`` drafts. The draft tokens of all
requests, best expected gain first (request r's j-th draft gains ``a_r^j``), are taken
while they raise the step's expected output per second:

    choose m (0 <= m <= the drafts on offer) maximising
        (num_outputs + sum of the m best gains) / (T(num_rows + m) + D)

where D is what drafting costs besides the rows: nothing for prompt lookup, and for a
draft model the passes it runs, ``sum_j Tdraft(requests still drafting at pass j)``, plus
each drafting request's ``setup_seconds``: the share of this step in its catch-up, the
draft's first pass over the tokens its cache lacks (the whole prompt of a new request),
which the speculator spreads over the steps the request is expected to draft in.
A request's drafts enter in order, so each gets a prefix of its own. At a few requests a
step reads the weights once whatever its rows, T grows slowly and long drafts pay; at
many, every row costs about what a request's own token does, and only drafts that are
nearly always right pay, or none (m = 0: the step is exactly a step without speculation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Offer:
    """A decoding request's possible drafts: up to ``num_tokens``, each accepted with
    chance ``acceptance`` given the ones before were; drafting at all costs the step
    ``setup_seconds`` more (a draft model's catch-up, amortized)."""

    request_id: str
    acceptance: float
    num_tokens: int
    setup_seconds: float = 0.0


@dataclass(frozen=True)
class DraftPlan:
    counts: dict[str, int]  # draft tokens per request id (absent: none)
    seconds: float  # the step's expected cost with them, before ``cost_factor``


def choose_drafts(
    offers: list[Offer],
    *,
    num_rows: int,
    num_outputs: int,
    max_drafts: int | None = None,
    step_seconds: Callable[[int], float],
    draft_pass_seconds: Callable[[int], float] | None = None,
    cost_factor: float = 1.0,
    min_gain: float = 1.0,
) -> DraftPlan:
    """Draft tokens per request id for a step of ``num_rows`` rows without drafts,
    ``num_outputs`` of them yielding a token, at most ``max_drafts`` in all (the budget
    left), and the step's expected cost with them. A step with drafts is taken to cost
    ``cost_factor`` times what the costs say, and drafts are taken only where they promise
    ``min_gain`` times the output rate of the step without. See the module docstring."""
    gains = sorted(
        ((o.acceptance**j, j, i) for i, o in enumerate(offers) for j in range(1, o.num_tokens + 1)),
        key=lambda g: (-g[0], g[1], g[2]),
    )
    if max_drafts is not None:
        gains = gains[:max_drafts]
    base = step_seconds(num_rows)
    if not gains or base <= 0.0:
        return DraftPlan({}, base)
    tokens = float(num_outputs)
    best_m, best_rate, best_seconds = 0, tokens / base * min_gain, base
    pass_rows: list[int] = []  # pass_rows[j - 1]: requests drafting a j-th token so far
    draft_seconds = 0.0
    for m, (gain, j, i) in enumerate(gains, start=1):
        tokens += gain
        if draft_pass_seconds is not None:
            if len(pass_rows) < j:
                pass_rows.append(0)
            before = draft_pass_seconds(pass_rows[j - 1]) if pass_rows[j - 1] else 0.0
            pass_rows[j - 1] += 1
            draft_seconds += draft_pass_seconds(pass_rows[j - 1]) - before
        if j == 1:
            draft_seconds += offers[i].setup_seconds
        seconds = step_seconds(num_rows + m) + draft_seconds
        rate = tokens / (seconds * cost_factor)
        if rate > best_rate:
            best_m, best_rate, best_seconds = m, rate, seconds
    counts: dict[str, int] = {}
    for _, _, i in gains[:best_m]:
        request_id = offers[i].request_id
        counts[request_id] = counts.get(request_id, 0) + 1
    return DraftPlan(counts, best_seconds)
