"""EngineCore: the step loop, as an in-process API.

    add_request() / abort() between steps, then step():
        structured.ready() -> scheduler.schedule() -> model_runner.execute()
        -> scheduler.update_from_output()
    make_stats() after each turn: the snapshot other threads read

The gRPC service drives it from its own thread (``service/engine_loop.py``); benchmarks
and tests drive it directly (``generate()`` runs a list of requests to completion).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine_svc.config import EngineConfig
from engine_svc.grammar_compiler import GrammarCompiler
from engine_svc.lora_registry import AdapterRegistry, LoraRegistry, NoLoraRegistry
from engine_svc.model.load.gguf_checkpoint import resolve_model_dir
from engine_svc.model.load.served import keep_step_buffers, return_freed_heap
from engine_svc.model.lora import LoraAdapter, LoraSlots
from engine_svc.model.runner import ModelRunner
from engine_svc.outputs import EngineOutput, EngineStats, LoraAdapterInfo, ModelInfo, StepStats
from engine_svc.sched.admission import AdmissionLimits, check_admission
from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.kv_events import KvEventLog
from engine_svc.sched.lora import LoraStepLimit, NoLoraLimit
from engine_svc.sched.request import Request, request_output
from engine_svc.sched.scheduler import Scheduler, SchedulerObserver
from engine_svc.sched.spec import NoSpeculation, Speculation, Speculator
from engine_svc.types import FinishReason, Logprob, RequestError, SamplingParams
from tandem_common.block_hash import BlockHash
from tandem_common.kv_events import KvEvent

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    """A finished request, as ``generate()`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: RequestError | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        model_path = config.model
        if model_path is None:
            from engine_svc.demo_checkpoint import ensure_demo_checkpoint

            model_path = str(ensure_demo_checkpoint())
        # A GGUF file is served through a prepared directory (model/load/gguf_checkpoint.py).
        self.model_dir, model_name = resolve_model_dir(model_path)
        self.model_name = config.served_model_name or model_name
        self.device = config.device
        self.block_size = config.block_size
        self.runner = ModelRunner(
            str(self.model_dir),
            device=config.device,
            dtype=config.dtype,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_bytes=config.kv_cache_bytes,  # both None: sized from the model
            kv_cache_dtype=config.kv_cache_dtype,
            kv_cache_populate=config.kv_cache_populate,
            kv_cache_populate_seconds=config.kv_cache_populate_seconds,
            max_model_len=config.max_model_len,
            seed=config.seed,
            kernels=config.kernels,
            max_num_seqs=config.max_num_seqs,
            quantization=config.quantization,
            activation_quantization=config.activation_quantization,
            lora_slots=config.lora.num_slots if config.enable_lora else 0,
            max_lora_rank=config.lora.max_lora_rank,
            **_draft_model(config),
        )
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = tuple(self.runner.eos_token_ids)
        self.kv_cache = KVCacheManager(
            self.runner.num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            speculator=_speculation(config, self.max_model_len),
            lora_limit=LoraStepLimit(config.lora.max_loras) if config.enable_lora else NoLoraLimit(),
        )
        self.limits = AdmissionLimits(
            self.vocab_size, self.max_model_len, config.max_waiting, self.runner.num_kv_blocks * config.block_size
        )
        # Constrained requests wait here, outside the scheduler, while their grammar compiles.
        self.structured = GrammarCompiler.for_model(
            self.model_dir,
            self.vocab_size,
            self.eos_token_ids,
            enabled=config.structured_output,
            timeout_s=config.structured_output_timeout_s,
        )
        self.lora = self._lora_registry(config)
        self.draining = False  # refuse new requests (UNAVAILABLE); running ones go on
        self._last_step: StepStats | None = None
        self.num_steps = 0
        self.startup_s = time.perf_counter() - start
        logger.info(
            "engine ready: model %s on %s (%s), KV cache %d blocks x %d tokens = %d tokens "
            "(%.1f MiB), max_model_len %d, loaded in %.2f s",
            self.model_name,
            config.device,
            str(self.runner.dtype).removeprefix("torch."),
            self.runner.num_kv_blocks,
            config.block_size,
            self.runner.num_kv_blocks * config.block_size,
            self.runner.num_kv_blocks * self.runner.bytes_per_block / 2**20,
            self.max_model_len,
            self.startup_s,
        )

    # -- requests ---------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kw) -> Request:
        return Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids, **kw)

    def add_request(self, request: Request) -> EngineOutput | None:
        """Admit ``request`` (``sched/admission.py``) and queue it; if it may not enter,
        finish it at once and return its error output. A constrained request whose
        grammar is not compiled yet waits in ``structured`` until step() finds it ready."""
        error = check_admission(
            request,
            self.limits,
            num_waiting=self.scheduler.num_waiting + self.structured.num_waiting,
            draining=self.draining,
        )
        if error is None:
            error = self.lora.acquire(request)  # its adapter's slot and digest, if it names one
        if error is not None:
            return self.refuse(request, error)
        if request.sampling_params.structured is not None:
            grammar = self.structured.submit(request)
            if grammar is None:
                return None
            if isinstance(grammar, RequestError):
                output = self.refuse(request, grammar)
                self.lora.release([output])  # it held its adapter from acquire on
                return output
            request.grammar = grammar
        self.scheduler.add_request(request)
        return None

    def _admit_compiled(self) -> list[EngineOutput]:
        """Queue the requests whose grammar is ready; refuse those whose compile failed."""
        refused = []
        for request, grammar in self.structured.ready():
            if isinstance(grammar, RequestError):
                refused.append(self.refuse(request, grammar))
            else:
                request.grammar = grammar
                self.scheduler.add_request(request)
        return refused

    @staticmethod
    def refuse(request: Request, error: RequestError) -> EngineOutput:
        """Finish a request that never entered the scheduler with ``error``."""
        request.finish(FinishReason.ERROR, error=error)
        return request_output(request)

    def abort(self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT) -> list[EngineOutput]:
        request_ids = list(request_ids)
        outputs = self.scheduler.abort_requests(request_ids, reason)
        for request in self.structured.abort(request_ids):
            request.finish(reason)
            outputs.append(request_output(request))
        return self._released(outputs)

    def pause(self, request_ids: Iterable[str]) -> None:
        self.scheduler.pause_requests(request_ids)

    def resume(self, request_ids: Iterable[str]) -> None:
        self.scheduler.resume_requests(request_ids)

    def fail(self, request_ids: Iterable[str], error: RequestError) -> list[EngineOutput]:
        request_ids = list(request_ids)
        outputs = self.scheduler.fail_requests(request_ids, error)
        outputs += [self.refuse(request, error) for request in self.structured.abort(request_ids)]
        return self._released(outputs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.structured.num_waiting > 0

    def has_work(self) -> bool:
        """Whether step() would do anything now: requests to run (paused ones cannot), or
        grammars ready. A loop with none may sleep until ``seconds_to_next_event()`` or a
        wake-up (``structured.on_ready``)."""
        return self.scheduler.has_work() or self.structured.has_ready()

    def seconds_to_next_event(self) -> float | None:
        return self.structured.seconds_to_deadline()

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        t0 = time.perf_counter()
        outputs = self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        # Also when nothing is scheduled: the runner drops the state of requests that ended.
        try:
            runner_output = self.runner.execute(scheduler_output)
        except BaseException:
            self.kv_cache.revert_step()  # blocks registered for this step hold no K/V
            raise
        outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        if not scheduler_output.is_empty:
            self.num_steps += 1
            self._last_step = StepStats(time.perf_counter() - t0, scheduler_output.num_tokens)
        return self._released(outputs)

    def _released(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """``outputs``, once the requests they finish have let go of their adapters."""
        self.lora.release(outputs)
        return outputs

    def make_stats(self) -> EngineStats:
        """A snapshot of the engine now; the figures of the step run since the last call, if any."""
        sched, kv = self.scheduler, self.kv_cache
        step, self._last_step = self._last_step, None
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + self.structured.num_waiting,
            num_paused=sched.num_paused,
            num_waiting_tokens=sched.num_waiting_tokens,
            num_used_blocks=kv.num_used_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            num_preemptions=sched.num_preemptions,
            num_unfinished=len(sched.requests) + self.structured.num_waiting,
            draining=self.draining,
            step=step,
            structured=self.structured.stats(),
            spec_decode=sched.speculator.snapshot(),
            lora_version=self.lora.version,
            lora_adapters=self.lora.infos,
            lora_events=self.lora.take_events(),
        )

    def warmup(self) -> None:
        """A first step, then, with speculative decoding, the step costs its adaptive rule
        weighs (timed dummy steps: a few seconds)."""
        self.runner.warmup()
        sched = self.scheduler
        sched.speculator.calibrate(
            self.runner.time_steps,
            self.runner.time_draft_passes,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
        )
        return_freed_heap()  # what loading and the first steps freed
        if self.runner.device.type == "cpu":
            keep_step_buffers()  # from now on, what a step frees the next one reuses

    def model_info(self) -> ModelInfo:
        runner = self.runner
        return ModelInfo(
            model_name=self.model_name,
            architecture=runner.model_args.architecture,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            bos_token_id=runner.bos_token_id,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=self.device,
            block_size=self.block_size,
            num_kv_blocks=runner.num_kv_blocks,
            max_loras=self.lora.max_loras,
        )

    # -- LoRA adapters (lora_registry.py) ----------------------------------------------------

    def _lora_registry(self, config: EngineConfig) -> AdapterRegistry:
        """The adapters' registry with --lora-modules loaded; without --enable-lora, none."""
        if not isinstance(self.runner.lora, LoraSlots):
            return NoLoraRegistry()
        registry = LoraRegistry(self.runner.lora, self.runner.model_args, config.lora)
        for name, path in config.lora.modules:
            registry.add(registry.read(name, path))
        return registry

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter directory; any thread (LoraRefusedError says why not)."""
        return self.lora.read(name, path)

    def load_lora(self, adapter: LoraAdapter) -> LoraAdapterInfo:
        """Serve ``adapter`` (engine thread); LoraRefusedError says why not."""
        self.lora.add(adapter)
        return next(info for info in self.lora.infos if info.name == adapter.name)

    def unload_lora(self, name: str) -> str:
        """Stop serving adapter ``name`` (engine thread) and return it; LoraRefusedError says why not."""
        self.lora.remove(name)
        return name

    # -- what a loop driving the core from its own thread hooks into ----------------------

    def set_observer(self, observer: SchedulerObserver | None) -> None:
        """Lifecycle callbacks from the scheduler (scheduled, preempted), on the step thread."""
        self.scheduler.observer = observer

    def set_on_grammar_ready(self, callback: Callable[[], None] | None) -> None:
        """Called from a compile thread when a grammar is ready: a sleeping loop should wake."""
        self.structured.on_ready = callback

    @property
    def kv_events_enabled(self) -> bool:
        return self.kv_cache.events is not None

    def enable_kv_events(self) -> None:
        """Record every prefix-cache hash stored and evicted from now on (idempotent)."""
        if self.kv_cache.events is None:
            self.kv_cache.events = KvEventLog()

    def disable_kv_events(self) -> None:
        """Record nothing (nobody listens), and drop what was recorded."""
        self.kv_cache.events = None

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix-cache events since the last take, oldest first; none while disabled."""
        return [] if self.kv_cache.events is None else self.kv_cache.events.take()

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now: the snapshot the events continue."""
        return self.kv_cache.cached_hashes()

    # -- offline API ----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        lora_names: list[str | None] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` to completion (each under its LoRA adapter, if named) and return
        them in input order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        names = lora_names or [None] * len(prompts)
        ids = [f"offline-{next(_counter)}" for _ in prompts]
        results = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts)}
        for rid, prompt, sp, name in zip(ids, prompts, params, names):
            error_output = self.add_request(self.make_request(rid, prompt, sp, lora_name=name))
            if error_output is not None:
                _merge(results[rid], error_output)
        while self.has_unfinished_requests():
            if not self.has_work():  # only grammars compiling: sleep until one is ready
                self.structured.wait(self.seconds_to_next_event())
            for out in self.step():
                _merge(results[out.request_id], out)
        return [results[rid] for rid in ids]


_counter = itertools.count()


def _speculation(config: EngineConfig, max_model_len: int) -> Speculation:
    """Speculative decoding as ``--speculative-config`` asks, or none."""
    if config.speculative_config is None:
        return NoSpeculation()
    return Speculator(config.speculative_config, max_model_len=max_model_len)


def _draft_model(config: EngineConfig) -> dict:
    """The runner's draft-model arguments (speculative decoding's ``draft_model`` method)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return {}
    return {"draft_model": spec.model, "draft_quantization": spec.quantization}


def _merge(completion: Completion, out: EngineOutput) -> None:
    completion.output_token_ids.extend(out.new_token_ids)
    completion.logprobs.extend(out.logprobs)
    completion.prompt_logprobs.extend(out.prompt_logprobs)
    completion.num_cached_tokens = max(completion.num_cached_tokens, out.num_cached_tokens)
    if out.finished:
        completion.finish_reason = out.finish_reason
        completion.stop_token_id = out.stop_token_id
        completion.error = out.error
