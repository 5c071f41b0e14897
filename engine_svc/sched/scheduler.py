"""Scheduler: decides which requests advance by how many tokens in each step.

There are no prefill and decode phases. Every request has ``num_computed_tokens``
catching up with ``num_tokens``; a step hands out one budget of ``max_num_batched_tokens``
tokens, first to running requests (a decode takes 1, a prompt still being prefilled takes
its next chunk), then to waiting requests (their first chunk, after prefix-cache hits).

    schedule() -> SchedulerOutput -> model runner -> update_from_output() -> EngineOutputs

When KV blocks run out, a running request is preempted by recompute: its blocks go back,
``num_computed_tokens`` drops to 0 and it waits at the front of the queue. Its blocks
usually stay in the prefix cache, so the recompute is mostly hits.

A paused request (``pause_requests``: its client cannot keep up with its output) is
taken out of both queues the same way, blocks given back, and parked in ``paused``
until ``resume_requests`` puts it back in the waiting queue; ``schedule()`` never sees it.

With speculative decoding (``sched/spec/``; ``NoSpeculation`` plans none), a decoding
request may also get draft tokens: their KV slots are reserved with its real token (and
are the first thing given up when blocks run out), they take rows of the budget, and
``update_from_output`` moves ``num_computed_tokens`` past the accepted ones only.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from engine_svc.outputs import EngineOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine_svc.sched.admission import check_kv_capacity
from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.lora import LoraStepLimit, NoLoraLimit
from engine_svc.sched.request import Request, RequestStatus, check_stop, request_output
from engine_svc.sched.spec import NoSpeculation, Speculation
from engine_svc.types import ErrorCode, FinishReason, Logprob, RequestError
from tandem_common.logs import printable

logger = logging.getLogger(__name__)


class FCFSRequestQueue:
    """Waiting requests in arrival order; preempted ones go back to the front.

    A scheduling policy is its waiting queue plus ``victim_key``: the order requests are
    admitted in, and the order they are preempted in (largest key first).
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @staticmethod
    def victim_key(request: Request) -> tuple:
        """The running request with the largest key is preempted first: the latest."""
        return (request.arrival_time,)


class PriorityRequestQueue:
    """Waiting requests by (priority, arrival): a lower priority value is served first.

    A preempted request needs no special place: its own (priority, arrival) puts it ahead
    of every later arrival of its priority, which is the front it deserves.
    """

    def __init__(self) -> None:
        self._queue: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # ties on (priority, arrival) keep insertion order

    def add(self, request: Request) -> None:
        # The sequence number is unique, so comparisons never reach the Request itself.
        bisect.insort(self._queue, (request.priority, request.arrival_time, next(self._seq), request))

    add_front = add

    def peek(self) -> Request:
        return self._queue[0][3]

    def pop(self) -> Request:
        return self._queue.pop(0)[3]

    def remove(self, request: Request) -> None:
        self._queue = [e for e in self._queue if e[3] is not request]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in self._queue)

    @staticmethod
    def victim_key(request: Request) -> tuple:
        """Preempt the lowest priority (largest value) first, the latest among equals."""
        return (request.priority, request.arrival_time)


POLICIES: dict[str, type[FCFSRequestQueue] | type[PriorityRequestQueue]] = {
    "fcfs": FCFSRequestQueue,
    "priority": PriorityRequestQueue,
}


