"""Which rows of a step's flattened batch need logits, and for what.

    logits_rows(batch) -> (sample rows, their requests, prompt-logprob jobs)

A request's chunk of ``n`` rows starts at batch row ``row`` and position ``start``. The
last row samples when the chunk reaches the request's end (``needs_sample``); the row at
position ``p`` also predicts prompt token ``p + 1``, so a request asking for prompt
logprobs owes one entry per prompt position not yet reported, up to the last prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_svc.outputs import ScheduledRequest
from engine_svc.types import RequestView


@dataclass
class PromptLogprobJob:
    request_id: str
    rows: list[int]  # rows of the flattened batch; row for position p predicts prompt token p + 1
    target_token_ids: list[int]
    num_top: int


def logits_rows(batch: list[ScheduledRequest]) -> tuple[list[int], list[RequestView], list[PromptLogprobJob]]:
    """Rows of the flattened batch that need logits: (sample rows, their requests, prompt-logprob jobs).

    Prompt tokens up to ``num_prompt_logprobs_done`` were reported already (e.g. before a
    preemption), so only later ones get entries.
    """
    sample_rows: list[int] = []
    sample_requests: list[RequestView] = []
    jobs: list[PromptLogprobJob] = []
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
                jobs.append(PromptLogprobJob(request.request_id, rows, targets, num_top))
        row += s.num_scheduled_tokens  # draft rows follow; engine_svc/model/spec/ picks them
    return sample_rows, sample_requests, jobs
