"""The routing policy, in plain values: which engine gets a request, and why.

    EngineRouter.route() ── one Candidate per available engine ──▶ choose() ──▶ (index, reason)

Two policies (``--routing``):

* ``least-load``: the engine with the least load; ties at random.
* ``prefix``: the engine that holds the longest cached prefix of the prompt, unless that
  engine is too loaded. In numbers, for each available engine e:

      hit(e)  = prompt tokens e would serve from its prefix cache, as predicted from the
                blocks it published (leading blocks it holds x block size, under the
                engine's own lookup rules: none when prompt logprobs are asked for, and
                never the prompt's last token)
      load(e) = tokens queued and running on e (see EngineClient.load_tokens)
      band    = engines with load(e) <= min over engines of load + threshold
      pick    = the engine in band with the largest hit; ties: the lower load, then at random.
                When no engine in band caches any of the prompt, the one caching the fewest
                blocks (the most room for a new prefix, so that prefixes spread over the
                engines' caches), then the lower load, then at random

  so one hot prefix fills its engine only until that engine carries ``threshold`` tokens
  more than the least loaded one; then requests spill over (the next engine caches the
  prefix too, and from then on both are in the running).

Reasons (the ``reason`` label of tandem_frontend_routing_decisions_total):
``least_load`` (the least-load policy), ``single_engine`` (prefix policy, one engine to
choose from: nothing is hashed), ``prefix_hit`` (the pick holds the longest cached prefix
of all engines), ``load_fallback`` (a more loaded engine outside the band held a longer
one), ``no_hit`` (no engine holds the prompt's first block: the least loaded one in band).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A few requests' worth of context on a CPU engine: on the benchmark's multi-prefix workload
# (benchmarks/figures/serving.md) 2048 kept 9 in 10 prompts on their engine while keeping queues even,
# where 8192 let bursts of one prefix queue on one engine. GPU engines that run hundreds of
# requests carry far more tokens and want a threshold to match (--routing-load-threshold).
DEFAULT_LOAD_THRESHOLD_TOKENS = 2048


class RoutingPolicy(enum.Enum):
    LEAST_LOAD = "least-load"
    PREFIX = "prefix"


class RoutingReason(enum.Enum):
    LEAST_LOAD = "least_load"
    SINGLE_ENGINE = "single_engine"
    PREFIX_HIT = "prefix_hit"
    LOAD_FALLBACK = "load_fallback"
    NO_HIT = "no_hit"


@dataclass(frozen=True)
class Candidate:
    """What the policy knows of one engine for one request."""

    load_tokens: int
    hit_tokens: int = 0
    num_cached_blocks: int = 0


def least_loaded(candidates: Sequence[Candidate], rand: Callable[[], float] = random.random) -> int:
    """The index of the least loaded candidate (at least one); ties at random."""
    return min(range(len(candidates)), key=lambda i: (candidates[i].load_tokens, rand()))


def choose_by_prefix(
    candidates: Sequence[Candidate], threshold_tokens: int, rand: Callable[[], float] = random.random
) -> tuple[int, RoutingReason]:
    """The prefix policy over ``candidates`` (at least one); returns the pick's index and why."""
    least = min(c.load_tokens for c in candidates)
    band = [i for i, c in enumerate(candidates) if c.load_tokens <= least + threshold_tokens]
    if any(candidates[i].hit_tokens for i in band):
        pick = max(band, key=lambda i: (candidates[i].hit_tokens, -candidates[i].load_tokens, rand()))
    else:
        pick = min(band, key=lambda i: (candidates[i].num_cached_blocks, candidates[i].load_tokens, rand()))
    best_hit = max(c.hit_tokens for c in candidates)
    if best_hit == 0:
        return pick, RoutingReason.NO_HIT
    if candidates[pick].hit_tokens < best_hit:
        return pick, RoutingReason.LOAD_FALLBACK
    return pick, RoutingReason.PREFIX_HIT