class SchedulerObserver(Protocol):
    """Told of the lifecycle changes only the scheduler sees (tracing, metrics).

    Called inside ``schedule()``, so implementations must be quick; the default is no
    observer at all.
    """

    def request_scheduled(self, request: Request) -> None:
        """``request`` was admitted for the first time (not after a preemption)."""

    def request_preempted(self, request: Request) -> None:
        """``request`` lost its KV blocks and went back to the waiting queue."""


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        speculator: Speculation | None = None,
        lora_limit: LoraStepLimit | NoLoraLimit | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {sorted(POLICIES)}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: FCFSRequestQueue | PriorityRequestQueue = POLICIES[policy]()
        self.running: list[Request] = []  # in admission order; all hold KV blocks
        self.paused: dict[str, Request] = {}  # held back by pause_requests; no KV blocks
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self.observer: SchedulerObserver | None = None
        self.speculator: Speculation = speculator or NoSpeculation()  # drafts for decoding requests
        self.lora_limit = lora_limit or NoLoraLimit()  # how many adapters one step may mix
        # Ids that ended or were preempted since the last schedule(): the runner drops their state.
        self._finished_ids: set[str] = set()

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue an admitted request (``engine_svc.sched.admission``). Duplicate ids and
        requests the KV pool can never hold are caller bugs, not client errors: admission
        refuses the latter, and the scheduler relies on it (a queued request that waits for
        blocks must be able to get them once others give theirs back)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        kv = self.kv_cache_manager
        error = check_kv_capacity(
            request, kv_capacity_tokens=kv.num_blocks * kv.block_size, max_model_len=self.max_model_len
        )
        if error is not None:
            raise ValueError(f"request {request.request_id!r} skipped admission: {error.message}")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def abort_requests(
        self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT
    ) -> list[EngineOutput]:
        """End unfinished requests at once; unknown and finished ids are ignored.

        ``reason`` is what they finish with: ABORT when their client gave up, STOP when
        it ended them because their text is complete (a stop string matched).
        """
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._remove(request)
            self._finish(request, reason)
            outputs.append(request_output(request))
        return outputs

    def fail_requests(self, request_ids: Iterable[str], error: RequestError) -> list[EngineOutput]:
        """Finish these requests with an in-band error (an engine fault, a shutdown cut)."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._remove(request)
                outputs.append(self._finish_with_error(request, error))
        return outputs

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Hold these requests back until ``resume_requests``: a running one gives its KV
        blocks back as if preempted (so paused requests never starve others of blocks).
        Unknown, finished and already paused ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status == RequestStatus.PAUSED:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._take_back_blocks(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.PAUSED
            self.paused[request_id] = request

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        """Put paused requests back at the front of the waiting queue (their place as
        preempted requests); ids that are not paused are ignored."""
        for request_id in request_ids:
            request = self.paused.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.PREEMPTED
                self.waiting.add_front(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step could do anything: unfinished requests that are not paused."""
        return len(self.requests) > len(self.paused)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute (all of them: waiting requests
        hold no KV blocks). O(waiting), read once per loop turn for the load report."""
        return sum(r.num_tokens for r in self.waiting)

    # -- the step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        self.kv_cache_manager.begin_step()
        running_rows, budget, preempted = self._schedule_running(budget)
        # No preemption from here on: the blocks this step's chunks fill can be hit by the
        # requests admitted below (kv_cache.py, "Within a step").
        for row in running_rows:
            self._cache_ahead(self.requests[row.request.request_id], row.num_new_tokens)
        # After a preemption the pool is tight: admitting more would only thrash.
        new_rows = [] if preempted else self._schedule_waiting(budget)
        finished_ids, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled=running_rows + new_rows, finished_request_ids=finished_ids)

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledRequest], int, bool]:
        """Give running requests their next tokens in admission order, preempting by
        recompute when blocks run out. Returns (rows, budget left, whether it preempted)."""
        scheduled: dict[str, ScheduledRequest] = {}
        preempted = False
        drafts = self.speculator.plan(self.running, budget)  # by id, for requests that decode
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            # Admission made sure the request fits the pool alone, so preempting the others
            # always makes room, unless the request is itself the victim first. Its drafts'
            # slots are not part of that promise: they go first.
            draft_token_ids = drafts.get(request.request_id, [])[: budget - num_new]
            while (block_ids := self.kv_cache_manager.allocate_slots(request, num_new + len(draft_token_ids))) is None:
                if draft_token_ids:  # the draft slots go before any request is preempted
                    draft_token_ids = []
                    continue
                victim = max(reversed(self.running), key=self.waiting.victim_key)
                self._preempt(victim)
                preempted = True
                if victim.request_id in scheduled:  # give back the share it already got
                    budget += scheduled.pop(victim.request_id).num_scheduled_tokens
                if victim is request:
                    break
            if block_ids is not None:
                scheduled[request.request_id] = ScheduledRequest(request, num_new, block_ids, draft_token_ids)
                budget -= num_new + len(draft_token_ids)
        return list(scheduled.values()), budget, preempted

    def _schedule_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Admit waiting requests in queue order: prefix-cache hits, then a first chunk of
        what is left of the budget. Stops at the first one that does not fit; passes over
        (and leaves in place) one whose LoRA adapter would be one too many (``sched/lora.py``)."""
        rows = []
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if not self.lora_limit.admits(request, self.running):
                passed_over.append(self.waiting.pop())
                continue
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                break  # the head waits for blocks; later requests must not overtake it
            self.waiting.pop()
            first = request.num_cached_tokens < 0  # recomputes after preemption don't count
            if first:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if first and self.observer is not None:
                self.observer.request_scheduled(request)
            self.running.append(request)
            rows.append(ScheduledRequest(request, num_new, block_ids))
            self._cache_ahead(request, num_new)
            budget -= num_new
        for request in reversed(passed_over):  # back in their places, ahead of the rest
            self.waiting.add_front(request)
        return rows

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for s in scheduler_output.scheduled:
            request = self.requests.get(s.request.request_id)
            if request is None:  # aborted after schedule(): drop what the runner made
                continue
            output = self._advance(request, s, runner_output)
            if output is not None:
                outputs.append(output)
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        self.speculator.observe(scheduler_output, runner_output)
        return outputs

    def _advance(self, request: Request, s: ScheduledRequest, runner_output: ModelRunnerOutput) -> EngineOutput | None:
        """Move ``request`` past its share of the step: its computed tokens, its prompt
        logprobs, the tokens it sampled; its output, if it has anything to say."""
        request_id = request.request_id
        needs_sample = s.needs_sample  # read before num_computed_tokens moves
        request.num_computed_tokens += s.num_new_tokens
        prompt_logprobs = runner_output.prompt_logprobs.get(request_id, [])
        request.num_prompt_logprobs_done += len(prompt_logprobs)
        if (error := runner_output.errors.get(request_id)) is not None:
            return self._finish_with_error(request, error)
        new_token_ids: list[int] = []
        logprobs: list[Logprob] = []
        if needs_sample:
            token_ids = runner_output.sampled_token_ids.get(request_id)
            if not token_ids:
                # Without a token the request could never be scheduled again.
                logger.error("model runner returned no token for %s", request_id)
                error = RequestError(ErrorCode.INTERNAL, "the model runner produced no token")
                return self._finish_with_error(request, error)
            num_tokens = request.num_tokens
            new_token_ids, logprobs = self._take_tokens(request, token_ids, runner_output.logprobs.get(request_id, []))
            num_verified = runner_output.num_verified_drafts.get(request_id)
            self.speculator.record(
                request_id, len(s.draft_token_ids), len(token_ids) - 1, num_verified, num_tokens=num_tokens
            )
        self.kv_cache_manager.cache_full_blocks(request)
        if request.is_finished:
            self._release(request)
        if new_token_ids or prompt_logprobs or request.is_finished:
            return request_output(request, new_token_ids, logprobs, prompt_logprobs)
        return None

    def _take_tokens(
        self, request: Request, token_ids: list[int], logprobs: list[Logprob]
    ) -> tuple[list[int], list[Logprob]]:
        """Append the step's tokens to ``request`` up to the first that stops it; returns
        those taken, with their logprobs. Every token taken but the last is an accepted
        draft, whose K/V the step wrote."""
        num_taken = 0
        for token_id in token_ids:
            request.append_output_token(token_id)
            num_taken += 1
            if check_stop(request, self.max_model_len):
                break
        request.num_computed_tokens += num_taken - 1
        return token_ids[:num_taken], logprobs[:num_taken]

    # -- helpers ----------------------------------------------------------------------------

    def _cache_ahead(self, request: Request, num_new: int) -> None:
        """Register the blocks the step's ``num_new`` tokens of ``request`` fill (not its
        drafts', which may be rejected)."""
        self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens + num_new)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._take_back_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)
        if self.observer is not None:
            self.observer.request_preempted(request)
        logger.debug("preempted %s (recompute later); %d preemptions so far", request, self.num_preemptions)

    def _take_back_blocks(self, request: Request) -> None:
        """Free a running request's blocks; it will be recomputed from its first token."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        self._finished_ids.add(request.request_id)  # the runner drops its per-request state
        self.speculator.drop_draft_cache(request.request_id)

    def _finish_with_error(self, request: Request, error: RequestError) -> EngineOutput:
        """Finish ``request`` with an in-band error; the caller takes it out of the queues."""
        logger.warning(
            "request %s (client id %s) failed: %s",
            request.request_id,
            printable(request.client_request_id),
            error.message,
        )
        request.finish(FinishReason.ERROR, error=error)
        self._finish(request, FinishReason.ERROR)
        return request_output(request)

    def _remove(self, request: Request) -> None:
        """Take an unfinished request out of ``running`` or ``waiting``."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.PAUSED:
            del self.paused[request.request_id]
        else:
            self.waiting.remove(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Finish ``request`` (unless it is already) and release what it holds. The caller
        removes it from ``running``/``waiting``."""
        if not request.is_finished:
            request.finish(reason)
        self._release(request)

    def _release(self, request: Request) -> None:
        """Free a finished request's blocks and forget it."""
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)
        self.speculator.forget(request.request_id)
