"""Verification of draft tokens: one sampler call over every row that needs a token.

    request with drafts d0..d(k-1), its last real token t at position p:

    rows      p       p+1     ...   p+k          (computed in this step, causal)
    input     t       d0      ...   d(k-1)
    view      out     out+d0  ...   out+d0..d(k-1)   (output tokens the sampler sees)
    sampled   s0      s1      ...   sk
    accept    s0 == d0, s1 == d1, ... while equal; emit s0..sa (a = accepted drafts)

Row j is sampled as the request's next token would be after drafts d0..d(j-1): its
``PositionView`` shows them as output tokens, so min_tokens, seeded generators (re-seeded
from the output position), logit_bias, temperature, top-k/p and min-p act on each row as
they would without speculation. Accepting while the sampled token equals the draft is
rejection sampling for a one-hot draft (Leviathan et al.): draft d is accepted with
probability p(d), and on rejection the token is drawn from p with d excluded, which is
norm(max(p - onehot(d), 0)). Every emitted token is therefore distributed (and, for a
greedy or seeded row, chosen) exactly as without drafts; the token after the last
accepted draft is the normal sampler's. A draft model's draft at an unseeded sampled row
comes with q, the distribution it was drawn from (a ``Proposal``): the sampler keeps it
with probability min(1, p/q) and otherwise draws from norm(max(p - q, 0)), a token that
is never the draft, so "accept while equal" reads the outcome the same way. Logprobs come from each row's raw logits, as
without drafts. A constrained request's drafts are cut where its grammar forbids one, and
its draft rows are masked by its matcher advanced through the drafts before them
(``model/structured/masks.py``), which then rolls back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_svc.model.sample.sampler import Proposal, SamplerOutput
from engine_svc.outputs import ModelRunnerOutput, ScheduledRequest
from engine_svc.types import Logprob, RequestView, SamplingParams


class PositionView:
    """``request`` as the sampler sees it at a draft row: ``draft_token_ids`` appended
    to its output tokens. Read-only, like every ``RequestView``; the joined token lists
    are built on first use only (most rows never read them) and kept."""

    __slots__ = ("_request", "_drafts", "_output", "_all")

    def __init__(self, request: RequestView, draft_token_ids: Sequence[int]) -> None:
        self._request = request
        self._drafts = draft_token_ids
        self._output: list[int] | None = None
        self._all: list[int] | None = None

    @property
    def draft_base(self) -> RequestView:
        """The request this row belongs to (the grammar stage advances its matcher)."""
        return self._request

    @property
    def draft_token_ids(self) -> Sequence[int]:
        """The drafts before this row."""
        return self._drafts

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._request.prompt_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        if self._output is None:
            self._output = [*self._request.output_token_ids, *self._drafts]
        return self._output

    @property
    def all_token_ids(self) -> Sequence[int]:
        if self._all is None:
            self._all = [*self._request.all_token_ids, *self._drafts]
        return self._all

    @property
    def sampling_params(self) -> SamplingParams:
        return self._request.sampling_params

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._request.eos_token_ids

    @property
    def grammar(self) -> object | None:
        return self._request.grammar

    @property
    def lora_slot(self) -> int | None:
        return self._request.lora_slot

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens + len(self._drafts)

    @property
    def num_prompt_logprobs_done(self) -> int:
        return self._request.num_prompt_logprobs_done

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens + len(self._drafts)

    @property
    def num_prompt_tokens(self) -> int:
        return self._request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._request.num_output_tokens + len(self._drafts)


@dataclass
class _Group:
    request: RequestView
    first: int  # index of its first row in VerifyRows.rows
    draft_token_ids: list[int]  # the ones verified: an output constraint may have cut some
    num_scheduled_drafts: int


@dataclass
class VerifyRows:
    """The rows to sample this step, with the view each is sampled under, and the
    requests they belong to (one row each, 1 + k for a request with k drafts)."""

    rows: list[int]
    views: list[RequestView]
    groups: list[_Group]
    proposals: list[Proposal | None] | None = None  # one per row where a draft model drew drafts

    @classmethod
    def of(
        cls,
        batch: list[ScheduledRequest],
        sample_rows: list[int],
        sample_requests: list[RequestView],
        num_valid_drafts: Callable[[RequestView, list[int]], int],
        proposals: dict[str, list[Proposal]] | None = None,
    ) -> VerifyRows:
        """``sample_rows``/``sample_requests`` from ``logits_rows`` (one row per request
        that samples: its last real row; its drafts' rows follow it in the batch).

        A constrained request's drafts are cut at the first one its grammar forbids
        (``num_valid_drafts``): the rows after it are computed but never sampled, and
        count as rejected. ``proposals``: a draft model's drafts with their q, by request.
        """
        drafts = {s.request.request_id: s.draft_token_ids for s in batch if s.draft_token_ids}
        rows: list[int] = []
        views: list[RequestView] = []
        groups: list[_Group] = []
        row_proposals: list[Proposal | None] = []
        for row, request in zip(sample_rows, sample_requests):
            scheduled = drafts.get(request.request_id, [])
            draft_token_ids = scheduled
            if draft_token_ids and request.grammar is not None:
                draft_token_ids = draft_token_ids[: num_valid_drafts(request, draft_token_ids)]
            groups.append(_Group(request, len(rows), draft_token_ids, len(scheduled)))
            rows.append(row)
            views.append(request)
            for j in range(1, len(draft_token_ids) + 1):
                rows.append(row + j)
                views.append(PositionView(request, draft_token_ids[:j]))
            # Row j (0 .. k-1) judges draft j; the row after the last draft has none.
            drawn = (proposals or {}).get(request.request_id, [])[: len(draft_token_ids)]
            row_proposals += [*drawn, *[None] * (1 + len(draft_token_ids) - len(drawn))]
        return cls(rows, views, groups, row_proposals if proposals else None)

    def accept(self, sampled: SamplerOutput, output: ModelRunnerOutput) -> None:
        """Fill ``output`` from the sampled rows: per request, the drafts accepted (while
        each row's token equals the draft it judges) and the token after them."""
        for g in self.groups:
            request_id, drafts = g.request.request_id, g.draft_token_ids
            token_ids = sampled.token_ids[g.first : g.first + 1 + len(drafts)]
            num_accepted = 0
            while num_accepted < len(drafts) and token_ids[num_accepted] == drafts[num_accepted]:
                num_accepted += 1
            output.sampled_token_ids[request_id] = token_ids[: num_accepted + 1]
            logprobs = sampled.logprobs[g.first : g.first + num_accepted + 1]
            kept: list[Logprob] = [lp for lp in logprobs if lp is not None]
            if kept:
                output.logprobs[request_id] = kept
            if g.num_scheduled_drafts:
                output.num_verified_drafts[request_id] = len(drafts)
