"""What the sampler keeps per request between steps, in one place with one ``forget``.

    SamplerState
    ├── request tensors   logit_bias and min_tokens ids as device tensors, built once
    ├── token counts      prompt mask and output counts for the penalties, one pooled row each
    ├── generators        one torch.Generator per seeded request
    └── grammar masks     one matcher per constrained request (``model/structured/masks.py``)

Every entry is keyed by request id and remembers the ``RequestView`` it was built for: an
id reused by a new request (after the old one finished) gets fresh state, never its
predecessor's. ``forget`` is due for every finished or preempted request; a preempted one
rebuilds its state from its own tokens when it runs again, so forgetting never changes a
token it samples.

Tensors here are created and written under inference mode (the sampler's entry points
run under it): an inference tensor may not be written outside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine_svc.model.sample.sampler_stages import grow_rows, step_seed, to_device
from engine_svc.model.structured import BatchMask, GrammarMasks
from engine_svc.types import RequestView


@dataclass
class RequestTensors:
    """One request's id lists as device tensors (None where empty)."""

    owner: RequestView
    bias_cols: torch.Tensor | None  # [n] long: logit_bias token ids within the vocabulary
    bias_values: torch.Tensor | None  # [n] float32
    min_tokens_cols: torch.Tensor | None  # [m] long: stop ids (+ EOS unless ignore_eos), unique


@dataclass
class _CountSlot:
    slot: int  # the request's row in TokenCounts' pooled tensors
    num_counted: int  # output tokens already scattered into that row
    owner: RequestView


class TokenCounts:
    """Token statistics the penalties need, kept on the device across steps.

    Each penalised request owns one row (slot) of two pooled tensors. A step scatters in
    only the output tokens sampled since the previous call, for the whole batch at once,
    instead of rebuilding counts from token lists that grow every step and from prompts
    that can be thousands of tokens long.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [capacity, vocab]
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # [capacity, vocab]
        self._slots: dict[str, _CountSlot] = {}
        self._free_slots: list[int] = []

    def gather(self, requests: Sequence[RequestView]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring each request's row up to date; returns ([R, vocab] bool, [R, vocab] float32).

        A draft row (speculative decoding: ``RequestView.draft_base`` and
        ``draft_token_ids``) reads its request's row plus its drafts, added to the returned copy
        only: the pooled counts follow the request's own output tokens, so a rejected
        draft leaves nothing to roll back.
        """
        slots: list[int] = []
        fresh: list[int] = []
        prompt_rows: list[int] = []
        prompt_cols: list[int] = []
        out_rows: list[int] = []
        out_cols: list[int] = []
        draft_rows: list[int] = []
        draft_cols: list[int] = []
        for j, view in enumerate(requests):
            r = view.draft_base
            drafts = [t for t in view.draft_token_ids if 0 <= t < self.vocab_size]
            draft_rows += [j] * len(drafts)
            draft_cols += drafts
            entry = self._slots.get(r.request_id)
            if entry is None or entry.owner is not r:  # new, or the id now names another request
                if entry is not None:
                    self._free_slots.append(entry.slot)
                entry = self._slots[r.request_id] = _CountSlot(self._allocate(), 0, r)
                fresh.append(entry.slot)
                prompt = {t for t in r.prompt_token_ids if 0 <= t < self.vocab_size}
                prompt_rows += [entry.slot] * len(prompt)
                prompt_cols += prompt
            new_tokens = r.output_token_ids[entry.num_counted :]
            out_rows += [entry.slot] * len(new_tokens)
            out_cols += new_tokens
            entry.num_counted += len(new_tokens)
            slots.append(entry.slot)

        if fresh:  # a reused slot still holds its previous owner's statistics
            fresh_rows = to_device(fresh, torch.long, self.device)
            self.prompt_mask[fresh_rows] = False
            self.output_counts[fresh_rows] = 0.0
        if prompt_rows:
            cells = (to_device(prompt_rows, torch.long, self.device), to_device(prompt_cols, torch.long, self.device))
            self.prompt_mask[cells] = True
        if out_rows:
            cells = (to_device(out_rows, torch.long, self.device), to_device(out_cols, torch.long, self.device))
            ones = torch.ones(len(out_rows), dtype=torch.float32, device=self.device)
            self.output_counts.index_put_(cells, ones, accumulate=True)
        rows = to_device(slots, torch.long, self.device)
        counts = self.output_counts[rows]  # [R, vocab], a copy
        if draft_rows:
            cells = (to_device(draft_rows, torch.long, self.device), to_device(draft_cols, torch.long, self.device))
            counts.index_put_(
                cells, torch.ones(len(draft_rows), dtype=torch.float32, device=self.device), accumulate=True
            )
        return self.prompt_mask[rows], counts

    def forget(self, request_id: str) -> None:
        entry = self._slots.pop(request_id, None)
        if entry is not None:
            self._free_slots.append(entry.slot)

    def _allocate(self) -> int:
        if not self._free_slots:
            old = self.prompt_mask.shape[0]
            new = max(16, 2 * old)  # doubling: growth copies are rare
            self.prompt_mask = grow_rows(self.prompt_mask, new)
            self.output_counts = grow_rows(self.output_counts, new)
            self._free_slots = list(range(new - 1, old - 1, -1))
        return self._free_slots.pop()


