"""How a request's draft rows attend: each as a decode row of its own.

    request with drafts d0..d(k-1), last real token t at position p, block table T:

    batch rows        t       d0      ...   d(k-1)
    attention rows    (p, 1)  (p+1, 1) ...  (p+k, 1)      (start, query_len), table T each

Every row's K/V is in the cache before attention runs (``write_kv`` comes first), so row
``p + j`` attends to positions ``0 .. p + j`` exactly as it would decoding alone: the
same kernel, the same context, the same result as without drafts. (The prefill kernel
would give the same bits, the kernels sharing a row's arithmetic, native/attention_row.h,
but it is built for long chunks and pays its set-up per request and head, which a handful
of rows do not repay.)
"""

from __future__ import annotations

from engine_svc.outputs import ScheduledRequest


def attention_rows(batch: list[ScheduledRequest]) -> tuple[list[int], list[int], list[list[int]]]:
    """(query_lens, starts, block tables) of the attention layout for ``batch`` (flattened
    in batch order): a request with drafts becomes 1 + k single-row entries on its table."""
    query_lens: list[int] = []
    starts: list[int] = []
    tables: list[list[int]] = []
    for s in batch:
        if s.draft_token_ids:
            n = s.num_scheduled_tokens  # its one real token and the drafts
            query_lens += [1] * n
            starts += range(s.start, s.start + n)
            tables += [s.block_ids] * n
        else:
            query_lens.append(s.num_scheduled_tokens)
            starts.append(s.start)
            tables.append(s.block_ids)
    return query_lens, starts, tables
