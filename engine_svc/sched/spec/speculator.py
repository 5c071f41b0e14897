"""The scheduler's speculator: each step, which draft tokens the decoding requests get.

    schedule():  Speculator.plan(running, budget) -> {request id: draft token ids}
    runner:      verifies the 1 + k rows of each in the step (``engine_svc/model/spec/``)
    update:      Speculator.record(request id, drafts verified, accepted)
                 Speculator.observe(scheduler output, runner output): the step's cost

A draft costs its KV slots and k rows of the token budget for one step; the scheduler
reserves them with the real token (``allocate_slots(request, 1 + k)``) and gives the
slots of rejected positions back implicitly: ``num_computed_tokens`` only moves past the
accepted drafts, so a rejected position is never part of a committed (hashed) block and
is overwritten by the next step.

Draft tokens come from prompt lookup (``ngram.py``), or, for a draft model, are
``MODEL_DRAFT`` slots the runner's draft model fills in the step itself. How many each
request gets is the adaptive rule's (``plan.py``, from the acceptance measured per request
and the step costs measured on this machine, ``costs.py``), never more than
``num_speculative_tokens``, and never past ``max_tokens``, ``max_model_len`` or the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine_svc.outputs import MODEL_DRAFT, ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from engine_svc.sched.request import Request
from engine_svc.sched.spec.config import SpeculativeConfig
from engine_svc.sched.spec.costs import StepCosts, calibration_sizes
from engine_svc.sched.spec.ngram import NgramIndex
from engine_svc.sched.spec.plan import Offer, choose_drafts
from engine_svc.sched.spec.speculation import Timer
from engine_svc.sched.spec.stats import (
    INITIAL_ACCEPTANCE,
    POOL_DECAY,
    PRIOR_WEIGHT,
    REQUEST_DECAY,
    Acceptance,
    SpecStats,
)

logger = logging.getLogger(__name__)

# Verifications between two log lines with the running acceptance.
LOG_INTERVAL = 1000

# A draft model's catch-up is spread over at most this many of the request's steps.
CATCH_UP_HORIZON = 32

# How the measured cost of steps with drafts against their expected cost is followed
# (an average decaying by 1 - RATIO_WEIGHT a step), and the bounds of the correction.
RATIO_WEIGHT = 0.1
# Each plain step forgets this much of that correction, so a rule that stopped drafting
# tries again (after about a hundred steps) rather than never learning that it would pay.
RATIO_FORGET = 0.01
MIN_COST_FACTOR, MAX_COST_FACTOR = 0.8, 4.0
# A draft model's drafts are taken only where they promise this much more output per
# second than the step without: its costs are estimates of more parts than prompt
# lookup's (the passes, a catch-up spread over steps a request may not live to see). More
# margin does not buy safety: at 1.4 a new request's catch-up never looked worth it and
# the draft stopped paying where it pays most (1 in flight: 1.02x against 1.51-1.67x).
DRAFT_MODEL_MIN_GAIN = 1.1


class _RequestSpec:
    __slots__ = ("acceptance", "draft_computed", "ngram")

    def __init__(self) -> None:
        self.acceptance = Acceptance(REQUEST_DECAY)
        self.ngram = NgramIndex()
        # A draft model's cache holds this request's first draft_computed positions (the
        # drafter's own count, followed from the verifications; 0 after a preemption).
        self.draft_computed = 0


class Speculator:
    """Proposes drafts for the scheduler, learns what they are worth, keeps the totals
    (the scheduler's ``Speculation``, ``speculation.py``)."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        config.check()
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.step_costs = StepCosts()  # the target's steps, by rows
        self.draft_costs = StepCosts()  # the draft model's passes, by rows
        self._pool = Acceptance(POOL_DECAY, INITIAL_ACCEPTANCE * PRIOR_WEIGHT, (1 - INITIAL_ACCEPTANCE) * PRIOR_WEIGHT)
        self._requests: dict[str, _RequestSpec] = {}
        # What steps cost against what the step costs said, with drafts and without
        # (averages), and what this step was expected to cost with its drafts.
        self._ratio_drafted = 1.0
        self._ratio_plain = 1.0
        self._expected: float | None = None

    @property
    def cost_factor(self) -> float:
        """How much dearer a step with drafts turns out than the costs say, beyond what any
        step does (the row-count costs miss verification's sampling, longer contexts, a
        draft's catch-up taking longer than its table): the adaptive rule's correction."""
        factor = self._ratio_drafted / self._ratio_plain
        return min(max(factor, MIN_COST_FACTOR), MAX_COST_FACTOR)

    @property
    def uses_draft_model(self) -> bool:
        return self.config.method == "draft_model"

    # -- start-up ---------------------------------------------------------------------

    def calibrate(
        self, time_steps: Timer, time_draft_passes: Timer, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        """Seed the step costs with timed dummy steps (the adaptive rule needs a cost for
        a step with drafts before it has run one): up to every request with all its drafts."""
        if not self.config.adaptive:
            return
        max_rows = min(max_num_batched_tokens, max_num_seqs * (1 + self.config.num_speculative_tokens))
        self.step_costs.observe_all(time_steps(calibration_sizes(max_rows)))
        if self.uses_draft_model:
            self.draft_costs.observe_all(time_draft_passes(calibration_sizes(max_num_seqs)))
        logger.info(
            "speculative decoding: step seconds by rows %s",
            {n: round(s, 4) for n, s in self.step_costs.table().items()},
        )

    # -- the step ---------------------------------------------------------------------

    def plan(self, running: Sequence[Request], num_budget: int) -> dict[str, list[int]]:
        """Draft tokens for this step's decoding requests (those with one token left to
        compute), by request id; requests without drafts are absent. ``running`` in the
        scheduler's order, which is the order the budget is handed out in."""
        config = self.config
        self._expected = None
        if config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size:
            return {}
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        num_rows = min(sum(r.num_tokens - r.num_computed_tokens for r in running), num_budget)
        if not decoding or num_rows >= num_budget:
            return {}
        limits = {r.request_id: self._max_drafts(r) for r in decoding}
        room = num_budget - num_rows
        if config.adaptive:
            # Every request at its full length first: when even that does not pay, no
            # lookup is made (at high load, the usual case).
            chosen = self._plan([(r, limits[r.request_id]) for r in decoding], num_rows, len(decoding), room)
            limits = chosen if self.uses_draft_model else {i: n for i, n in limits.items() if i in chosen}
        drafts: dict[str, list[int]] = {}
        left = room
        for r in decoding:
            num = min(limits.get(r.request_id, 0), left)
            if num <= 0:
                continue
            if self.uses_draft_model:
                draft = [MODEL_DRAFT] * num
            else:
                draft = self._state(r).ngram.propose(
                    r.all_token_ids, num, config.prompt_lookup_min, config.prompt_lookup_max
                )
            if draft:
                drafts[r.request_id] = draft
                left -= len(draft)
        if config.adaptive and not self.uses_draft_model and drafts:
            # Decide again on what the lookups found (fewer, shorter drafts than offered).
            by_id = {r.request_id: r for r in decoding}
            counts = self._plan([(by_id[i], len(d)) for i, d in drafts.items()], num_rows, len(decoding), room)
            drafts = {i: d[: counts[i]] for i, d in drafts.items() if counts.get(i)}
        return drafts

    def _plan(
        self, offers: list[tuple[Request, int]], num_rows: int, num_outputs: int, max_drafts: int
    ) -> dict[str, int]:
        pool = self._pool.rate(0.0, 0.0)
        rates = {r.request_id: self._state(r).acceptance.rate(pool, PRIOR_WEIGHT) for r, _ in offers}
        catch_ups = {r.request_id: self._catch_up_seconds(r) for r, _ in offers}
        shares = {
            r.request_id: catch_ups[r.request_id] / self._catch_up_steps(r, rates[r.request_id], n) for r, n in offers
        }
        plan = choose_drafts(
            [Offer(r.request_id, rates[r.request_id], n, shares[r.request_id]) for r, n in offers if n > 0],
            num_rows=num_rows,
            num_outputs=num_outputs,
            max_drafts=max_drafts,
            step_seconds=self.step_costs.seconds,
            draft_pass_seconds=self.draft_costs.seconds if self.uses_draft_model else None,
            cost_factor=self.cost_factor,
            min_gain=DRAFT_MODEL_MIN_GAIN if self.uses_draft_model else 1.0,
        )
        # The step pays each catch-up whole, not the share the rule weighed.
        catch_up = sum(catch_ups[i] - shares[i] for i in plan.counts)
        self._expected = plan.seconds + catch_up if plan.counts else None
        return plan.counts

    def _catch_up_seconds(self, request: Request) -> float:
        """What the draft model's catch-up for ``request`` costs: its first pass computes
        every position its cache lacks besides the last token's, ``Tdraft(1 + lag) -
        Tdraft(1)``. Nothing for prompt lookup."""
        if not self.uses_draft_model:
            return 0.0
        lag = request.num_tokens - 1 - self._state(request).draft_computed
        if lag <= 0:
            return 0.0
        return max(self.draft_costs.seconds(1 + lag) - self.draft_costs.seconds(1), 0.0)

    def _catch_up_steps(self, request: Request, acceptance: float, num_drafts: int) -> float:
        """The steps a catch-up is spread over: those the request is expected to draft in
        (its tokens left over the tokens a step yields), at least 1, at most
        ``CATCH_UP_HORIZON``."""
        tokens_left = min(
            request.sampling_params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        per_step = sum(acceptance**j for j in range(num_drafts + 1))
        return min(max(tokens_left / per_step, 1.0), CATCH_UP_HORIZON)

    def _max_drafts(self, request: Request) -> int:
        return min(
            self.config.num_speculative_tokens,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,  # the bonus token comes on top
            self.max_model_len - request.num_tokens - 1,
        )

    def _state(self, request: Request) -> _RequestSpec:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestSpec()
        return state

    # -- after the step ---------------------------------------------------------------

    def record(
        self,
        request_id: str,
        num_drafted: int,
        num_accepted: int,
        num_verified: int | None = None,
        *,
        num_tokens: int | None = None,
    ) -> None:
        """One verification: of ``num_drafted`` drafts, ``num_verified`` (all unless an
        output constraint cut some first) were verified and the first ``num_accepted`` held.
        The totals count verified drafts; the estimates count a cut one as rejected, as
        its row was paid for. ``num_tokens``: the request's tokens in the step (before
        the accepted ones), from which a draft model's cache now ends where the
        drafter's does (``model/spec/drafter.py``: the accepted drafts' entries are its)."""
        state = self._requests.get(request_id)
        if state is not None and num_tokens is not None and self.uses_draft_model and num_drafted > 0:
            state.draft_computed = min(num_tokens + num_drafted - 1, num_tokens + num_accepted)
        num_verified = num_drafted if num_verified is None else num_verified
        if num_verified > 0:
            self.stats.add(num_verified, num_accepted)
        if num_drafted <= 0:
            return
        self._pool.record(num_drafted, num_accepted)
        if state is not None:
            state.acceptance.record(num_drafted, num_accepted)
        stats = self.stats
        if num_verified > 0 and stats.num_drafts % LOG_INTERVAL == 0:
            logger.info(
                "speculative decoding: %d drafts, acceptance %.1f%%, mean accepted length %.2f",
                stats.num_drafts,
                100 * stats.acceptance_rate,
                stats.mean_accepted_length,
            )

    def observe(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Learn the step's cost: a step of decodes (with or without drafts) by its rows,
        and the draft model's passes by theirs."""
        if not self.config.adaptive:
            return
        for num_rows, pass_seconds in runner_output.draft_passes:
            self.draft_costs.observe(num_rows, pass_seconds)
        expected, self._expected = self._expected, None
        scheduled = scheduler_output.scheduled
        # Decode steps only: a prefill row costs what no decode row does (drafts come on top).
        if not all(s.num_new_tokens == 1 for s in scheduled):
            return
        seconds = runner_output.execute_s
        actual = seconds + sum(s for _, s in runner_output.draft_passes)
        drafted = any(s.draft_token_ids for s in scheduled)
        if drafted and expected:
            self._ratio_drafted += RATIO_WEIGHT * (actual / expected - self._ratio_drafted)
        elif not drafted and (plain := self.step_costs.seconds(scheduler_output.num_tokens)) > 0.0:
            self._ratio_plain += RATIO_WEIGHT * (actual / plain - self._ratio_plain)
            self._ratio_drafted += RATIO_FORGET * (self._ratio_plain - self._ratio_drafted)
        if seconds > 0.0:
            self.step_costs.observe(scheduler_output.num_tokens, seconds)

    def drop_draft_cache(self, request_id: str) -> None:
        """The request's blocks went back (preempted, paused): a draft model starts it
        again from its first token, as the drafter does."""
        state = self._requests.get(request_id)
        if state is not None:
            state.draft_computed = 0

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def snapshot(self) -> SpecDecodeStats:
        return self.stats.snapshot()
