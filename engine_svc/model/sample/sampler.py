"""Turns each request's last-position logits into its next token, vectorised over the batch.

    raw logits ─▶ logit_bias ─▶ grammar mask ─▶ min_tokens mask ─▶ penalties ─┬─▶ argmax        greedy rows
                                                     └─▶ ÷ temperature ─▶ top-k ─▶ top-p
                                                         ─▶ min-p ─▶ exponential race           sampled rows
    raw logits ─▶ log_softmax ─▶ chosen token's logprob and rank, top alternatives

The sampler decides which stages a batch needs and turns per-row parameters into tensors
once per call; the stages themselves are pure tensor functions
(``engine_svc/model/sample/sampler_stages.py``), and everything kept per request between steps
(token counts, seeded generators, logit_bias and min_tokens tensors, grammar matchers)
lives in ``SamplerState`` (``engine_svc/model/sample/sampler_state.py``), dropped by ``forget``.
A stage that no row uses costs nothing (an all-greedy batch without penalties is one
argmax). The order and semantics follow vLLM so results can be compared. Parameter
tensors travel host -> device without waiting, so the only host sync is reading the
chosen tokens (and logprobs) back.

Entry points run under inference mode, so the state kept between calls (penalty counts)
is created and updated the same way whoever calls: an inference tensor may not be
written outside inference mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_svc.model.sample import sampler_stages as stages
from engine_svc.model.sample.sampler_state import SamplerState
from engine_svc.model.structured import BatchMask
from engine_svc.types import Logprob, RequestError, RequestView

if TYPE_CHECKING:
    from engine_svc.model.native import NativeKernels


@dataclass(frozen=True)
class Proposal:
    """A draft token for one row, drawn from ``probs`` (the draft model's distribution,
    [vocab] float32): the row keeps it with chance min(1, p/q), else draws from
    norm(max(p - q, 0)), so its token is distributed exactly as without a draft."""

    token_id: int
    probs: torch.Tensor


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]  # None where request.sampling_params.logprobs is None
    # Requests whose output constraint failed this step, by id: their token is not to be kept.
    errors: dict[str, RequestError] = field(default_factory=dict)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, kernels: NativeKernels | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.kernels = kernels  # for argmax over float32 CPU rows
        # Noise for rows without a seed; public so tests and benchmarks can fix it.
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.state = SamplerState(vocab_size, self.device)

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: list[RequestView], proposals: Sequence[Proposal | None] | None = None
    ) -> SamplerOutput:
        """``logits`` [num_rows, >= vocab]: one row per request, in the order of ``requests``.
        ``proposals``, where given, is one per row: a draft model's token for that row, kept
        or replaced by rejection sampling (sampled rows without a seed only; others ignore it)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        if not requests:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw = logits[:, : self.vocab_size]  # [num_rows, vocab]; padding columns dropped
        grammar = self.state.grammar_mask(requests)  # None when no row is constrained
        x = self._process_logits(raw, requests, grammar)  # [num_rows, vocab]

        sampled_rows = [i for i, r in enumerate(requests) if not stages.is_greedy(r.sampling_params)]
        row_proposals = [None] * len(requests) if proposals is None else proposals
        if not sampled_rows:
            token_ids = stages.argmax_rows(x, self.kernels)  # [num_rows]
        elif len(sampled_rows) == len(requests):
            token_ids = self._sample_rows(x, requests, row_proposals)
        else:
            rows = self._tensor(sampled_rows)
            token_ids = stages.argmax_rows(x, self.kernels)
            token_ids[rows] = self._sample_rows(
                x[rows], [requests[i] for i in sampled_rows], [row_proposals[i] for i in sampled_rows]
            )

        logprobs = self._sampled_logprobs(raw, token_ids, requests)
        errors = grammar.errors if grammar is not None else {}
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, errors=errors)

    @torch.inference_mode()
    def prompt_logprobs(self, logits: torch.Tensor, target_token_ids: list[int], num_top: int) -> list[Logprob]:
        """``logits`` [n, >= vocab]: row j predicts ``target_token_ids[j]``. The caller bounds
        n (the runner computes prompt logits in chunks of ``PROMPT_LOGITS_CHUNK`` rows)."""
        targets = self._tensor(target_token_ids)  # [n]
        return stages.logprob_entries(logits[:, : self.vocab_size], targets, num_top)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop state held for these requests; due for every finished or preempted one."""
        self.state.forget(request_ids)

    # ------------------------------------------------------------ logits processing

    @torch.inference_mode()
    def _process_logits(
        self, raw: torch.Tensor, requests: Sequence[RequestView], grammar: BatchMask | None = None
    ) -> torch.Tensor:
        """Bias, the grammar mask, min_tokens and penalties; returns ``raw`` itself when no
        row uses any.

        ``raw`` is never written: logprobs are reported from it. The grammar mask comes
        after the bias (a bias never brings back a masked token: -inf + bias = -inf) and
        before every other stage; constrained rows get their min_tokens rule inside it.
        """
        bias = self._logit_bias_entries(requests)
        blocked = self._min_tokens_entries(requests)
        penalised = [i for i, r in enumerate(requests) if stages.has_penalties(r.sampling_params)]
        if bias is None and blocked is None and not penalised and grammar is None:
            return raw
        x = raw.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [num_rows, vocab]
        flat = x.view(-1)  # [num_rows * vocab]: entries are addressed as row * vocab + token id
        if bias is not None:
            cells, values = bias
            flat.index_add_(0, cells, values)
        if grammar is not None:
            every_row = len(grammar.rows) == x.shape[0]
            stages.apply_grammar(x, grammar, None if every_row else self._tensor(grammar.rows))
        if blocked is not None:
            flat.index_fill_(0, blocked, float("-inf"))
        if penalised:
            self._apply_penalties(x, requests, penalised)
        return x

    def _logit_bias_entries(self, requests: Sequence[RequestView]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat cells, values) of every row's logit_bias, or None; a cell is row * vocab + token id."""
        cells: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, r in enumerate(requests):
            if not r.sampling_params.logit_bias:
                continue
            entry = self.state.request_tensors(r)
            if entry.bias_cols is not None and entry.bias_values is not None:
                cells.append(entry.bias_cols + i * self.vocab_size)
                values.append(entry.bias_values)
        if not cells:
            return None
        return torch.cat(cells), torch.cat(values)

    def _min_tokens_entries(self, requests: Sequence[RequestView]) -> torch.Tensor | None:
        """Flat cells (row * vocab + token id) of EOS and stop tokens that may not be sampled yet, or None.

        EOS is left alone under ignore_eos (as in vLLM): it would not stop the request then.
        Constrained rows are left to the grammar stage, which holds these tokens back only
        where the grammar allows something else.
        """
        cells: list[torch.Tensor] = []
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.sampling_params.min_tokens and r.grammar is None:
                cols = self.state.request_tensors(r).min_tokens_cols
                if cols is not None:
                    cells.append(cols + i * self.vocab_size)
        return torch.cat(cells) if cells else None

    def _apply_penalties(self, x: torch.Tensor, requests: Sequence[RequestView], penalised: list[int]) -> None:
        """Repetition (HF: prompt + output tokens), presence and frequency (OpenAI: output only)."""
        reqs = [requests[i] for i in penalised]
        params = [r.sampling_params for r in reqs]
        rows = self._tensor(penalised)
        prompt_mask, output_counts = self.state.penalty_counts(reqs)  # [P, vocab] bool, float32
        sub = x[rows]  # [P, vocab]
        in_output = output_counts > 0  # [P, vocab]
        if any(p.repetition_penalty != 1.0 for p in params):
            penalty = self._column([p.repetition_penalty for p in params])  # [P, 1]
            sub = stages.repetition_penalty(sub, prompt_mask | in_output, penalty)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency = self._column([p.frequency_penalty for p in params])  # [P, 1]
            presence = self._column([p.presence_penalty for p in params])  # [P, 1]
            sub = stages.frequency_presence_penalties(sub, output_counts, in_output, frequency, presence)
        x[rows] = sub

    # --------------------------------------------------------------------- sampling

    def _sample_rows(
        self, x: torch.Tensor, requests: Sequence[RequestView], proposals: Sequence[Proposal | None]
    ) -> torch.Tensor:
        """``x`` [S, vocab] processed logits of the non-greedy rows -> token ids [S]."""
        probs = self.probabilities(x, requests)  # [S, vocab]
        token_ids = stages.exponential_race(probs, self._uniform_noise(requests, probs.shape), self.kernels)
        # A seeded row keeps the token its own generator draws (the same as without
        # drafts); a draft is then kept only where it equals that token.
        judged = [i for i, p in enumerate(proposals) if p is not None and requests[i].sampling_params.seed is None]
        if judged:
            rows = self._tensor(judged)
            chosen = [proposals[i] for i in judged]
            p, q = probs[rows], torch.stack([c.probs for c in chosen if c is not None])  # [n, vocab]
            accept_uniform = torch.empty(len(judged), device=self.device).uniform_(generator=self.generator)
            residual_uniform = torch.empty_like(p).uniform_(generator=self.generator)
            draft = self._tensor([c.token_id for c in chosen if c is not None])
            token_ids[rows] = stages.rejection_sample(p, q, draft, accept_uniform, residual_uniform)[0]
        return token_ids

    @torch.inference_mode()
    def probabilities(self, x: torch.Tensor, requests: Sequence[RequestView]) -> torch.Tensor:
        """``x`` [S, vocab] logits of non-greedy rows -> what each samples from [S, vocab]:
        temperature, top-k, top-p, softmax, min-p (a new tensor; ``x`` is not written)."""
        params = [r.sampling_params for r in requests]
        vocab = x.shape[-1]
        # Always a fresh tensor, so the in-place steps below never touch the caller's logits.
        x = x.float() / self._column([p.temperature for p in params])  # [S, vocab]

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab = off
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            x = self._top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)  # [S, vocab]
        if any(p.min_p > 0.0 for p in params):
            probs = stages.min_p_filter(probs, self._column([p.min_p for p in params]))  # min_p [S, 1]
        return probs

    @torch.inference_mode()
    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` [S, vocab] from the sampler's own generator: [S]."""
        return stages.exponential_race(probs, torch.empty_like(probs).uniform_(generator=self.generator), self.kernels)

    def _top_k_top_p(self, x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask ``x`` [S, vocab] in place to top-k, then top-p (vocab = no top-k). The
        threshold is found among each row's k_max best logits, k_max the largest k asked
        for, unless a row asks for top-p without top-k: only then is a full sort needed."""
        vocab = x.shape[-1]
        full_sort = any(p < 1.0 and k >= vocab for k, p in zip(top_k, top_p))
        k_max = None if full_sort else max(k for k in top_k if k < vocab)
        return stages.top_k_top_p(x, self._tensor(top_k), self._tensor(top_p, torch.float32), k_max)

    def _uniform_noise(self, requests: Sequence[RequestView], shape: torch.Size) -> torch.Tensor:
        """U[0, 1) draws [S, vocab] for the exponential race."""
        u = torch.empty(shape, dtype=torch.float32, device=self.device)  # [S, vocab]
        seeded = [(i, r) for i, r in enumerate(requests) if r.sampling_params.seed is not None]
        if len(seeded) < len(requests):
            u.uniform_(generator=self.generator)
        # A seeded row draws its noise alone, so its tokens do not depend on its neighbours.
        for i, r in seeded:
            u[i].uniform_(generator=self.state.seeded_generator(r))
        return u

    # --------------------------------------------------------------------- logprobs

    def _sampled_logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[RequestView]
    ) -> list[Logprob | None]:
        out: list[Logprob | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        nums = [requests[i].sampling_params.logprobs or 0 for i in rows]
        index = self._tensor(rows)
        entries = stages.logprob_entries(raw[index], token_ids[index], max(nums))
        for i, num, entry in zip(rows, nums, entries):
            entry.top = entry.top[:num]
            out[i] = entry
        return out

    # ---------------------------------------------------------------------- helpers

    def _tensor(self, values: list[int] | list[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return stages.to_device(values, dtype, self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        return self._tensor(values, torch.float32).unsqueeze(1)  # [rows, 1]
