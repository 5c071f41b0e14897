"""Structured output in the engine: grammars compiled off the step thread, cached, and the
requests that wait for them held outside the scheduler.

    EngineCore.add_request ─▶ admission ─▶ submit(request)
        cached ─▶ the grammar is attached; the request goes to the scheduler at once
        not cached ─▶ queued for a worker thread; the request waits here, not in the
                      scheduler's queues, so the step loop and every other request go on
    EngineCore.step ─▶ ready() ─▶ (request, grammar): into the scheduler
                               └▶ (request, RequestError): finished in band

What one client can make this cost is bounded (docs/limits.md):

* **The queue.** At most MAX_QUEUED_COMPILES compiles wait for a thread, and at most
  MAX_QUEUED_COMPILES_PER_STREAM of them for one stream; past that a new constraint is
  refused with RESOURCE_EXHAUSTED (retryable). A queued compile that no request waits for
  any more (all aborted or timed out) is dropped before it starts.
* **The wait.** A request whose compile has not started ``timeout_s`` after it arrived
  fails with RESOURCE_EXHAUSTED: the threads were busy with other constraints, so it may
  retry. One whose compile has run ``timeout_s`` fails with INVALID_ARGUMENT: its own
  constraint is too costly. A compile that started goes on and its result is cached.
* **The cache.** Compiled grammars and compile errors are cached by the constraint
  (kind, text, options), least recently used out first, up to CACHE_SIZE entries and
  CACHE_BYTES of heap (each compile's, as ``backend.compile`` measured it). A grammar
  that failed at run time (``CompiledGrammar.failure``) fails its next requests at once.

``on_ready`` is called from a worker thread whenever a compile finishes, so a sleeping
engine loop can wake up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine_svc.model.structured import CompiledGrammar, GrammarError, LLGuidanceBackend
from engine_svc.outputs import StructuredStats
from engine_svc.sched.request import Request
from engine_svc.types import ErrorCode, RequestError
from tandem_common.sampling import StructuredOutput

logger = logging.getLogger(__name__)

NUM_COMPILE_WORKERS = 2  # compiles release the GIL; more threads would only fight the step for cores
CACHE_SIZE = 256  # compiled grammars (and errors) kept at most
CACHE_BYTES = 256 << 20  # heap the cached grammars may hold, as measured at compile time
MAX_QUEUED_COMPILES = 32  # compiles waiting for a thread, whole engine
MAX_QUEUED_COMPILES_PER_STREAM = 8  # of those, asked for by one stream (one frontend)


@dataclass
class _Compile:
    """One compile of one constraint, shared by every request that waits for it."""

    stream_id: int | None  # the stream that asked first: its queue share holds this compile until it starts
    result: CompiledGrammar | str | None = None  # a grammar, or the compiler's message
    started_at: float | None = None  # time.monotonic() when a worker took it
    done_at: float | None = None  # time.monotonic() when it finished
    future: Future[None] | None = None
    waiters: set[str] = field(default_factory=set)  # request ids; the engine thread's


@dataclass
class _Waiting:
    request: Request
    compile: _Compile
    arrived_at: float  # time.monotonic()


class GrammarCompiler:
    def __init__(
        self,
        backend: LLGuidanceBackend | None,
        *,
        timeout_s: float,
        unavailable_reason: str = "",
        on_ready: Callable[[], None] | None = None,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.backend = backend
        self.max_cache_bytes = cache_bytes
        self.unavailable_reason = unavailable_reason  # why backend is None
        self.timeout_s = timeout_s
        self.on_ready = on_ready
        self._lock = threading.Condition()
        self._cache: OrderedDict[StructuredOutput, _Compile] = OrderedDict()  # finished only
        self._cache_bytes = 0
        self._in_flight: dict[StructuredOutput, _Compile] = {}  # queued or running
        self._waiting: dict[str, _Waiting] = {}  # by request id; only the engine thread touches it
        self._pool: ThreadPoolExecutor | None = None
        self._by_kind: Counter[str] = Counter()
        self._num_cache_hits = 0
        self._num_failed = 0
        self._num_timeouts = 0
        self._durations: list[float] = []  # compiles finished since the last stats()

    @classmethod
    def for_model(
        cls, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...], *, enabled: bool, timeout_s: float
    ) -> GrammarCompiler:
        """Build the backend (its tokenizer takes up to seconds at 128k ids, holding the GIL:
        done once, at start-up). An engine that cannot serve constraints still starts; its
        constrained requests get INVALID_ARGUMENT saying why."""
        if timeout_s <= 0:
            raise ValueError(f"--structured-output-timeout-s must be positive, got {timeout_s}")
        if not enabled:
            return cls(None, timeout_s=timeout_s, unavailable_reason="it was started with --no-structured-output")
        start = time.perf_counter()
        try:
            backend = LLGuidanceBackend.from_model_dir(model_dir, vocab_size, eos_token_ids)
        except (OSError, ValueError) as e:
            logger.warning("structured output unavailable: %s", e)
            return cls(None, timeout_s=timeout_s, unavailable_reason=str(e))
        logger.info("structured output: %s tokenizer built in %.2f s", backend.name, time.perf_counter() - start)
        return cls(backend, timeout_s=timeout_s)

    # -- the engine thread ------------------------------------------------------------------

    def submit(self, request: Request) -> CompiledGrammar | RequestError | None:
        """The grammar of a constrained request if it is cached (or its cached error), else
        None: the request now waits here until ready() hands it out."""
        constraint = request.sampling_params.structured
        assert constraint is not None
        self._by_kind[constraint.kind] += 1
        if self.backend is None:
            return _error(constraint, f"this engine serves no structured output: {self.unavailable_reason}")
        with self._lock:
            job = self._cache.get(constraint)
            if job is not None:
                self._cache.move_to_end(constraint)
                self._num_cache_hits += 1
                return self._outcome(constraint, job)
            job = self._in_flight.get(constraint)
            if job is None:
                if (refusal := self._queue_refusal(constraint, request.stream_id)) is not None:
                    return refusal
                job = self._in_flight[constraint] = _Compile(request.stream_id)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(NUM_COMPILE_WORKERS, thread_name_prefix="grammar-compile")
                job.future = self._pool.submit(self._compile, constraint, job)
            job.waiters.add(request.request_id)
        self._waiting[request.request_id] = _Waiting(request, job, time.monotonic())
        return None

    def ready(self) -> list[tuple[Request, CompiledGrammar | RequestError]]:
        """Waiting requests whose compile finished or whose wait is over, with their outcome."""
        now = time.monotonic()
        out: list[tuple[Request, CompiledGrammar | RequestError]] = []
        for request_id, w in list(self._waiting.items()):
            verdict = self._verdict(w, now)
            if verdict is None:
                continue
            del self._waiting[request_id]
            constraint = w.request.sampling_params.structured
            assert constraint is not None
            with self._lock:
                self._release(constraint, w.compile, request_id)
                if verdict == "done":
                    out.append((w.request, self._outcome(constraint, w.compile)))
                else:
                    self._num_timeouts += 1
                    error = _busy if verdict == "busy" else _too_costly
                    out.append((w.request, error(constraint, self.timeout_s)))
        return out

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Take these requests out of the wait; returns those that were waiting."""
        aborted = []
        for request_id in request_ids:
            w = self._waiting.pop(request_id, None)
            if w is None:
                continue
            constraint = w.request.sampling_params.structured
            assert constraint is not None
            with self._lock:
                self._release(constraint, w.compile, request_id)
            aborted.append(w.request)
        return aborted

    def has_ready(self) -> bool:
        """Whether ready() would hand out anything now."""
        now = time.monotonic()
        return any(self._verdict(w, now) is not None for w in self._waiting.values())

    def seconds_to_deadline(self) -> float | None:
        """Time until the first waiting request's wait is over; None when none waits."""
        if not self._waiting:
            return None
        return max(0.0, min(self._deadline(w) for w in self._waiting.values()) - time.monotonic())

    def wait(self, timeout: float | None) -> None:
        """Block until a compile finishes or ``timeout`` passes (for callers without a loop of their own)."""
        with self._lock:
            self._lock.wait_for(self.has_ready, timeout)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_requests(self) -> list[Request]:
        """The requests waiting for their grammar (engine thread)."""
        return [w.request for w in self._waiting.values()]

    def stats(self) -> StructuredStats:
        with self._lock:
            durations, self._durations = self._durations, []
        return StructuredStats(
            requests_by_kind=tuple(sorted(self._by_kind.items())),
            num_cache_hits=self._num_cache_hits,
            num_failed=self._num_failed,
            num_timeouts=self._num_timeouts,
            compile_durations_s=tuple(durations),
        )

    def shutdown(self) -> None:
        """Drop the queued compiles; a running one ends on its own (a worker cannot be interrupted)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _deadline(self, w: _Waiting) -> float:
        """When ``w`` stops waiting: ``timeout_s`` after it arrived for a compile still queued,
        ``timeout_s`` after the later of its arrival and the compile's start otherwise."""
        started_at = w.compile.started_at
        return max(w.arrived_at, started_at if started_at is not None else w.arrived_at) + self.timeout_s

    def _verdict(self, w: _Waiting, now: float) -> str | None:
        """ "done", "busy" (queued past its limit), "costly" (compiled past it), or None (wait on).

        Judged from the compile's own times, not from when the engine thread looks, so a
        busy step loop changes no outcome."""
        job = w.compile
        if job.started_at is None:
            return "busy" if now > w.arrived_at + self.timeout_s else None
        if job.started_at > w.arrived_at + self.timeout_s:
            return "busy"
        deadline = self._deadline(w)
        if job.done_at is not None:
            return "done" if job.done_at <= deadline else "costly"
        return "costly" if now > deadline else None

    def _queue_refusal(self, constraint: StructuredOutput, stream_id: int | None) -> RequestError | None:
        """Under the lock: why a new compile for stream ``stream_id`` may not queue now, or None."""
        queued = [job.stream_id for job in self._in_flight.values() if job.started_at is None]
        if len(queued) >= MAX_QUEUED_COMPILES:
            limit = f"{len(queued)} compiles already wait for this engine's compile threads (the limit)"
        elif queued.count(stream_id) >= MAX_QUEUED_COMPILES_PER_STREAM:
            limit = f"{MAX_QUEUED_COMPILES_PER_STREAM} compiles of this stream already wait for a compile thread"
        else:
            return None
        self._num_timeouts += 1
        field_name = f"sampling_params.{constraint.kind}"
        return RequestError(
            ErrorCode.RESOURCE_EXHAUSTED, f"{field_name}: not compiled: {limit}; retry shortly", field_name
        )

    def _release(self, constraint: StructuredOutput, job: _Compile, request_id: str) -> None:
        """Under the lock: ``request_id`` waits no more; a queued compile nobody waits for is dropped."""
        job.waiters.discard(request_id)
        if not job.waiters and job.started_at is None and job.future is not None and job.future.cancel():
            self._in_flight.pop(constraint, None)
            logger.debug("dropped a queued %s compile: no request waits for it", constraint.kind)

    def _outcome(self, constraint: StructuredOutput, job: _Compile) -> CompiledGrammar | RequestError:
        if isinstance(job.result, str):
            self._num_failed += 1
            return _error(constraint, job.result)
        assert job.result is not None
        if job.result.failure:
            self._num_failed += 1
            return _error(constraint, f"it failed an earlier request: {job.result.failure}")
        return job.result

    # -- worker threads ---------------------------------------------------------------------

    def _compile(self, constraint: StructuredOutput, job: _Compile) -> None:
        assert self.backend is not None
        with self._lock:
            job.started_at = time.monotonic()
        start = time.perf_counter()
        result: CompiledGrammar | str
        try:
            result = self.backend.compile(constraint)
        except GrammarError as e:
            result = str(e) or "the constraint does not compile"
        except Exception as e:  # noqa: BLE001 - a library fault fails the request, not the engine
            logger.exception("compiling a %s constraint failed", constraint.kind)
            result = f"the grammar compiler failed: {e}"
        duration = time.perf_counter() - start
        with self._lock:
            job.result = result
            job.done_at = time.monotonic()
            self._durations.append(duration)
            self._in_flight.pop(constraint, None)
            self._cache_put(constraint, job)
            self._lock.notify_all()
        logger.debug("compiled a %s constraint in %.1f ms", constraint.kind, duration * 1e3)
        if self.on_ready is not None:
            self.on_ready()

    def _cache_put(self, constraint: StructuredOutput, job: _Compile) -> None:
        """Under the lock. Evicted grammars stay alive while requests still decode with them."""
        self._cache[constraint] = job
        self._cache_bytes += _num_bytes(job)
        while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._cache_bytes > self.max_cache_bytes):
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= _num_bytes(evicted)

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes


def _num_bytes(job: _Compile) -> int:
    return job.result.num_bytes if isinstance(job.result, CompiledGrammar) else len(job.result or "")


def _error(constraint: StructuredOutput, message: str) -> RequestError:
    field_name = f"sampling_params.{constraint.kind}"  # the oneof member's name in both APIs
    return RequestError(ErrorCode.INVALID_ARGUMENT, f"{field_name}: {message}", field_name)


def _too_costly(constraint: StructuredOutput, timeout_s: float) -> RequestError:
    return _error(
        constraint,
        f"compiling it took longer than this engine's limit of {timeout_s:g} s "
        "(--structured-output-timeout-s); simplify it, or retry once the engine has compiled it",
    )


def _busy(constraint: StructuredOutput, timeout_s: float) -> RequestError:
    field_name = f"sampling_params.{constraint.kind}"
    return RequestError(
        ErrorCode.RESOURCE_EXHAUSTED,
        f"{field_name}: not compiled: the engine's compile threads were busy with other constraints for "
        f"{timeout_s:g} s (--structured-output-timeout-s); retry shortly",
        field_name,
    )
