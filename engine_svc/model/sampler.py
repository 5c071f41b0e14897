"""Turns each request's last-position logits into its next token, vectorised over the batch.

    raw logits ─▶ logit_bias ─▶ grammar mask ─▶ min_tokens mask ─▶ penalties ─┬─▶ argmax        greedy rows
                                                     └─▶ ÷ temperature ─▶ top-k ─▶ top-p
                                                         ─▶ min-p ─▶ exponential race           sampled rows
    raw logits ─▶ log_softmax ─▶ chosen token's logprob and rank, top alternatives

Per-row parameters become tensors once per call, and a stage that no row uses costs
nothing (an all-greedy batch without penalties is one argmax). A request's logit_bias
and the ids min_tokens blocks become tensors once, when the request first comes
(``_RequestLists``): those lists may hold thousands of ids and are never scanned per step. The order and semantics
follow vLLM so results can be compared. Parameter tensors travel host -> device without
waiting, so the only host sync is reading the chosen tokens (and logprobs) back.

Entry points run under inference mode, so the state kept between calls (penalty counts)
is created and updated the same way whoever calls: an inference tensor may not be
written outside inference mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine_svc.model.structured import BatchMask, GrammarMasks
from engine_svc.types import Logprob, RequestError, RequestView, SamplingParams

# Below this temperature a row is sampled greedily, as vLLM does: dividing by a
# near-zero temperature overflows float32 to inf, and inf - inf in the softmax is NaN.
_SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]  # None where request.sampling_params.logprobs is None
    # Requests whose output constraint failed this step, by id: their token is not to be kept.
    errors: dict[str, RequestError] = field(default_factory=dict)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Noise for rows without a seed; public so tests and benchmarks can fix it.
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self._seeded_generators: dict[str, torch.Generator] = {}
        self._token_counts = _TokenCounts(vocab_size, self.device)
        self._lists = _RequestLists(vocab_size, self.device)
        self.grammars = GrammarMasks(vocab_size, self.device)  # structured output

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[RequestView]) -> SamplerOutput:
        """``logits`` [num_rows, >= vocab]: one row per request, in the order of ``requests``."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        if not requests:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw = logits[:, : self.vocab_size]  # [num_rows, vocab]; padding columns dropped
        grammar = self.grammars.batch_mask(requests)  # None when no row is constrained
        x = self._process_logits(raw, requests, grammar)  # [num_rows, vocab]

        sampled_rows = [i for i, r in enumerate(requests) if not _is_greedy(r.sampling_params)]
        if not sampled_rows:
            token_ids = x.argmax(dim=-1)  # [num_rows]
        elif len(sampled_rows) == len(requests):
            token_ids = self._sample_rows(x, requests)
        else:
            rows = self._tensor(sampled_rows)
            token_ids = x.argmax(dim=-1)
            token_ids[rows] = self._sample_rows(x[rows], [requests[i] for i in sampled_rows])

        logprobs = self._sampled_logprobs(raw, token_ids, requests)
        errors = grammar.errors if grammar is not None else {}
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, errors=errors)

    @torch.inference_mode()
    def prompt_logprobs(self, logits: torch.Tensor, target_token_ids: list[int], num_top: int) -> list[Logprob]:
        """``logits`` [n, >= vocab]: row j predicts ``target_token_ids[j]``. The caller bounds
        n (the runner computes prompt logits in chunks of ``PROMPT_LOGITS_CHUNK`` rows)."""
        targets = self._tensor(target_token_ids)  # [n]
        return self._logprob_entries(logits[:, : self.vocab_size], targets, num_top)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop state held for these requests; due for every finished or preempted one."""
        for request_id in request_ids:
            self._seeded_generators.pop(request_id, None)
            self._token_counts.forget(request_id)
            self._lists.forget(request_id)
            self.grammars.forget(request_id)

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
        penalised = [i for i, r in enumerate(requests) if _has_penalties(r.sampling_params)]
        if bias is None and blocked is None and not penalised and grammar is None:
            return raw
        x = raw.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [num_rows, vocab]
        flat = x.view(-1)  # [num_rows * vocab]: entries are addressed as row * vocab + token id
        if bias is not None:
            cells, values = bias
            flat.index_add_(0, cells, values)
        if grammar is not None:
            _apply_grammar(x, grammar, self._tensor)
        if blocked is not None:
            flat.index_fill_(0, blocked, float("-inf"))
        if penalised:
            self._apply_penalties(x, requests, penalised)
        return x

    def _logit_bias_entries(self, requests: Sequence[RequestView]):
        """(flat cells, values) of every row's logit_bias, or None; a cell is row * vocab + token id."""
        cells, values = [], []
        for i, r in enumerate(requests):
            if not r.sampling_params.logit_bias:
                continue
            entry = self._lists.get(r)
            if entry.bias_cols is not None and entry.bias_values is not None:
                cells.append(entry.bias_cols + i * self.vocab_size)
                values.append(entry.bias_values)
        if not cells:
            return None
        return torch.cat(cells), torch.cat(values)

    def _min_tokens_entries(self, requests: Sequence[RequestView]):
        """Flat cells (row * vocab + token id) of EOS and stop tokens that may not be sampled yet, or None.

        EOS is left alone under ignore_eos (as in vLLM): it would not stop the request then.
        Constrained rows are left to the grammar stage, which holds these tokens back only
        where the grammar allows something else.
        """
        cells = []
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.sampling_params.min_tokens and r.grammar is None:
                cols = self._lists.get(r).min_tokens_cols
                if cols is not None:
                    cells.append(cols + i * self.vocab_size)
        return torch.cat(cells) if cells else None

    def _apply_penalties(self, x: torch.Tensor, requests: Sequence[RequestView], penalised: list[int]) -> None:
        """Repetition (HF: prompt + output tokens), presence and frequency (OpenAI: output only)."""
        reqs = [requests[i] for i in penalised]
        params = [r.sampling_params for r in reqs]
        rows = self._tensor(penalised)
        prompt_mask, output_counts = self._token_counts.gather(reqs)  # [P, vocab] bool, float32
        sub = x[rows]  # [P, vocab]
        in_output = output_counts > 0  # [P, vocab]
        if any(p.repetition_penalty != 1.0 for p in params):
            penalty = self._column([p.repetition_penalty for p in params])  # [P, 1]
            penalised_logits = torch.where(sub > 0, sub / penalty, sub * penalty)
            sub = torch.where(prompt_mask | in_output, penalised_logits, sub)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency = self._column([p.frequency_penalty for p in params])  # [P, 1]
            presence = self._column([p.presence_penalty for p in params])  # [P, 1]
            sub = sub - frequency * output_counts - presence * in_output
        x[rows] = sub

    # --------------------------------------------------------------------- sampling

    def _sample_rows(self, x: torch.Tensor, requests: Sequence[RequestView]) -> torch.Tensor:
        """``x`` [S, vocab] processed logits of the non-greedy rows -> token ids [S]."""
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
            min_p = self._column([p.min_p for p in params])  # [S, 1]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)

        # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) picks i with probability
        # p_i, with no cumsum and no host sync, so it vectorises across rows.
        q = self._exponential_noise(requests, probs.shape)  # [S, vocab]
        return (probs / q).argmax(dim=-1)

    def _top_k_top_p(self, x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask ``x`` [S, vocab] in place to top-k, then top-p of the renormalised rest (vLLM order).

        Both keep every logit at or above a per-row threshold, found among each row's n best
        logits. n is the largest k asked for, unless a row asks for top-p without top-k: only
        then is a full sort needed.
        """
        vocab = x.shape[-1]
        full_sort = any(p < 1.0 and k >= vocab for k, p in zip(top_k, top_p))
        if full_sort:
            best = x.sort(dim=-1, descending=True).values  # [S, vocab]
        else:
            best = x.topk(max(k for k in top_k if k < vocab), dim=-1).values  # [S, k_max]
        threshold = _truncation_threshold(best, self._tensor(top_k), self._tensor(top_p, torch.float32), vocab)
        return x.masked_fill_(x < threshold, float("-inf"))

    def _exponential_noise(self, requests: Sequence[RequestView], shape: torch.Size) -> torch.Tensor:
        """Exp(1) draws [S, vocab] as -log(u), u ~ U[0, 1): several times faster than
        ``exponential_`` on CPU. u = 0 gives q = inf, which only rules that token out
        (p / inf = 0); u < 1 keeps q > 0, so p / q is never 0 / 0 = NaN."""
        u = torch.empty(shape, dtype=torch.float32, device=self.device)  # [S, vocab]
        seeded = [(i, r) for i, r in enumerate(requests) if r.sampling_params.seed is not None]
        if len(seeded) < len(requests):
            u.uniform_(generator=self.generator)
        # A seeded row draws its noise alone, so its tokens do not depend on its neighbours.
        for i, r in seeded:
            u[i].uniform_(generator=self._seeded_generator(r))
        return u.log_().neg_()

    def _seeded_generator(self, request: RequestView) -> torch.Generator:
        """The request's generator, positioned for its next output token.

        It is re-seeded from (seed, number of output tokens) rather than left running, so
        the token at step t is the same whether or not the request was preempted (which
        drops its state through ``forget``) and recomputed in between.
        """
        generator = self._seeded_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            self._seeded_generators[request.request_id] = generator
        seed = request.sampling_params.seed
        assert seed is not None, "only seeded rows have their own generator"
        generator.manual_seed(_step_seed(seed, request.num_output_tokens))
        return generator

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
        entries = self._logprob_entries(raw[index], token_ids[index], max(nums))
        for i, num, entry in zip(rows, nums, entries):
            entry.top = entry.top[:num]
            out[i] = entry
        return out

    def _logprob_entries(self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[Logprob]:
        """``logits`` [n, vocab] raw, ``token_ids`` [n] -> one Logprob per row."""
        if logits.shape[0] == 0:
            return []
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]; ties share the better rank
        num_top = max(0, min(num_top, logprobs.shape[-1]))
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [n, num_top]
        return [
            Logprob(token_id=t, logprob=lp, rank=rank, top=list(zip(ids, lps)))
            for t, lp, rank, ids, lps in zip(
                token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_logprobs.tolist()
            )
        ]

    # ---------------------------------------------------------------------- helpers

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return _to_device(values, dtype, self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        return self._tensor(values, torch.float32).unsqueeze(1)  # [rows, 1]


@dataclass
class _Lists:
    """One request's id lists as device tensors (None where empty)."""

    owner: RequestView
    bias_cols: torch.Tensor | None  # [n] long: logit_bias token ids within the vocabulary
    bias_values: torch.Tensor | None  # [n] float32
    min_tokens_cols: torch.Tensor | None  # [m] long: stop ids (+ EOS unless ignore_eos), unique


class _RequestLists:
    """Each request's logit_bias and min_tokens ids, turned into tensors once.

    A request may carry thousands of stop token ids and bias entries; building them per
    step would cost every other request in the batch that much host time per token.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._lists: dict[str, _Lists] = {}

    def get(self, r: RequestView) -> _Lists:
        entry = self._lists.get(r.request_id)
        if entry is None or entry.owner is not r:  # new, or the id now names another request
            entry = self._lists[r.request_id] = self._build(r)
        return entry

    def forget(self, request_id: str) -> None:
        self._lists.pop(request_id, None)

    def _build(self, r: RequestView) -> _Lists:
        params = r.sampling_params
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < self.vocab_size}
        blocked = set(params.stop_token_ids)
        if not params.ignore_eos:
            blocked.update(r.eos_token_ids)
        blocked_ids = sorted(t for t in blocked if 0 <= t < self.vocab_size)
        return _Lists(
            owner=r,
            bias_cols=_to_device(list(bias), torch.long, self.device) if bias else None,
            bias_values=_to_device(list(bias.values()), torch.float32, self.device) if bias else None,
            min_tokens_cols=_to_device(blocked_ids, torch.long, self.device) if blocked_ids else None,
        )


class _TokenCounts:
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
        # request_id -> [slot, number of output tokens already counted, owning RequestView]
        self._slots: dict[str, list] = {}
        self._free_slots: list[int] = []

    def gather(self, requests: Sequence[RequestView]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring each request's row up to date; returns ([R, vocab] bool, [R, vocab] float32)."""
        slots: list[int] = []
        fresh: list[int] = []
        prompt_rows: list[int] = []
        prompt_cols: list[int] = []
        out_rows: list[int] = []
        out_cols: list[int] = []
        for r in requests:
            entry = self._slots.get(r.request_id)
            if entry is None or entry[2] is not r:  # new, or the id now names another request
                if entry is not None:
                    self._free_slots.append(entry[0])
                entry = self._slots[r.request_id] = [self._allocate(), 0, r]
                fresh.append(entry[0])
                prompt = {t for t in r.prompt_token_ids if 0 <= t < self.vocab_size}
                prompt_rows += [entry[0]] * len(prompt)
                prompt_cols += prompt
            new_tokens = r.output_token_ids[entry[1] :]
            out_rows += [entry[0]] * len(new_tokens)
            out_cols += new_tokens
            entry[1] += len(new_tokens)
            slots.append(entry[0])

        if fresh:  # a reused slot still holds its previous owner's statistics
            fresh_rows = _to_device(fresh, torch.long, self.device)
            self.prompt_mask[fresh_rows] = False
            self.output_counts[fresh_rows] = 0.0
        if prompt_rows:
            cells = (_to_device(prompt_rows, torch.long, self.device), _to_device(prompt_cols, torch.long, self.device))
            self.prompt_mask[cells] = True
        if out_rows:
            cells = (_to_device(out_rows, torch.long, self.device), _to_device(out_cols, torch.long, self.device))
            ones = torch.ones(len(out_rows), dtype=torch.float32, device=self.device)
            self.output_counts.index_put_(cells, ones, accumulate=True)
        rows = _to_device(slots, torch.long, self.device)
        return self.prompt_mask[rows], self.output_counts[rows]

    def forget(self, request_id: str) -> None:
        entry = self._slots.pop(request_id, None)
        if entry is not None:
            self._free_slots.append(entry[0])

    def _allocate(self) -> int:
        if not self._free_slots:
            old = self.prompt_mask.shape[0]
            new = max(16, 2 * old)  # doubling: growth copies are rare
            self.prompt_mask = _grow(self.prompt_mask, new)
            self.output_counts = _grow(self.output_counts, new)
            self._free_slots = list(range(new - 1, old - 1, -1))
        return self._free_slots.pop()


# ----------------------------------------------------------------- tensor functions


def _truncation_threshold(best: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """Smallest logit that top-k then top-p keep, per row: [S, 1].

    ``best`` [S, n] holds each row's n best logits, descending, with n >= every k asked
    for; ``top_k`` [S] (vocab = off); ``top_p`` [S]. A row without either keeps everything.
    """
    k = top_k.unsqueeze(1)  # [S, 1]
    p = top_p.unsqueeze(1)  # [S, 1]
    position = torch.arange(best.shape[-1], device=best.device)  # [n]
    in_top_k = position < k  # [S, n]; logits tied with the k-th survive the caller's compare
    best = best.masked_fill(~in_top_k, float("-inf"))
    probs = best.softmax(dim=-1)  # [S, n]: renormalised over the top k
    # vLLM drops the low tail whose mass is <= 1 - p, i.e. keeps a token while the mass of
    # the better ones is < p. Rows at p = 1 skip the test: float rounding in the cumulative
    # sum could otherwise cut their tail. The best token always stays.
    mass_above = probs.cumsum(dim=-1) - probs  # [S, n]
    keep = in_top_k & ((mass_above < p) | (p >= 1.0))
    keep[:, 0] = True
    threshold = best.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)  # [S, 1]
    return threshold.masked_fill((k >= vocab) & (p >= 1.0), float("-inf"))


def _apply_grammar(x: torch.Tensor, grammar: BatchMask, to_tensor) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place (``x`` [num_rows, vocab])."""
    if len(grammar.rows) == x.shape[0]:
        x.masked_fill_(~grammar.allowed, float("-inf"))
        return
    rows = to_tensor(grammar.rows)
    x[rows] = x[rows].masked_fill(~grammar.allowed, float("-inf"))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # Pinned + non_blocking: a pageable copy would wait for the queued forward pass.
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _grow(t: torch.Tensor, rows: int) -> torch.Tensor:
    grown = torch.zeros(rows, t.shape[1], dtype=t.dtype, device=t.device)
    grown[: t.shape[0]] = t
    return grown


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _step_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, output position); splitmix64 finaliser,
    so neighbouring seeds and steps give unrelated streams."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
