"""The sampler's stages as pure tensor functions: no request, no state, no host sync.

Each takes the batch's logits (or probabilities) and per-row parameters already on the
device, and returns or writes the result; ``engine_svc/model/sample/sampler.py`` decides which
stages a batch needs and in what order. Row parameters are tensors shaped [rows] or
[rows, 1] so they broadcast against [rows, vocab].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_svc.model.structured import BatchMask
from engine_svc.types import Logprob, SamplingParams

if TYPE_CHECKING:
    from engine_svc.model.native import NativeKernels

# Below this temperature a row is sampled greedily, as vLLM does: dividing by a
# near-zero temperature overflows float32 to inf, and inf - inf in the softmax is NaN.
SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < SAMPLING_EPS


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def apply_grammar(x: torch.Tensor, grammar: BatchMask, rows: torch.Tensor | None) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place (``x`` [num_rows, vocab]).

    ``rows`` [C] are the constrained rows (``grammar.rows`` on the device), or None when
    every row is constrained.
    """
    if rows is None:
        x.masked_fill_(~grammar.allowed, float("-inf"))
        return
    x[rows] = x[rows].masked_fill(~grammar.allowed, float("-inf"))


def repetition_penalty(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule on ``x`` [P, vocab]: a seen token's positive logit is divided by the
    penalty, a negative one multiplied; ``seen`` [P, vocab] bool, ``penalty`` [P, 1]."""
    penalised = torch.where(x > 0, x / penalty, x * penalty)
    return torch.where(seen, penalised, x)


def frequency_presence_penalties(
    x: torch.Tensor,
    output_counts: torch.Tensor,
    in_output: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's rule on ``x`` [P, vocab], over output tokens only: minus frequency x count,
    minus presence once a token has appeared. ``output_counts`` [P, vocab] float32,
    ``in_output`` [P, vocab] bool (count > 0), ``frequency`` and ``presence`` [P, 1]."""
    return x - frequency * output_counts - presence * in_output


def top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_max: int | None) -> torch.Tensor:
    """Mask ``x`` [S, vocab] in place to top-k, then top-p of the renormalised rest (vLLM order).

    ``top_k`` [S] long (vocab = off), ``top_p`` [S] float32. Both keep every logit at or
    above a per-row threshold, found among each row's ``k_max`` best logits; ``k_max`` is
    None when a row asks for top-p without top-k, and only then is a full sort needed.
    """
    vocab = x.shape[-1]
    if k_max is None:
        best = x.sort(dim=-1, descending=True).values  # [S, vocab]
    else:
        best = x.topk(k_max, dim=-1).values  # [S, k_max]
    threshold = truncation_threshold(best, top_k, top_p, vocab)
    return x.masked_fill_(x < threshold, float("-inf"))


def truncation_threshold(best: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
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


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens of ``probs`` [S, vocab] below min_p [S, 1] times their row's best."""
    return probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)


def argmax_rows(x: torch.Tensor, kernels: NativeKernels | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first maximum of each row (a NaN counts as the maximum).
    With native kernels, float32 rows on CPU go to ``tk_argmax_rows`` (the same indices:
    37 rows of 49,152 in 0.1-0.2 ms, where torch's reduction took ~1 ms on two Zen 5
    threads); else computed by ``max``, whose reduction is faster than ``argmax``'s."""
    if kernels is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
        if x.shape[0] > 0 and x.shape[1] > 0 and x.stride(1) == 1:
            return kernels.argmax_rows(x)
    return x.max(dim=-1).indices


def exponential_race(probs: torch.Tensor, uniform: torch.Tensor, kernels: NativeKernels | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [S, vocab], drawn with probability p_i: [S].

    argmax(p_i / q_i) with q_i ~ Exp(1) picks i with probability p_i, with no cumsum and
    no host sync, so it vectorises across rows. ``uniform`` [S, vocab] holds u ~ U[0, 1)
    and is overwritten with q = -log(u): several times faster than ``exponential_`` on
    CPU. u = 0 gives q = inf, which only rules that token out (p / inf = 0); u < 1 keeps
    q > 0, so p / q is never 0 / 0 = NaN.
    """
    q = uniform.log_().neg_()
    return argmax_rows(probs / q, kernels)


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, accept_uniform: torch.Tensor, residual_uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s rule, per row: keep ``draft`` [n] (drawn from ``q`` [n, vocab])
    with probability min(1, p(draft) / q(draft)), else draw from norm(max(p - q, 0)); the
    result is distributed as ``p`` [n, vocab]. ``accept_uniform`` [n] and
    ``residual_uniform`` [n, vocab] (overwritten) are U[0, 1) draws. Returns (tokens [n],
    whether the draft was kept [n]). A rejected draft has p < q there, so the residual
    never draws it again; where p - q has no mass left (p = q), the draft is always kept.
    """
    p_draft = p.gather(1, draft.unsqueeze(1)).squeeze(1)  # [n]
    q_draft = q.gather(1, draft.unsqueeze(1)).squeeze(1)  # [n]
    kept = accept_uniform * q_draft < p_draft  # u < p / q, without dividing by q
    residual = (p - q).clamp_min_(0.0)  # [n, vocab]; the race needs no normalising
    resampled = exponential_race(residual, residual_uniform)
    return torch.where(kept, draft, resampled), kept


def logprob_entries(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[Logprob]:
    """``logits`` [n, vocab] raw, ``token_ids`` [n] -> one Logprob per row."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]; ties share the better rank
    num_top = max(0, min(num_top, logprobs.shape[-1]))
    top_logprobs, top_ids = _top(logprobs, num_top)  # [n, num_top]
    return [
        Logprob(token_id=t, logprob=lp, rank=rank, top=list(zip(ids, lps)))
        for t, lp, rank, ids, lps in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_logprobs.tolist()
        )
    ]


def _top(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row, best first, equal values in token-id order (a NaN counts as
    the best): greedy sampling takes the first maximum (``argmax_rows``), so a row's chosen
    token heads its list even where logits tie (bfloat16 logits often do), which ``topk``'s
    own order among ties does not promise."""
    if k == 0:
        return logprobs[:, :0], torch.zeros(logprobs.shape[0], 0, dtype=torch.long, device=logprobs.device)
    key = torch.where(torch.isnan(logprobs), torch.inf, logprobs)
    edge = key.topk(k, dim=-1).values[:, -1:]  # [n, 1]: the k-th best value
    above, at = key > edge, key == edge
    room = k - above.sum(dim=-1, keepdim=True)  # places left for values equal to the edge
    keep = above | (at & (at.cumsum(dim=-1) <= room))  # the lowest ids among the equal ones
    ids = keep.nonzero()[:, 1].view(-1, k)  # [n, k], ascending ids
    order = key.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices  # ties keep id order
    ids = ids.gather(1, order)
    return logprobs.gather(1, ids), ids


def step_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, output position); splitmix64 finaliser,
    so neighbouring seeds and steps give unrelated streams."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # Pinned + non_blocking: a pageable copy would wait for the queued forward pass.
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def grow_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of ``t`` [n, cols] with zero rows appended up to [rows, cols]."""
    grown = torch.zeros(rows, t.shape[1], dtype=t.dtype, device=t.device)
    grown[: t.shape[0]] = t
    return grown
