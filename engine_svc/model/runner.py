"""ModelRunner: owns the weights and the KV cache, and runs one scheduler step.

    SchedulerOutput ─▶ flatten tokens (decodes first, sorted by context) ─▶ input ids,
    positions, AttentionMetadata ─▶ model ─▶ hidden [num_tokens, hidden]
    ─▶ pick rows that need logits ─▶ lm_head ─▶ float32 ─▶ sampler ─▶ ModelRunnerOutput

Only the rows that need logits go through the LM head: the last row of each request whose
chunk reaches its end (``needs_sample``) and the prompt rows whose prompt logprobs are
still owed. The runner never mutates requests; the scheduler advances their counters.
The runner never imports the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine_svc.model.attention import AttentionMetadata, KVCache, flat_positions, workspace_tokens
from engine_svc.model.kv_memory import default_num_kv_blocks, zeroed
from engine_svc.model.loader import load_model, read_special_token_ids, resolve_dtype
from engine_svc.model.native import load_decode_attention
from engine_svc.model.packed_linear import pack_linears, packing_supported
from engine_svc.model.sampler import Sampler
from engine_svc.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine_svc.types import RequestView, SamplingParams

logger = logging.getLogger(__name__)

# Prompt rows per LM-head call when prompt logprobs are asked for; bounds the logits
# tensor to PROMPT_LOGITS_CHUNK x vocab float32.
PROMPT_LOGITS_CHUNK = 512


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
        seed: int = 0,
        kernels: str = "auto",
        batch_size_hint: int = 64,
        max_num_seqs: int = 128,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.model_args = load_model(model_dir, self.device, self.dtype)
        self.num_packed_linears = 0
        if kernels == "auto" and packing_supported(self.device, self.dtype):
            self.num_packed_linears = pack_linears(self.model, batch_size_hint)
            logger.info("matmuls: %d linear layers packed for oneDNN", self.num_packed_linears)
        self.decode_kernel = None
        if kernels == "auto" and self.device.type == "cpu" and self.dtype == torch.float32:
            self.decode_kernel = load_decode_attention()
            if self.decode_kernel is not None:
                logger.info("decode attention: native kernel reading the paged KV cache in place")
        args = self.model_args
        self.vocab_size = args.vocab_size
        self.max_model_len = min(max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        if max_model_len is not None and max_model_len > args.max_position_embeddings:
            logger.warning(
                "--max-model-len %d is beyond the model's max_position_embeddings; using %d",
                max_model_len,
                self.max_model_len,
            )
        args.check_max_model_len(self.max_model_len)
        self.bos_token_id, self.eos_token_ids = read_special_token_ids(model_dir)

        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        # K and V, every layer.
        self.bytes_per_block = 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * itemsize
        if num_kv_blocks is None and kv_cache_bytes is not None:
            num_kv_blocks = kv_cache_bytes // self.bytes_per_block
        elif num_kv_blocks is None:
            num_kv_blocks = default_num_kv_blocks(
                bytes_per_block=self.bytes_per_block,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_model_len=self.max_model_len,
                device=self.device,
            )
        if num_kv_blocks < 1:
            raise ValueError(
                f"KV cache holds no block: a block needs {self.bytes_per_block} bytes "
                f"(got num_kv_blocks={num_kv_blocks}, kv_cache_bytes={kv_cache_bytes})"
            )
        self.num_kv_blocks = num_kv_blocks
        if num_kv_blocks * block_size < self.max_model_len:
            logger.warning(
                "KV cache holds %d tokens, less than max_model_len %d", num_kv_blocks * block_size, self.max_model_len
            )
        self.kv_caches = self._allocate_kv_cache()

        # Gather buffers for attention, shared by all layers (allocating per layer costs
        # page faults on CPU).
        ws_shape = (workspace_tokens(self.max_model_len, block_size), args.num_kv_heads, args.head_dim)
        self.workspace: KVCache = (
            torch.empty(ws_shape, dtype=self.dtype, device=self.device),
            torch.empty(ws_shape, dtype=self.dtype, device=self.device),
        )
        self.sampler = Sampler(self.vocab_size, self.device)
        self.sampler.generator.manual_seed(seed)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB), max_model_len %d",
            num_kv_blocks,
            block_size,
            num_kv_blocks * self.bytes_per_block / 2**20,
            self.max_model_len,
        )

    def _allocate_kv_cache(self) -> list[KVCache]:
        args = self.model_args
        # Zeroed, not empty: masked padding reads these slots, and softmax weight 0 times
        # a garbage NaN would still be NaN.
        cache = zeroed(
            (args.num_layers, 2, self.num_kv_blocks, self.block_size, args.num_kv_heads, args.head_dim),
            self.dtype,
            self.device,
        )
        return [(cache[i, 0], cache[i, 1]) for i in range(args.num_layers)]

    # -- the step ---------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(scheduler_output.finished_request_ids)
        output = ModelRunnerOutput()
        if scheduler_output.is_empty:
            return output
        # The batch order is the runner's alone (outputs are keyed by request id): decodes
        # first, sorted by context length so that neighbours in a decode group pad little,
        # then prefill chunks.
        decodes = sorted((s for s in scheduler_output.scheduled if s.num_new_tokens == 1), key=lambda s: s.start)
        chunks = [s for s in scheduler_output.scheduled if s.num_new_tokens != 1]
        batch = decodes + chunks

        input_ids, positions, meta = self._prepare_inputs(batch)
        sample_rows, sample_requests, logprob_jobs = _logits_rows(batch)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
            if sample_rows:
                logits = self._logits(hidden, sample_rows)  # [num_sampled, vocab] float32
                sampled = self.sampler.sample(logits, sample_requests)
                output.errors.update(sampled.errors)
                for request, token_id, logprob in zip(sample_requests, sampled.token_ids, sampled.logprobs):
                    output.sampled_token_ids[request.request_id] = token_id
                    if logprob is not None:
                        output.logprobs[request.request_id] = logprob
            for job in logprob_jobs:
                entries = output.prompt_logprobs[job.request_id] = []
                # Chunked: a long prompt's logits would be [prompt_len, vocab] float32 at once.
                for i in range(0, len(job.rows), PROMPT_LOGITS_CHUNK):
                    logits = self._logits(hidden, job.rows[i : i + PROMPT_LOGITS_CHUNK])
                    targets = job.target_token_ids[i : i + PROMPT_LOGITS_CHUNK]
                    entries += self.sampler.prompt_logprobs(logits, targets, job.num_top)
        return output

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """LM head over the given rows of ``hidden`` only: [len(rows), vocab] float32."""
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    def _prepare_inputs(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        query_lens = [s.num_new_tokens for s in batch]
        starts = [s.start for s in batch]
        token_ids: list[int] = []
        for s, start, n in zip(batch, starts, query_lens):
            token_ids += s.request.all_token_ids[start : start + n]
        positions = flat_positions(query_lens, starts)  # [num_tokens], CPU
        meta = AttentionMetadata.build(
            query_lens,
            starts,
            [s.block_ids for s in batch],
            positions=positions,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            workspace=self.workspace,
            decode_kernel=self.decode_kernel,
        )
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
        token = self.bos_token_id if self.bos_token_id is not None and self.bos_token_id < self.vocab_size else 0
        prefill = _WarmupRequest("warmup-prefill", [token] * n)
        scheduled = [ScheduledRequest(prefill, n, list(range(k)))]
        if self.num_kv_blocks >= 2 * k:
            decode = _WarmupRequest("warmup-decode", [token] * n, num_computed_tokens=n - 1)
            scheduled.insert(0, ScheduledRequest(decode, 1, list(range(k, 2 * k))))
        self.execute(SchedulerOutput(scheduled=scheduled))
        self.sampler.forget([s.request.request_id for s in scheduled])
        logger.info("warmup step done")


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


@dataclass
class _PromptLogprobJob:
    request_id: str
    rows: list[int]  # rows of the flattened batch; row for position p predicts prompt token p + 1
    target_token_ids: list[int]
    num_top: int


def _logits_rows(batch: list[ScheduledRequest]) -> tuple[list[int], list[RequestView], list[_PromptLogprobJob]]:
    """Rows of the flattened batch that need logits: (sample rows, their requests, prompt-logprob jobs).

    Prompt tokens up to ``num_prompt_logprobs_done`` were reported already (e.g. before a
    preemption), so only later ones get entries.
    """
    sample_rows: list[int] = []
    sample_requests: list[RequestView] = []
    jobs: list[_PromptLogprobJob] = []
    row = 0
    for s in batch:
        request, start, n = s.request, s.start, s.num_new_tokens
        if s.needs_sample:
            sample_rows.append(row + n - 1)
            sample_requests.append(request)
        num_top = request.sampling_params.prompt_logprobs
        if num_top is not None:
            lo = max(start, request.num_prompt_logprobs_done)  # positions [lo, hi) predict tokens lo+1 .. hi
            hi = min(start + n, request.num_prompt_tokens - 1)
            if lo < hi:
                rows = list(range(row + lo - start, row + hi - start))
                targets = list(request.prompt_token_ids[lo + 1 : hi + 1])
                jobs.append(_PromptLogprobJob(request.request_id, rows, targets, num_top))
        row += n
    return sample_rows, sample_requests, jobs
