"""The draft model of ``{"method": "draft_model"}``: a smaller model with the target's
vocabulary that fills the scheduler's ``MODEL_DRAFT`` slots in the step itself.

    DraftModel.step(batch, target_step), around the target's step (``drafting.py``):
        drafts = propose(batch)               k passes of the draft model -> draft tokens
        target_step(drafts.batch, proposals)  the target's forward and verification
                                              (verify.py: greedy and seeded rows keep a
                                              draft equal to their own token, sampled
                                              rows judge it against q, the draft's
                                              distribution, by rejection sampling)
        commit(drafts, output)                its cache is valid up to the accepted tokens

Its KV cache is its own tensors, addressed by the target's block tables: position p of a
request lives in the same block and slot in both caches, so the scheduler's reservation
of 1 + k slots covers the draft's writes too, and blocks are freed, preempted and shared
for both at once. Per request the drafter remembers up to which position its cache is
valid (``num_computed``); a request the rule gave no drafts for a while falls behind and
catches up in its next first pass, and a preempted or new request (its state forgotten)
starts from position 0, so a prefix-cache hit never trusts draft entries this request
did not write (equal tokens give equal entries, so rewriting a shared block is harmless).

    request at n tokens (t = its last, at n - 1), k drafts, cache valid below c:

    pass 0      tokens c .. n-1 (t last)  -> q0 -> d0
    pass j      d(j-1) at n + j - 1       -> qj -> dj          (j = 1 .. k-1)
    commit      a drafts accepted: valid below min(n + k - 1, n + a)

A draft at a greedy or seeded row is the draft model's argmax; at an unseeded sampled row
it is drawn from q (the request's temperature, top-k, top-p and min-p on the draft's
logits), and q goes to verification with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from engine_svc.model.attention import AttentionSetup, KVCache, flat_positions, workspace_tokens
from engine_svc.model.attention.kv_memory import allocate_kv_cache, bytes_per_block
from engine_svc.model.backends.backend import KernelBuild
from engine_svc.model.load.gguf_checkpoint import resolve_model_dir
from engine_svc.model.load.served import load_served_model
from engine_svc.model.sample.sampler import Proposal, Sampler
from engine_svc.model.sample.sampler_stages import argmax_rows, is_greedy
from engine_svc.model.spec.drafting import TargetStep
from engine_svc.model.spec.vocab import check_same_vocabulary
from engine_svc.outputs import MODEL_DRAFT, ModelRunnerOutput, ScheduledRequest
from engine_svc.types import RequestView

logger = logging.getLogger(__name__)


@dataclass
class Drafts:
    """What ``propose`` made of a step: the batch with its draft slots filled."""

    batch: list[ScheduledRequest]
    # Unseeded sampled requests' drafts with the distributions they were drawn from.
    proposals: dict[str, list[Proposal]] = field(default_factory=dict)
    passes: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds) per pass
    drafted: list[ScheduledRequest] = field(default_factory=list)  # the filled entries


class DraftModel:
    def __init__(
        self,
        model_path: str,
        *,
        target_dir: str,
        target_vocab_size: int,
        max_model_len: int,
        rope_positions: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kernels: str,
        batch_size_hint: int,
        quantization: str,
        sampler: Sampler,
        all_threads: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        """``sampler``: the target's, whose row transforms draw the drafts of sampled rows;
        ``all_threads``: the passes run on every thread (``backends/threads.py``: the step's count is
        chosen for the step's rows, not for theirs)."""
        model_dir, self.name = resolve_model_dir(model_path)
        build = KernelBuild.start(kernels, device, dtype)
        self.model, self.args, backend = load_served_model(
            str(model_dir),
            build,
            kernels=kernels,
            device=device,
            dtype=dtype,
            batch_size_hint=batch_size_hint,
            quantization=quantization,
            rope_positions=rope_positions,  # the target's: its own context length must not size the table
        )
        check_same_vocabulary(target_dir, model_dir, target_vocab_size, self.args.vocab_size)
        if self.args.max_position_embeddings < max_model_len:
            raise ValueError(
                f"the draft model's context ({self.args.max_position_embeddings} tokens) is shorter than the "
                f"target's max_model_len ({max_model_len}); set --max-model-len to at most that"
            )
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.kernels, self.native_prefill = backend.kernels, backend.native_prefill
        self.target_vocab_size = target_vocab_size
        self.vocab_size = min(target_vocab_size, self.args.vocab_size)  # ids both know
        self.bytes_per_block = bytes_per_block(
            num_layers=self.args.num_layers,
            block_size=block_size,
            num_kv_heads=self.args.num_kv_heads,
            head_dim=self.args.head_dim,
            dtype=dtype,
        )
        self.kv_caches: list[KVCache] = []
        shape = (workspace_tokens(max_model_len, block_size), self.args.num_kv_heads, self.args.head_dim)
        self.workspace = (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )
        self.attention = AttentionSetup(
            block_size, device, dtype, self.workspace, self.kernels, self.native_prefill, self.args.sliding_window
        )
        self.sampler, self.all_threads = sampler, all_threads
        self._num_computed: dict[str, int] = {}  # request id -> positions its cache holds
        logger.info("draft model %s: %s", self.name, backend.describe())

    def allocate(self, num_blocks: int) -> None:
        """Its KV cache: as many blocks as the target's, which it shares the ids of (the
        runner populates the two together)."""
        self.kv_caches = allocate_kv_cache(
            num_layers=self.args.num_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.args.num_kv_heads,
            head_dim=self.args.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def forget(self, request_ids: Collection[str]) -> None:
        for request_id in request_ids:
            self._num_computed.pop(request_id, None)

    # -- the step -------------------------------------------------------------------------

    def step(self, batch: list[ScheduledRequest], target_step: TargetStep) -> ModelRunnerOutput:
        """The target's step on ``batch`` with its ``MODEL_DRAFT`` slots filled first."""
        drafts = self.propose(batch)
        if drafts is None:
            return target_step(batch, {})
        output = target_step(drafts.batch, drafts.proposals)
        self.commit(drafts, output)
        output.draft_passes = drafts.passes
        return output

    def propose(self, batch: list[ScheduledRequest]) -> Drafts | None:
        """Fill every ``MODEL_DRAFT`` slot of ``batch``; None when it has none."""
        drafting = [s for s in batch if s.draft_token_ids and s.draft_token_ids[0] == MODEL_DRAFT]
        if not drafting:
            return None
        with self.all_threads(), torch.inference_mode():
            return self._propose(batch, drafting)

    def _propose(self, batch: list[ScheduledRequest], drafting: list[ScheduledRequest]) -> Drafts:
        drafts = Drafts(batch)
        tokens: dict[str, list[int]] = {s.request.request_id: [] for s in drafting}
        # Pass 0: each request from where its cache ends to its last token; decodes lead.
        first = sorted(drafting, key=lambda s: s.request.num_tokens - self._catch_up_start(s.request) > 1)
        starts = [self._catch_up_start(s.request) for s in first]
        token_ids = [list(s.request.all_token_ids[c : s.request.num_tokens]) for s, c in zip(first, starts)]
        current = first
        for j in range(max(len(s.draft_token_ids) for s in drafting)):
            if j > 0:
                current = [s for s in current if len(s.draft_token_ids) > j]
                starts = [s.request.num_tokens + j - 1 for s in current]
                token_ids = [[tokens[s.request.request_id][-1]] for s in current]
            t0 = time.perf_counter()
            logits = self._forward(token_ids, starts, [s.block_ids for s in current])  # [len(current), vocab]
            for s, token_id, proposal in zip(current, *self._choose(logits, current)):
                tokens[s.request.request_id].append(token_id)
                if proposal is not None:
                    drafts.proposals.setdefault(s.request.request_id, []).append(proposal)
            drafts.passes.append((sum(len(t) for t in token_ids), time.perf_counter() - t0))
        filled = {id(s): dataclasses.replace(s, draft_token_ids=tokens[s.request.request_id]) for s in drafting}
        drafts.batch = [filled.get(id(s), s) for s in batch]
        drafts.drafted = list(filled.values())
        return drafts

    def commit(self, drafts: Drafts, output: ModelRunnerOutput) -> None:
        """Its cache is valid up to the tokens verification kept: the accepted drafts'
        entries were written by its passes, the rejected ones' are overwritten later."""
        for s in drafts.drafted:
            request_id, n = s.request.request_id, s.request.num_tokens
            num_accepted = len(output.sampled_token_ids.get(request_id, [0])) - 1
            self._num_computed[request_id] = min(n + len(s.draft_token_ids) - 1, n + num_accepted)

    def _catch_up_start(self, request: RequestView) -> int:
        return min(self._num_computed.get(request.request_id, 0), request.num_tokens - 1)

    def _forward(self, token_ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Rows ``token_ids[i]`` at positions ``starts[i]..`` on block table ``tables[i]``
        (single-row requests first) -> the draft's logits at each request's last row,
        [num_requests, vocab] float32, on the ids both models know."""
        query_lens = [len(t) for t in token_ids]
        positions = flat_positions(query_lens, starts)
        meta = self.attention.metadata(query_lens, starts, tables, positions)
        input_ids = torch.tensor([t for row in token_ids for t in row], dtype=torch.long).to(self.device)
        hidden = self.model(input_ids, positions.to(self.device), self.kv_caches, meta)  # [num_tokens, hidden]
        last = torch.tensor(query_lens).cumsum(0) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last.to(self.device)))
        return logits[:, : self.vocab_size].float()

    def _choose(
        self, logits: torch.Tensor, scheduled: list[ScheduledRequest]
    ) -> tuple[list[int], list[Proposal | None]]:
        """A draft token per row of ``logits`` [n, vocab]: the argmax at greedy and seeded
        rows, a draw from q elsewhere (with q, widened to the target's vocabulary)."""
        token_ids = argmax_rows(logits).tolist()
        proposals: list[Proposal | None] = [None] * len(scheduled)
        drawn = [
            i
            for i, s in enumerate(scheduled)
            if not is_greedy(s.request.sampling_params) and s.request.sampling_params.seed is None
        ]
        sampler = self.sampler
        if drawn:
            q = sampler.probabilities(logits[drawn], [scheduled[i].request for i in drawn])  # [d, vocab]
            if self.vocab_size < self.target_vocab_size:
                q = torch.nn.functional.pad(q, (0, self.target_vocab_size - self.vocab_size))
            for i, token_id, probs in zip(drawn, sampler.draw(q).tolist(), q):
                token_ids[i] = token_id
                proposals[i] = Proposal(token_id, probs)
        return token_ids, proposals

    # -- start-up -----------------------------------------------------------------------------

    @torch.inference_mode()
    def time_passes(self, sizes: list[int], context: int, budget_s: float) -> list[tuple[int, float]]:
        """(rows, seconds) of single-row passes of each of ``sizes`` rows, the faster of two
        rounds, within ``budget_s``; every row attends to ``context`` tokens in the first
        blocks (call before serving)."""
        table = list(range(-(-(context + 1) // self.block_size)))
        best: dict[int, float] = {}
        start = time.perf_counter()
        for round_ in range(2):
            for n in sizes:
                if time.perf_counter() - start > budget_s * (round_ + 1) / 2:
                    break
                t0 = time.perf_counter()
                argmax_rows(self._forward([[0]] * n, [context] * n, [table] * n)).tolist()
                seconds = time.perf_counter() - t0
                best[n] = min(seconds, best.get(n, seconds))
        return sorted(best.items())