class SamplerState:
    """Every request's sampler state; the sampler itself keeps none between calls."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.token_counts = TokenCounts(vocab_size, device)
        self.grammars = GrammarMasks(vocab_size, device)  # structured output
        self._tensors: dict[str, RequestTensors] = {}
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop everything held for these requests; unknown ids are ignored."""
        for request_id in request_ids:
            self._tensors.pop(request_id, None)
            self._generators.pop(request_id, None)
            self.token_counts.forget(request_id)
            self.grammars.forget(request_id)

    def request_tensors(self, request: RequestView) -> RequestTensors:
        """The request's logit_bias and min_tokens ids as tensors, built on first use.

        A request may carry thousands of stop token ids and bias entries; building them per
        step would cost every other request in the batch that much host time per token.
        A draft row's view shares its request's tensors (they do not depend on outputs).
        """
        request = request.draft_base
        entry = self._tensors.get(request.request_id)
        if entry is None or entry.owner is not request:  # new, or the id now names another request
            entry = self._tensors[request.request_id] = self._build_tensors(request)
        return entry

    def penalty_counts(self, requests: Sequence[RequestView]) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, vocab] bool prompt mask, [R, vocab] float32 output counts), one row per request."""
        return self.token_counts.gather(requests)

    def grammar_mask(self, requests: Sequence[RequestView]) -> BatchMask | None:
        """The constrained rows' allowed tokens; None when no row has a grammar."""
        return self.grammars.batch_mask(requests)

    def seeded_generator(self, request: RequestView) -> torch.Generator:
        """The request's generator, positioned for its next output token.

        It is re-seeded from (seed, number of output tokens) rather than left running, so
        the token at step t is the same whether or not the request was preempted (which
        drops its state through ``forget``) and recomputed in between.
        """
        seed = request.sampling_params.seed
        assert seed is not None, "only seeded rows have their own generator"
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = self._generators[request.request_id] = torch.Generator(device=self.device)
        generator.manual_seed(step_seed(seed, request.num_output_tokens))
        return generator

    def _build_tensors(self, r: RequestView) -> RequestTensors:
        params = r.sampling_params
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < self.vocab_size}
        blocked = set(params.stop_token_ids)
        if not params.ignore_eos:
            blocked.update(r.eos_token_ids)
        blocked_ids = sorted(t for t in blocked if 0 <= t < self.vocab_size)
        return RequestTensors(
            owner=r,
            bias_cols=to_device(list(bias), torch.long, self.device) if bias else None,
            bias_values=to_device(list(bias.values()), torch.float32, self.device) if bias else None,
            min_tokens_cols=to_device(blocked_ids, torch.long, self.device) if blocked_ids else None,
        )
