"""StreamBacklog: bounded messages, merges that never touch the engine's outputs, prefix-cache
events before outputs, pause and resume.

Every message a take() yields is serialized with the servicer's own conversion
(``service/convert.py``) and measured, so the size bound is checked on real protobuf.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_svc.outputs import EngineOutput, EngineStats, RejectedAdd
from engine_svc.service.backlog import MESSAGE_OVERHEAD_BYTES, Batch, StreamBacklog, output_bytes
from engine_svc.service.convert import batch_to_proto
from engine_svc.types import ErrorCode, FinishReason, Logprob, RequestError
from tandem_common.kv_events import BlocksRemoved, BlocksStored

STATS = EngineStats(num_running=2**31 - 1, num_waiting=2**31 - 1, kv_cache_usage=1.0, draining=True)
MIB = 1 << 20


def logprob(token_id: int, num_top: int) -> Logprob:
    return Logprob(token_id, -1.5, 2**31 - 1, [(2**31 - 1 - i, -2.5) for i in range(num_top)])


def output(request_id: str, tokens: list[int], *, num_top: int | None = None, finish=None, **kw) -> EngineOutput:
    logprobs = [logprob(t, num_top) for t in tokens] if num_top is not None else []
    return EngineOutput(request_id, list(tokens), logprobs=logprobs, finish_reason=finish, **kw)


def drain(backlog: StreamBacklog) -> list[Batch]:
    """Take until a take hands out nothing; the batches that carried something."""
    batches = []
    while True:
        batch = backlog.take()
        if not (batch.outputs or batch.rejected or batch.kv_events):
            return batches
        batches.append(batch)


# -- every message fits the bound ------------------------------------------------------------

pieces = st.lists(
    st.tuples(
        st.integers(0, 5),  # which request
        st.integers(0, 300),  # new tokens
        st.one_of(st.none(), st.integers(0, 20)),  # logprobs with this many alternatives
        st.integers(0, 200),  # prompt logprobs
        st.booleans(),  # finishes (with an error)
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=pieces, max_message_bytes=st.sampled_from([64 << 10, 100 << 10, MIB]), max_outputs=st.integers(1, 8))
def test_every_message_fits_its_bound_and_nothing_is_lost(pieces, max_message_bytes, max_outputs):
    backlog = StreamBacklog(max_message_bytes=max_message_bytes, max_outputs=max_outputs, pause_bytes=1 << 40)
    sent: dict[str, list[int]] = {}
    sent_prompt: dict[str, int] = {}
    finished: set[str] = set()
    num_tops: dict[str, int | None] = {}
    next_token = 0
    for which, num_tokens, num_top, num_prompt, finishes in pieces:
        request_id = f"r{which}-" + "x" * 200  # long ids count in every piece
        if request_id in finished:
            continue
        tokens = list(range(next_token, next_token + num_tokens))
        next_token += num_tokens
        num_top = num_tops.setdefault(request_id, num_top)  # logprobs are asked per request
        out = output(request_id, tokens, num_top=num_top)
        out.prompt_logprobs = [logprob(2**31 - 1, 20) for _ in range(num_prompt)]
        if finishes:
            out.finish_reason = FinishReason.ERROR
            out.error = RequestError(ErrorCode.INVALID_ARGUMENT, "m" * 300, "sampling_params.max_tokens")
            finished.add(request_id)
        sent.setdefault(request_id, []).extend(tokens)
        sent_prompt[request_id] = sent_prompt.get(request_id, 0) + num_prompt
        backlog.put([out], STATS)

    got: dict[str, list[int]] = {}
    got_prompt: dict[str, int] = {}
    finishes_seen: list[str] = []
    batches = drain(backlog)
    for batch in batches:
        assert len(batch.outputs) <= max_outputs
        assert batch_to_proto(batch).ByteSize() <= max_message_bytes + MESSAGE_OVERHEAD_BYTES
        for out in batch.outputs:
            assert out.request_id not in finishes_seen, "nothing comes after a request's finish"
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            got_prompt[out.request_id] = got_prompt.get(out.request_id, 0) + len(out.prompt_logprobs)
            assert not out.logprobs or len(out.logprobs) == len(out.new_token_ids)
            if out.finished:
                finishes_seen.append(out.request_id)
    event(f"{len(batches)} messages")
    assert {r: t for r, t in got.items() if t} == {r: t for r, t in sent.items() if t}
    assert {r: n for r, n in got_prompt.items() if n} == {r: n for r, n in sent_prompt.items() if n}
    assert sorted(finishes_seen) == sorted(finished)
    assert backlog.num_bytes == 0, "an emptied backlog counts nothing, however often it merged"


def test_an_emptied_backlog_counts_nothing_after_many_merges():
    # A long-lived stream merges often while its reader lags; a count that kept a little
    # of each merge would one day pause the stream for good.
    backlog = StreamBacklog(pause_bytes=64 << 10)
    for _ in range(5000):
        assert backlog.put([output("r", [1])], STATS) is False
    (batch,) = drain(backlog)
    assert batch.outputs[0].new_token_ids == [1] * 5000
    assert backlog.num_bytes == 0


def test_one_huge_output_is_split_prompt_logprobs_first_and_the_finish_comes_last():
    backlog = StreamBacklog(max_message_bytes=64 << 10, pause_bytes=1 << 40)
    out = output("r", list(range(2000)), num_top=20, finish=FinishReason.LENGTH, num_prompt_tokens=7)
    out.prompt_logprobs = [logprob(5, 20) for _ in range(500)]
    backlog.put([out], STATS)
    batches = drain(backlog)
    assert len(batches) > 2
    pieces = [b.outputs[0] for b in batches]
    assert all(len(b.outputs) == 1 for b in batches)
    assert all(batch_to_proto(b).ByteSize() <= (64 << 10) + MESSAGE_OVERHEAD_BYTES for b in batches)
    num_prompt = [len(p.prompt_logprobs) for p in pieces]
    assert sum(num_prompt) == 500
    first_token_piece = next(i for i, p in enumerate(pieces) if p.new_token_ids)
    assert all(n == 0 for n in num_prompt[first_token_piece + 1 :]), "tokens only after every prompt logprob"
    assert [t for p in pieces for t in p.new_token_ids] == list(range(2000))
    assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + [FinishReason.LENGTH]
    assert all(p.num_prompt_tokens == 7 for p in pieces)


def test_a_take_holds_at_most_max_outputs_oldest_first():
    backlog = StreamBacklog(max_outputs=3)
    backlog.put([output(f"r{i}", [i]) for i in range(7)], STATS)
    assert [[o.request_id for o in b.outputs] for b in drain(backlog)] == [
        ["r0", "r1", "r2"],
        ["r3", "r4", "r5"],
        ["r6"],
    ]


# -- merged outputs never alias the engine's -------------------------------------------------


def test_merging_copies_and_never_changes_what_the_engine_handed_over():
    first = output("r", [1, 2], num_top=1, num_cached_tokens=4)
    second = output("r", [3], num_top=1, num_cached_tokens=8)
    last = output("r", [4], finish=FinishReason.STOP, stop_token_id=4)
    last.logprobs = [logprob(4, 1)]
    handed = [first, second, last]
    before = copy.deepcopy(handed)
    backlog = StreamBacklog()
    for out in handed:
        backlog.put([out], STATS)

    (batch,) = drain(backlog)
    (merged,) = batch.outputs
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.num_cached_tokens == 8
    assert (merged.finish_reason, merged.stop_token_id) == (FinishReason.STOP, 4)
    assert handed == before, "the engine's outputs are unchanged"
    assert all(merged is not o and merged.new_token_ids is not o.new_token_ids for o in handed)
    assert all(merged.logprobs is not o.logprobs for o in handed)
    merged.new_token_ids.append(99)
    assert handed == before, "the merged output shares no list with them"


def test_an_output_taken_unmerged_is_the_engines_own_and_a_split_leaves_it_alone():
    alone = output("a", [1])
    backlog = StreamBacklog()
    backlog.put([alone], STATS)
    (batch,) = drain(backlog)
    assert batch.outputs[0] is alone  # nothing merged: no copy needed

    big = output("b", list(range(1000)), num_top=20)
    before = copy.deepcopy(big)
    backlog = StreamBacklog(max_message_bytes=64 << 10)
    backlog.put([big], STATS)
    pieces = [o for b in drain(backlog) for o in b.outputs]
    assert len(pieces) > 1
    assert big == before
    assert all(p.new_token_ids is not big.new_token_ids for p in pieces)


# -- KV events go before outputs -------------------------------------------------------------


def test_kv_events_go_before_the_outputs_queued_with_or_before_them():
    backlog = StreamBacklog(max_hashes=4)
    backlog.put([output("r", [1])], STATS)
    stored = [BlocksStored((1, 2, 3)), BlocksStored((4, 5), parent_hash=3), BlocksRemoved((1, 2, 3, 4))]
    for events in ([stored[0]], [stored[1]], [stored[2]]):  # the loop's batches, each within max_hashes
        backlog.put_events(events, STATS)
    backlog.put([RejectedAdd("dup", RequestError(ErrorCode.INVALID_ARGUMENT, "in flight", "request_id"))], STATS)

    batches = drain(backlog)
    assert [b.kv_events for b in batches] == [[stored[0]], [stored[1]], [stored[2]]]
    # Outputs ride only in the message that takes the last pending events, or later: the
    # frontend applies a message's events before its outputs.
    assert all(not b.outputs and not b.rejected for b in batches[:2])
    assert [o.request_id for o in batches[2].outputs] == ["r"]
    assert [r.request_id for r in batches[2].rejected] == ["dup"]


def test_event_batches_share_a_message_up_to_max_hashes():
    backlog = StreamBacklog(max_hashes=6)
    batches_in = [[BlocksStored((i, i + 1))] for i in range(0, 10, 2)]  # five batches of two hashes
    for events in batches_in:
        backlog.put_events(events, STATS)
    taken = [b.kv_events for b in drain(backlog)]
    assert [sum(len(e.block_hashes) for e in events) for events in taken] == [6, 4]
    assert [e for events in taken for e in events] == [e for events in batches_in for e in events]


# -- pause beyond the bound, resume at a quarter of it ---------------------------------------


def test_put_asks_for_a_pause_beyond_the_bound_and_take_resumes_at_a_quarter():
    one = output("r00", list(range(100)))
    size = output_bytes(one)
    pause_bytes = 40 * size
    backlog = StreamBacklog(pause_bytes=pause_bytes, max_outputs=1)
    answers = [backlog.put([output(f"r{i:02d}", list(range(100)))], STATS) for i in range(60)]
    assert answers == [(i + 1) * size > pause_bytes for i in range(60)]
    assert not backlog.over_read_limit

    resumed_at = []
    while backlog.num_bytes:
        before = backlog.num_bytes
        batch = backlog.take()
        if batch.resume:
            resumed_at.append((before, backlog.num_bytes))
    assert resumed_at == [(resumed_at[0][0], resumed_at[0][1])]
    before, after = resumed_at[0]
    assert before > pause_bytes // 4 >= after
    assert after > pause_bytes // 4 - size, "resumes at the first take that reaches a quarter, no later"


def test_the_read_limit_is_twice_the_pause_bound():
    one = output("r00", list(range(100)))
    backlog = StreamBacklog(pause_bytes=10 * output_bytes(one))
    for i in range(20):
        backlog.put([output(f"r{i:02d}", list(range(100)))], STATS)
    assert not backlog.over_read_limit
    backlog.put([output("r20", list(range(100)))], STATS)
    assert backlog.over_read_limit


def test_done_only_once_finished_and_taken():
    backlog = StreamBacklog(max_outputs=1)
    backlog.put([output("a", [1], finish=FinishReason.STOP), output("b", [2], finish=FinishReason.STOP)], STATS)
    backlog.finish(STATS)
    assert backlog.take().done is False
    last = backlog.take()
    assert last.done and [o.request_id for o in last.outputs] == ["b"]
    assert last.stats is STATS
