"""EngineCore: the step loop, as an in-process API.

    add_request() / abort() between steps, then step():
        scheduler.schedule() -> model_runner.execute() -> scheduler.update_from_output()

The gRPC servicer drives it from its own thread; benchmarks and tests drive it directly
(``generate()`` runs a list of requests to completion).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine_svc.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.model.runner import ModelRunner
from engine_svc.outputs import EngineOutput, ModelRunnerOutput
from engine_svc.sched.request import FinishReason, Logprob, Request, RequestError, SamplingParams
from engine_svc.sched.scheduler import Scheduler
from engine_svc.sched.admission import validate_request

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
        model_dir = config.model
        if model_dir is None:
            from engine_svc.demo_model import ensure_demo_model

            model_dir = str(ensure_demo_model())
        self.model_dir = Path(model_dir)
        self.model_name = config.served_model_name or self.model_dir.name
        kv_bytes = config.kv_cache_bytes
        if config.num_kv_blocks is None and kv_bytes is None:
            kv_bytes = DEFAULT_KV_CACHE_BYTES
        self.runner = ModelRunner(
            str(self.model_dir),
            device=config.device,
            dtype=config.dtype,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_bytes=kv_bytes,
            max_model_len=config.max_model_len,
            seed=config.seed,
            kernels=config.kernels,
            batch_size_hint=config.max_num_seqs,
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
        )
        self.num_steps = 0
        self.last_step_s = 0.0
        self.last_batch_tokens = 0
        self.startup_s = time.perf_counter() - start
        logger.info(
            "engine ready: model %s on %s (%s), KV cache %d blocks x %d tokens = %d tokens "
            "(%.1f MiB), max_model_len %d, loaded in %.2f s",
            self.model_name, config.device, config.dtype, self.runner.num_kv_blocks, config.block_size,
            self.runner.num_kv_blocks * config.block_size,
            self.runner.num_kv_blocks * self.runner.bytes_per_block / 2**20, self.max_model_len, self.startup_s,
        )

    # -- requests ---------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kw) -> Request:
        return Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids, **kw)

    def add_request(self, request: Request) -> EngineOutput | None:
        """Queue ``request``; if it is invalid, finish it at once and return its error output."""
        error = validate_request(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if error is not None:
            return self.refuse(request, error)
        self.scheduler.add_request(request)
        return None

    @staticmethod
    def refuse(request: Request, error: RequestError) -> EngineOutput:
        request.finish(FinishReason.ERROR, error=error)
        return EngineOutput(
            request.request_id, finish_reason=FinishReason.ERROR, error=error,
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def abort(self, request_ids) -> list[EngineOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            # Nothing to compute; the runner still drops state of requests that ended.
            self.runner.sampler.forget(scheduler_output.finished_request_ids)
            return self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput())
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps += 1
        self.last_step_s = time.perf_counter() - t0
        self.last_batch_tokens = scheduler_output.num_tokens
        return outputs

    def warmup(self) -> None:
        self.runner.warmup()

    # -- offline API ----------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run ``prompts`` to completion and return them in input order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [f"offline-{next(_counter)}" for _ in prompts]
        results = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts)}
        for rid, prompt, sp in zip(ids, prompts, params):
            error_output = self.add_request(self.make_request(rid, prompt, sp))
            if error_output is not None:
                _merge(results[rid], error_output)
        while self.has_unfinished_requests():
            for out in self.step():
                _merge(results[out.request_id], out)
        return [results[rid] for rid in ids]


_counter = itertools.count()


def _merge(completion: Completion, out: EngineOutput) -> None:
    completion.output_token_ids.extend(out.new_token_ids)
    completion.logprobs.extend(out.logprobs)
    completion.prompt_logprobs.extend(out.prompt_logprobs)
    completion.num_cached_tokens = max(completion.num_cached_tokens, out.num_cached_tokens)
    if out.finished:
        completion.finish_reason = out.finish_reason
        completion.stop_token_id = out.stop_token_id
        completion.error = out.error
