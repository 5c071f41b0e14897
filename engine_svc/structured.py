"""Structured output in the engine: grammars compiled off the step thread, cached, and the
requests that wait for them held outside the scheduler.

    EngineCore.add_request ─▶ admission ─▶ submit(request)
        cached ─▶ the grammar is attached; the request goes to the scheduler at once
        not cached ─▶ compiled on a worker thread; the request waits here, not in the
                      scheduler's queues, so the step loop and every other request go on
    EngineCore.step ─▶ ready() ─▶ (request, grammar): into the scheduler
                               └▶ (request, RequestError): finished in band, INVALID_ARGUMENT

Compiled grammars (and compile errors) are cached by the constraint itself (kind, text,
options). A compile that has not finished ``timeout_s`` after its request arrived fails
that request; the compile goes on and its result is cached for the next request.
``on_ready`` is called from a worker thread whenever a compile finishes, so a sleeping
engine loop can wake up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine_svc.model.structured import CompiledGrammar, GrammarError, LLGuidanceBackend
from engine_svc.outputs import StructuredStats
from engine_svc.sched.request import Request
from engine_svc.types import ErrorCode, RequestError
from tandem_common.sampling import StructuredOutput

logger = logging.getLogger(__name__)

NUM_COMPILE_WORKERS = 2  # compiles release the GIL; more threads would only fight the step for cores
CACHE_SIZE = 256  # compiled grammars (and errors) kept, least recently used evicted first


@dataclass
class _Compile:
    """One compile of one constraint, shared by every request that waits for it."""

    result: CompiledGrammar | str | None = None  # a grammar, or the compiler's message
    done_at: float | None = None  # time.monotonic() when it finished


@dataclass
class _Waiting:
    request: Request
    compile: _Compile
    arrived_at: float  # time.monotonic()


class StructuredOutputs:
    def __init__(
        self,
        backend: LLGuidanceBackend | None,
        *,
        timeout_s: float,
        unavailable_reason: str = "",
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.unavailable_reason = unavailable_reason  # why backend is None
        self.timeout_s = timeout_s
        self.on_ready = on_ready
        self._lock = threading.Condition()
        self._cache: OrderedDict[StructuredOutput, _Compile] = OrderedDict()  # finished only
        self._in_flight: dict[StructuredOutput, _Compile] = {}
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
    ) -> StructuredOutputs:
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
            return _invalid(constraint, f"this engine serves no structured output: {self.unavailable_reason}")
        with self._lock:
            job = self._cache.get(constraint)
            if job is not None:
                self._cache.move_to_end(constraint)
                self._num_cache_hits += 1
                return self._outcome(constraint, job, waited_s=0.0)
            job = self._in_flight.get(constraint)
            if job is None:
                job = self._in_flight[constraint] = _Compile()
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(NUM_COMPILE_WORKERS, thread_name_prefix="grammar-compile")
                self._pool.submit(self._compile, constraint, job)
        self._waiting[request.request_id] = _Waiting(request, job, time.monotonic())
        return None

    def ready(self) -> list[tuple[Request, CompiledGrammar | RequestError]]:
        """Waiting requests whose compile finished or timed out, with their outcome."""
        now = time.monotonic()
        out = []
        for request_id, w in list(self._waiting.items()):
            done_at = w.compile.done_at
            if done_at is None and now - w.arrived_at <= self.timeout_s:
                continue
            del self._waiting[request_id]
            constraint = w.request.sampling_params.structured
            assert constraint is not None
            waited_s = (done_at if done_at is not None else now) - w.arrived_at
            out.append((w.request, self._outcome(constraint, w.compile, waited_s)))
        return out

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Take these requests out of the wait; returns those that were waiting."""
        return [w.request for rid in request_ids if (w := self._waiting.pop(rid, None)) is not None]

    def has_ready(self) -> bool:
        """Whether ready() would hand out anything now."""
        now = time.monotonic()
        return any(w.compile.done_at is not None or now - w.arrived_at > self.timeout_s for w in self._waiting.values())

    def seconds_to_deadline(self) -> float | None:
        """Time until the first waiting request times out; None when none waits."""
        if not self._waiting:
            return None
        first = min(w.arrived_at for w in self._waiting.values())
        return max(0.0, first + self.timeout_s - time.monotonic())

    def wait(self, timeout: float | None) -> None:
        """Block until a compile finishes or ``timeout`` passes (for callers without a loop of their own)."""
        with self._lock:
            self._lock.wait_for(self.has_ready, timeout)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _outcome(self, constraint: StructuredOutput, job: _Compile, waited_s: float) -> CompiledGrammar | RequestError:
        if waited_s > self.timeout_s or job.result is None:
            self._num_timeouts += 1
            return _invalid(
                constraint,
                f"compiling it took longer than this engine's limit of {self.timeout_s:g} s "
                "(--structured-output-timeout-s); simplify it, or retry once the engine has compiled it",
            )
        if isinstance(job.result, str):
            self._num_failed += 1
            return _invalid(constraint, job.result)
        return job.result

    # -- worker threads ---------------------------------------------------------------------

    def _compile(self, constraint: StructuredOutput, job: _Compile) -> None:
        assert self.backend is not None
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
            self._cache[constraint] = job
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            self._lock.notify_all()
        logger.debug("compiled a %s constraint in %.1f ms", constraint.kind, duration * 1e3)
        if self.on_ready is not None:
            self.on_ready()


def _invalid(constraint: StructuredOutput, message: str) -> RequestError:
    field = f"sampling_params.{constraint.kind}"  # the oneof member's name in both APIs
    return RequestError(ErrorCode.INVALID_ARGUMENT, f"{field}: {message}", field)
