"""ModelRunner: owns the weights and the KV cache, and runs one scheduler step.

    SchedulerOutput ─▶ flatten tokens (decodes first, sorted by context) ─▶ input ids,
    positions, AttentionMetadata ─▶ model ─▶ hidden [num_tokens, hidden]
    ─▶ pick rows that need logits ─▶ lm_head ─▶ float32 ─▶ sampler ─▶ ModelRunnerOutput
    (draft tokens, when the scheduler sent some, are rows after their request's real ones
    and are verified in the same sampler call: ``engine_svc/model/spec/``; a draft model
    wraps this step, filling its draft slots first: ``model/spec/drafting.py``)

Only the rows that need logits go through the LM head: the last row of each request whose
chunk reaches its end (``needs_sample``) and the prompt rows whose prompt logprobs are
still owed. The runner never mutates requests; the scheduler advances their counters.
The runner never imports the scheduler.

Construction, in order (``__init__`` only calls the steps): load the weights while the
native kernels compile, and put the layers on the backend that ``backends/backend.py`` chooses
(native / oneDNN / torch, weights packed once); size and allocate the KV cache
(``attention/kv_memory.py``, a draft model's beside the target's) and the attention workspace.
The sampler is made before the draft model, which draws with it. ``max_model_len`` is
resolved first, from the config: it sizes what the load builds (the native RoPE table), and
with the default pool one full-length request must fit the memory available, so a model's
context length alone never asks for more before anything is allocated.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.arch.llama import Transformer
from engine_svc.model.attention import AttentionMetadata, AttentionSetup, KVCache, flat_positions, workspace_tokens
from engine_svc.model.attention.kv_memory import (
    allocate_kv_cache,
    bytes_per_block,
    check_one_request_fits,
    populate_kv_cache,
    size_kv_cache,
)
from engine_svc.model.backends.backend import KernelBuild, ModelBackend
from engine_svc.model.backends.threads import ThreadGovernor
from engine_svc.model.load.gguf_checkpoint import gguf_source
from engine_svc.model.load.hf_quantized import quantization_scheme
from engine_svc.model.load.loader import read_config, read_special_token_ids, resolve_dtype
from engine_svc.model.load.served import load_served_model
from engine_svc.model.lora import LoraSlots, NoLoraSlots
from engine_svc.model.sample.logits_rows import logits_rows
from engine_svc.model.sample.sampler import Proposal, Sampler
from engine_svc.model.spec import Drafter, DraftModel, NoDraftModel, VerifyRows, attention_rows
from engine_svc.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine_svc.types import SamplingParams

logger = logging.getLogger(__name__)

# Prompt rows per LM-head call when prompt logprobs are asked for; bounds the logits
# tensor to PROMPT_LOGITS_CHUNK x vocab float32.
PROMPT_LOGITS_CHUNK = 512
# Timing dummy steps for speculative decoding's cost model (``time_steps``): the context
# each dummy row attends to, and the most seconds spent on it.
CALIBRATION_CONTEXT = 256
CALIBRATION_BUDGET_S = 8.0


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        *,
        device: str,
        dtype: str,
        block_size: int,
        num_kv_blocks: int | None,
        kv_cache_bytes: int | None,
        max_model_len: int | None,
        kv_cache_dtype: str = "auto",
        kv_cache_populate: bool = False,
        kv_cache_populate_seconds: float | None = None,
        seed: int = 0,
        kernels: str = "auto",
        max_num_seqs: int = 128,
        quantization: str | None = None,
        activation_quantization: str = "auto",
        lora_slots: int = 0,
        max_lora_rank: int = 16,
        draft_model: str | None = None,
        draft_quantization: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        self.dtype = self._resolve_dtype(dtype, model_dir, quantization)
        self.kv_dtype = self.dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
        self.block_size = block_size
        self.max_model_len = self._resolve_max_model_len(
            model_dir, max_model_len, default_pool=num_kv_blocks is None and kv_cache_bytes is None
        )
        self.rope_positions = self._rope_positions(model_dir, num_kv_blocks, kv_cache_bytes)
        # max_num_seqs, the most requests a step runs: the rows packed layouts are chosen for
        # (here and the draft model's), and what the default KV pool holds at full length.
        self.model, self.model_args, backend = self._load_model(
            model_dir, kernels, max_num_seqs, quantization, activation_quantization
        )
        self.kernels = backend.kernels
        self.matmuls = backend.matmuls  # where the linear layers run: "native", "onednn" or "torch"
        self.native_prefill = backend.native_prefill
        self.own_kernels = backend.own_kernels
        self.lora = self._lora_slots(lora_slots, max_lora_rank)
        self.threads = self._thread_governor()
        self.step_work = StepWork.of_model(self.model_args)
        self.vocab_size = self.model_args.vocab_size
        self.bos_token_id, self.eos_token_ids = read_special_token_ids(model_dir)
        self.sampler = Sampler(self.vocab_size, self.device, self.kernels)
        self.sampler.generator.manual_seed(seed)
        self.drafter = self._load_drafter(draft_model, draft_quantization, model_dir, kernels, max_num_seqs)
        self.bytes_per_block, self.num_kv_blocks = self._size_kv_cache(num_kv_blocks, kv_cache_bytes, max_num_seqs)
        self.kv_caches = self._allocate_kv_cache(kv_cache_populate, kv_cache_populate_seconds)
        self.workspace = self._allocate_workspace()
        self.attention = AttentionSetup(
            block_size, self.device, self.dtype, self.workspace, self.kernels, self.native_prefill,
            self.model_args.sliding_window,
        )  # fmt: skip

    # -- construction steps ------------------------------------------------------------

    def _load_model(
        self,
        model_dir: str,
        kernels: str,
        batch_size_hint: int,
        quantization: str | None,
        activation_quantization: str = "auto",
    ) -> tuple[Transformer, ModelArgs, ModelBackend]:
        """Weights on the device, their layers on the backend ``backends/backend.py`` chooses."""
        build = KernelBuild.start(kernels, self.device, self.dtype)  # compiles while the weights load
        return load_served_model(
            model_dir,
            build,
            kernels=kernels,
            device=self.device,
            dtype=self.dtype,
            batch_size_hint=batch_size_hint,
            quantization=quantization,
            activation_quantization=activation_quantization,
            rope_positions=self.rope_positions,
        )

    def _resolve_dtype(self, dtype: str, model_dir: str, quantization: str | None) -> torch.dtype:
        """``--dtype``; ``auto`` on a quantized checkpoint (a GGUF file, GPTQ / AWQ /
        compressed-tensors) whose layers stay quantized is float32: the quantized GEMM
        computes in float32 whatever the activations' dtype, so bfloat16 would only round
        them (enough, on SmolLM2, to turn a near tie of its first answer token the wrong way)."""
        if dtype == "auto" and self.device.type == "cpu" and quantization in (None, "auto"):
            if gguf_source(model_dir) is not None or quantization_scheme(read_config(model_dir)) is not None:
                logger.info("dtype auto: float32, because a quantized checkpoint's layers compute in float32")
                return torch.float32
        return resolve_dtype(dtype, self.device)

    def _load_drafter(
        self, path: str | None, quantization: str, model_dir: str, kernels: str, batch_size_hint: int
    ) -> Drafter:
        """Speculative decoding's draft model, where one is configured (``model/spec/drafter.py``)."""
        if path is None:
            return NoDraftModel()
        governor = self.threads
        return DraftModel(
            path,
            target_dir=model_dir,
            target_vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            rope_positions=self.rope_positions,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            kernels=kernels,
            batch_size_hint=batch_size_hint,
            quantization=quantization,
            sampler=self.sampler,
            all_threads=contextlib.nullcontext if governor is None else governor.all_threads,
        )

    def _lora_slots(self, num_slots: int, max_rank: int) -> LoraSlots | NoLoraSlots:
        """Slots for LoRA adapters around the backend's layers (model/lora/), or none: a
        model without them runs exactly as before."""
        if num_slots <= 0:
            return NoLoraSlots()
        return LoraSlots(self.model, self.kernels, num_slots=num_slots, max_rank=max_rank)

    def _thread_governor(self) -> ThreadGovernor | None:
        """Thread count per step, by measurement (backends/threads.py); only where tokens do not
        depend on it: the native kernels, the quantized GEMM among them, never split a sum
        across threads."""
        return ThreadGovernor(torch.get_num_threads()) if self.own_kernels else None

    def _resolve_max_model_len(self, model_dir: str, max_model_len: int | None, *, default_pool: bool) -> int:
        """``--max-model-len``, capped at the model's ``max_position_embeddings`` (read from
        its config, before any weight loads); with the default pool, refused when one
        request of that length needs more KV cache than the memory available."""
        args = ModelArgs.from_hf_config(read_config(model_dir))
        resolved = min(max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        if max_model_len is not None and max_model_len > args.max_position_embeddings:
            logger.warning(
                "--max-model-len %d is beyond the model's max_position_embeddings; using %d", max_model_len, resolved
            )
        args.check_max_model_len(resolved)
        if default_pool:
            check_one_request_fits(
                bytes_per_block=self._target_block_bytes(args),
                block_size=self.block_size,
                max_model_len=resolved,
                device=self.device,
            )
        return resolved

    def _rope_positions(self, model_dir: str, num_kv_blocks: int | None, kv_cache_bytes: int | None) -> int:
        """Positions the native rotary tables hold (the target's and the draft model's): the
        served context, and no more than a pool given by flag holds, since a request's every
        token has a slot in the pool at once (a config's context length alone, 2^40 say, must
        not size a table beside a small explicit pool). The default pool is sized later, but
        one full-length request fits it (``_resolve_max_model_len``)."""
        if num_kv_blocks is None and kv_cache_bytes is not None:
            args = ModelArgs.from_hf_config(read_config(model_dir))
            # An upper bound: a draft model's blocks share the bytes.
            num_kv_blocks = kv_cache_bytes // self._target_block_bytes(args)
        if num_kv_blocks is None:
            return self.max_model_len
        return max(1, min(self.max_model_len, num_kv_blocks * self.block_size))

    def _target_block_bytes(self, args: ModelArgs) -> int:
        """One KV block's bytes across the target's layers."""
        return bytes_per_block(
            num_layers=args.num_layers,
            block_size=self.block_size,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype=self.kv_dtype,
        )

    def _size_kv_cache(
        self, num_kv_blocks: int | None, kv_cache_bytes: int | None, max_num_seqs: int
    ) -> tuple[int, int]:
        """(bytes per block, blocks in the pool), by attention/kv_memory.py's rules."""
        # A draft model's cache has a block for every one of the target's.
        block_bytes = self._target_block_bytes(self.model_args) + self.drafter.bytes_per_block
        num_blocks = size_kv_cache(
            num_kv_blocks=num_kv_blocks,
            kv_cache_bytes=kv_cache_bytes,
            bytes_per_block=block_bytes,
            block_size=self.block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            device=self.device,
        )
        return block_bytes, num_blocks

    def _allocate_kv_cache(self, populate: bool, populate_seconds: float | None) -> list[KVCache]:
        args = self.model_args
        start = time.perf_counter()
        kv_caches = allocate_kv_cache(
            num_layers=args.num_layers,
            num_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.drafter.allocate(self.num_kv_blocks)
        populated = ""
        if populate:
            done = populate_kv_cache(kv_caches + self.drafter.kv_caches, populate_seconds)
            seconds = time.perf_counter() - start
            populated = (
                f", populated in {seconds:.2f} s"
                if done == self.num_kv_blocks
                else f", blocks 0-{done - 1} populated in {seconds:.2f} s (--kv-cache-populate-seconds); "
                "the rest fault in on first use"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %s), max_model_len %d%s",
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.bytes_per_block / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
            self.max_model_len,
            populated,
        )
        return kv_caches

    def _allocate_workspace(self) -> KVCache:
        """Gather buffers for SDPA attention, shared by all layers (allocating per layer
        costs page faults on CPU). No context outgrows the pool, so neither does the
        workspace, whatever max_model_len says."""
        args = self.model_args
        longest = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        shape = (workspace_tokens(longest, self.block_size), args.num_kv_heads, args.head_dim)
        return (
            torch.empty(shape, dtype=self.dtype, device=self.device),
            torch.empty(shape, dtype=self.dtype, device=self.device),
        )

    # -- the step ---------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(scheduler_output.finished_request_ids)
        self.drafter.forget(scheduler_output.finished_request_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        return self.drafter.step(batch_order(scheduler_output.scheduled), self._step)

    def _step(self, batch: list[ScheduledRequest], proposals: dict[str, list[Proposal]]) -> ModelRunnerOutput:
        """The target's forward over ``batch``, then its rows sampled: each request's next
        token, or its drafts verified (``proposals``: a draft model's q, by request), and the
        prompt logprobs owed."""
        t0 = time.perf_counter()
        if self.threads is not None:
            self.threads.before_step(sum(s.num_scheduled_tokens for s in batch))
        input_ids, positions, meta = self._prepare_inputs(batch)
        sample_rows, sample_requests, logprob_jobs = logits_rows(batch)
        # Each request with drafts samples at its last real row and at every draft row.
        verify = VerifyRows.of(
            batch, sample_rows, sample_requests, self.sampler.state.grammars.num_valid_drafts, proposals
        )
        output = ModelRunnerOutput()
        with torch.inference_mode():
            hidden = self._forward(batch, input_ids, positions, meta)  # [num_tokens, hidden]
            if verify.rows:
                logits = self._logits(hidden, verify.rows)  # [num_sampled, vocab] float32
                sampled = self.sampler.sample(logits, verify.views, verify.proposals)
                output.errors.update(sampled.errors)
                verify.accept(sampled, output)
            for job in logprob_jobs:
                entries = output.prompt_logprobs[job.request_id] = []
                # Chunked: a long prompt's logits would be [prompt_len, vocab] float32 at once.
                for i in range(0, len(job.rows), PROMPT_LOGITS_CHUNK):
                    logits = self._logits(hidden, job.rows[i : i + PROMPT_LOGITS_CHUNK])
                    targets = job.target_token_ids[i : i + PROMPT_LOGITS_CHUNK]
                    entries += self.sampler.prompt_logprobs(logits, targets, job.num_top)
        output.execute_s = time.perf_counter() - t0
        if self.threads is not None:
            self.threads.after_step(output.execute_s, self.step_work.of(batch))
        return output

    def _forward(
        self, batch: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The decoder over the step's tokens; each row adds its request's LoRA adapter, if any."""
        with self.lora.applied(batch):
            return self.model(input_ids, positions, self.kv_caches, meta)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """LM head over the given rows of ``hidden`` only: [len(rows), vocab] float32."""
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    def _prepare_inputs(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        query_lens, starts, block_tables = attention_rows(batch)
        token_ids: list[int] = []
        for s in batch:
            token_ids += s.request.all_token_ids[s.start : s.start + s.num_new_tokens]
            token_ids += s.draft_token_ids
        positions = flat_positions(query_lens, starts)  # [num_tokens], CPU
        meta = self.attention.metadata(query_lens, starts, block_tables, positions)
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, positions.to(self.device, non_blocking=True), meta

    def warmup(self) -> None:
        """Run one small dummy step (a decode and a prefill chunk) so the first real step
        does not pay for lazy initialisation. Call before serving: it overwrites the first
        KV blocks."""
        n = max(2, min(16, self.block_size, self.max_model_len - 1))
        k = -(-n // self.block_size)  # blocks per dummy request
        if self.num_kv_blocks < k:
            logger.warning("KV cache too small for a warmup step; skipped")
            return
        token = _dummy_token_id(self.bos_token_id, self.vocab_size)
        prefill = _WarmupRequest("warmup-prefill", [token] * n)
        scheduled = [ScheduledRequest(prefill, n, list(range(k)))]
        if self.num_kv_blocks >= 2 * k:
            decode = _WarmupRequest("warmup-decode", [token] * n, num_computed_tokens=n - 1)
            scheduled.insert(0, ScheduledRequest(decode, 1, list(range(k, 2 * k))))
        self.execute(SchedulerOutput(scheduled=scheduled))
        self.sampler.forget([s.request.request_id for s in scheduled])
        logger.info("warmup step done")

    def time_steps(self, sizes: list[int], repeats: int = 2) -> list[tuple[int, float]]:
        """(rows, seconds) of dummy decode steps of each of ``sizes`` rows, the fastest of
        ``repeats`` rounds (a round over every size, so that a burst of other work on the
        machine spoils one measurement of a size, not all), within CALIBRATION_BUDGET_S:
        sizes not reached are left out. Each row attends to CALIBRATION_CONTEXT tokens, in
        the first KV blocks, which every row shares: call before serving, like warmup."""
        context = min(CALIBRATION_CONTEXT, self.max_model_len - 1, self.num_kv_blocks * self.block_size - 1)
        if context < 1:
            return []
        block_ids = list(range(-(-(context + 1) // self.block_size)))
        token = _dummy_token_id(self.bos_token_id, self.vocab_size)
        best: dict[int, float] = {}
        start = time.perf_counter()
        for round_ in range(repeats):
            for n in sizes:
                if time.perf_counter() - start > CALIBRATION_BUDGET_S * (round_ + 1) / repeats:
                    break
                scheduled = [
                    ScheduledRequest(_WarmupRequest(f"calibrate-{i}", [token] * (context + 1), context), 1, block_ids)
                    for i in range(n)
                ]
                seconds = self.execute(SchedulerOutput(scheduled=scheduled)).execute_s
                best[n] = min(seconds, best.get(n, seconds))
                self.sampler.forget([s.request.request_id for s in scheduled])
        return sorted(best.items())

    def time_draft_passes(self, sizes: list[int]) -> list[tuple[int, float]]:
        """(rows, seconds) of the draft model's passes of each of ``sizes`` rows, timed as
        ``time_steps`` times steps; none without a draft model."""
        context = min(CALIBRATION_CONTEXT, self.max_model_len - 1, self.num_kv_blocks * self.block_size - 1)
        return self.drafter.time_passes(sizes, context, CALIBRATION_BUDGET_S / 2) if context >= 1 else []


def batch_order(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The step's rows in the runner's order (outputs are keyed by request id, so the order
    is the runner's alone): decodes (with their drafts, which attend as decode rows:
    model/spec/layout.py) first, sorted by context length so that neighbours in a decode
    group pad little (by LoRA adapter first, so that each adapter's rows are one run in the
    GEMM's LoRA term), then prefill chunks."""
    decodes = sorted(
        (s for s in scheduled if s.num_new_tokens == 1),
        key=lambda s: (-1 if s.request.lora_slot is None else s.request.lora_slot, s.start),
    )
    return decodes + [s for s in scheduled if s.num_new_tokens != 1]


@dataclass(frozen=True)
class StepWork:
    """A step's modelled arithmetic, the thread governor's unit of work: the linear layers
    per token, attention per (query, key) pair."""

    per_token: int
    per_pair: int

    @classmethod
    def of_model(cls, args: ModelArgs) -> StepWork:
        qkv = args.hidden_size * (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        mlp = 3 * args.hidden_size * args.intermediate_size
        linear = 2 * args.num_layers * (qkv + args.num_heads * args.head_dim * args.hidden_size + mlp)
        return cls(per_token=linear, per_pair=4 * args.num_layers * args.num_heads * args.head_dim)

    def of(self, batch: list[ScheduledRequest]) -> float:
        tokens = pairs = 0
        for s in batch:
            n = s.num_scheduled_tokens
            tokens += n
            pairs += n * (2 * s.start + n + 1) // 2
        return float(tokens * self.per_token + pairs * self.per_pair)


def _dummy_token_id(bos_token_id: int | None, vocab_size: int) -> int:
    """The token the dummy steps repeat: BOS where the model has one in its vocabulary."""
    return bos_token_id if bos_token_id is not None and bos_token_id < vocab_size else 0


@dataclass
class _WarmupRequest:
    """A greedy dummy request for the warm-up step (a ``RequestView``)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=1))
    output_token_ids: Sequence[int] = ()
    eos_token_ids: tuple[int, ...] = ()
    num_prompt_logprobs_done: int = 0
    grammar: object | None = None
    lora_slot: int | None = None
    draft_token_ids: Sequence[int] = ()

    @property
    def draft_base(self) -> _WarmupRequest:
        return self

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    num_prompt_tokens = num_tokens

    @property
    def num_output_tokens(self) -> int:
        return 0
