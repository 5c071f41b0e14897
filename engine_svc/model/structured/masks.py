"""The sampler's structured-output stage: one matcher per constrained request, one mask per batch.

    constrained rows ─▶ catch each matcher up with request.output_token_ids ─▶ fill_bitmasks
    (int32 [C, words], GIL released) ─▶ unpack to bool [C, vocab] ─▶ hold back EOS and stop
    tokens (min_tokens, ignore_eos) only where the grammar allows something else

A matcher follows the request's own output tokens rather than the sampler's choices, so
it is always in step with what the scheduler kept: after a preemption (``forget`` drops
the matcher) a fresh copy of the compiled grammar is fed every output token so far, about
a millisecond for 600 tokens. The request's sampled EOS is never fed: it ends the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_svc.model.structured.backend import CompiledGrammar, Matcher, fill_bitmasks
from engine_svc.types import ErrorCode, RequestError, RequestView


@dataclass
class BatchMask:
    """The constrained rows of one batch and the tokens each may take next."""

    rows: list[int]  # rows of the batch, ascending
    allowed: torch.Tensor  # [len(rows), vocab] bool, on the sampler's device
    errors: dict[str, RequestError] = field(default_factory=dict)  # by request id: the grammar failed


@dataclass
class _State:
    matcher: Matcher
    num_consumed: int  # output tokens fed to the matcher
    owner: RequestView  # a request id reused by a new request gets a new matcher


class GrammarMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[str, _State] = {}

    def batch_mask(self, requests: Sequence[RequestView]) -> BatchMask | None:
        """Masks for the rows whose request has a grammar; None when no row has one.

        A draft row (speculative decoding: ``RequestView.draft_base`` and
        ``draft_token_ids``, ``engine_svc/model/spec/verify.py``) is masked by its
        request's matcher advanced through the drafts before it: depth by depth, each
        matcher consumes one more draft and the rows at that depth are filled; then every
        matcher rolls back to the request's own output tokens.
        """
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        bases = [requests[i].draft_base for i in rows]
        grammars = [_compiled(b) for b in bases]
        matchers = [self._caught_up(b, g) for b, g in zip(bases, grammars)]
        depths = [len(requests[i].draft_token_ids) for i in rows]
        bitmask = np.zeros((len(rows), (grammars[0].vocab_size + 31) // 32), dtype=np.int32)
        # A request's first mask is its grammar's, computed at compile time, off this thread.
        fresh = {j for j, b in enumerate(bases) if depths[j] == 0 and self._states[b.request_id].num_consumed == 0}
        for j in fresh:
            bitmask[j] = grammars[j].first_mask
        errors = {}
        messages: dict[str, str] = {}
        for j, (i, m) in enumerate(zip(rows, matchers)):
            if depths[j] == 0 and (message := m.error()):
                # The row's token is dropped with the request; any token keeps the math finite.
                errors[requests[i].request_id] = RequestError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"the output constraint failed after {requests[i].num_output_tokens} tokens: {message.strip()}",
                    "sampling_params.constraint",
                )
                messages[requests[i].request_id] = message.strip()
        num_tried: dict[int, tuple[Matcher, int]] = {}  # id(matcher) -> (matcher, drafts consumed)
        for depth in range(max(depths) + 1):
            at_depth = [j for j, d in enumerate(depths) if d == depth and j not in fresh]
            for j in at_depth:
                m = matchers[j]
                if depth > 0 and num_tried.get(id(m), (m, 0))[1] < depth:
                    m.consume(requests[rows[j]].draft_token_ids[depth - 1 : depth])  # valid: cut before verification
                    num_tried[id(m)] = (m, depth)
            fill_bitmasks([(matchers[j], j) for j in at_depth], bitmask)
        for m, n in num_tried.values():
            m.rollback(n)
        for j, i in enumerate(rows):
            if (failure := messages.get(requests[i].request_id)) is not None:
                bitmask[j] = -1
                # Its tokens all came from its masks, so the grammar, not the output, is at
                # fault (a limit hit): later requests for it fail before they start.
                grammars[j].failure = grammars[j].failure or failure
        allowed = self._unpack(bitmask)  # [C, vocab]
        self._hold_back(allowed, [requests[i] for i in rows])
        return BatchMask(rows, allowed, errors)

    def num_valid_drafts(self, request: RequestView, draft_token_ids: Sequence[int]) -> int:
        """How many leading drafts ``request``'s grammar allows after its output tokens."""
        return self._caught_up(request, _compiled(request)).num_valid(draft_token_ids)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _caught_up(self, request: RequestView, grammar: CompiledGrammar) -> Matcher:
        state = self._states.get(request.request_id)
        if state is None or state.owner is not request:
            state = self._states[request.request_id] = _State(grammar.matcher(), 0, request)
        new_tokens = request.output_token_ids[state.num_consumed :]
        if new_tokens:
            state.matcher.consume(new_tokens)  # a refusal shows as matcher.error() after the fill
            state.num_consumed += len(new_tokens)
        return state.matcher

    def _unpack(self, bitmask: np.ndarray) -> torch.Tensor:
        """int32 [C, words] -> bool [C, vocab] on the device (bit i of word w = token 32w + i)."""
        if self.device.type == "cpu":
            unpacked = np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
            return torch.from_numpy(unpacked).view(torch.bool)
        # Ship the packed words (32x smaller) and unpack on the device.
        words = torch.from_numpy(bitmask).pin_memory().to(self.device, non_blocking=True)  # [C, words]
        shifts = torch.arange(32, dtype=torch.int32, device=self.device)
        bits = (words.unsqueeze(-1) >> shifts) & 1  # [C, words, 32]
        return bits.view(bitmask.shape[0], -1)[:, : self.vocab_size].bool()

    def _hold_back(self, allowed: torch.Tensor, requests: list[RequestView]) -> None:
        """min_tokens holds back EOS and stop tokens, ignore_eos holds back EOS, but neither
        may leave a row with nothing: where the grammar allows only held-back tokens (it
        is complete), they stay allowed and the grammar's end ends the request."""
        rows: list[int] = []
        cols: list[int] = []
        for j, r in enumerate(requests):
            params = r.sampling_params
            under_min = r.num_output_tokens < params.min_tokens
            held = list(params.stop_token_ids) if under_min else []
            if under_min or params.ignore_eos:
                held += r.eos_token_ids
            held = [t for t in held if 0 <= t < self.vocab_size]
            rows += [j] * len(held)
            cols += held
        if not rows:
            return
        index = (
            torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(cols, dtype=torch.long, device=self.device),
        )
        was_allowed = allowed[index]  # [E]
        allowed[index] = False
        has_other = allowed.any(dim=-1)  # [C]
        allowed[index] = was_allowed & ~has_other[index[0]]


def _compiled(request: RequestView) -> CompiledGrammar:
    grammar = request.grammar
    assert isinstance(grammar, CompiledGrammar), f"{request.request_id}: grammar is {type(grammar).__name__}"
    return grammar
