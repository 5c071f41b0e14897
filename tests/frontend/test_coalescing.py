"""Adaptive coalescing: the engine client wakes calls after the stream's backlog is read,
and merged or split outputs give the same text, logprobs and ends to the byte."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.handle import RequestHandle
from frontend_svc.text.output_processor import ChoiceProcessor, TextParams
from frontend_svc.types import EngineOutput
from tandem_common.types import FinishReason, Logprob
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tests.frontend.test_output_processor import PROMPT, TOK, ids_of

# -- the engine client's wake-ups ----------------------------------------------------------------


class FakeStream:
    """The read side of an engine Stream: like gRPC, a read completes on a later loop turn."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()

    async def read(self):
        await asyncio.sleep(0)
        return await self.messages.get()

    def put_token(self, request_id: str, token_id: int, *, last: bool = False) -> None:
        out = pb.RequestOutput(request_id=request_id, new_token_ids=[token_id], num_prompt_tokens=3)
        if last:
            out.finish_reason = pb.FINISH_REASON_LENGTH
        self.messages.put_nowait(pb.StreamResponse(outputs=[out]))


async def _read_all(client: EngineClient, handle: RequestHandle, stream: FakeStream, feed) -> list[list[int]]:
    """Token ids of each take() of a reader woken by ``handle.wakeup``, while ``feed`` puts."""
    reader = asyncio.create_task(client._read(stream))
    takes = []
    feeder = asyncio.create_task(feed())
    try:
        async for out in handle:
            takes.append(out.new_token_ids)
    finally:
        await feeder
        stream.messages.put_nowait(grpc.aio.EOF)
        await reader
    return takes


def _handle(stream_interval: int) -> tuple[EngineClient, RequestHandle]:
    client = EngineClient("127.0.0.1:1")
    handle = RequestHandle("r", None, stream_interval)
    client._requests["r"] = handle
    return client, handle


async def test_a_backlog_is_read_before_the_call_is_woken():
    """Eight messages already waiting reach the call as one output of eight tokens."""
    (client, handle), stream = _handle(0), FakeStream()
    for i in range(8):
        stream.put_token("r", 10 + i, last=i == 7)

    async def feed():
        pass

    assert await _read_all(client, handle, stream, feed) == [list(range(10, 18))]


async def test_tokens_that_come_apart_are_woken_for_one_by_one():
    """An idle frontend: every token reaches the call alone (inter-token latency unchanged)."""
    (client, handle), stream = _handle(0), FakeStream()

    async def feed():
        for i in range(5):
            await asyncio.sleep(0.005)
            stream.put_token("r", 10 + i, last=i == 4)

    assert await _read_all(client, handle, stream, feed) == [[10], [11], [12], [13], [14]]


async def test_a_fixed_interval_wakes_per_delivery_as_before():
    """--stream-interval 1 wakes the call at each delivery (the servicer splits the rest)."""
    (client, handle), stream = _handle(1), FakeStream()
    for i in range(4):
        stream.put_token("r", 10 + i, last=i == 3)

    async def feed():
        pass

    takes = await _read_all(client, handle, stream, feed)
    assert len(takes) > 1 and sum(takes, []) == [10, 11, 12, 13]


async def test_a_long_backlog_wakes_the_call_within_the_deferral_bound(monkeypatch):
    """The calls are not starved while a long backlog is read: past MAX_DEFERRED_S they write."""
    import frontend_svc.engine.wakeups as wakeups_module

    monkeypatch.setattr(wakeups_module, "MAX_DEFERRED_S", 0.0)
    (client, handle), stream = _handle(0), FakeStream()
    for i in range(6):
        stream.put_token("r", 10 + i, last=i == 5)

    async def feed():
        pass

    takes = await _read_all(client, handle, stream, feed)
    assert len(takes) > 1 and sum(takes, []) == list(range(10, 16))


async def test_a_busy_loop_with_a_quiet_engine_still_wakes_the_call():
    """Other work keeping every loop turn busy while the engine sends nothing more must not
    hold a delivered token back (the probe for a backlog gives up at MAX_DEFERRED_S)."""
    (client, handle), stream = _handle(0), FakeStream()
    stream.put_token("r", 10)
    stop = False

    async def busy() -> None:  # a millisecond of CPU every turn, as many calls' set-up would
        while not stop:
            start = time.thread_time()
            while time.thread_time() - start < 0.001:
                pass
            await asyncio.sleep(0)

    burner = asyncio.create_task(busy())
    reader = asyncio.create_task(client._read(stream))
    try:
        await asyncio.wait_for(handle.wakeup.wait(), 5.0)
        assert handle.take().new_token_ids == [10]
    finally:
        stop = True
        stream.messages.put_nowait(grpc.aio.EOF)
        await asyncio.gather(burner, reader)


# -- merged and split outputs give the same stream -------------------------------------------------


def _outputs(ids: list[int], finish: FinishReason, stop_token_id: int | None) -> list[EngineOutput]:
    """One output per token, with a logprob per token and the prompt logprobs on the first."""
    outs = [
        EngineOutput(
            "r",
            [t],
            [Logprob(t, -0.5 - i, 1 + i % 3, ((t, -0.5 - i), (7, -2.0)))],
            num_prompt_tokens=len(PROMPT),
            num_cached_tokens=2,
        )
        for i, t in enumerate(ids)
    ]
    outs[0].prompt_logprobs = [Logprob(p, -1.0, 1, ()) for p in PROMPT[1:]]
    outs[-1].finish_reason, outs[-1].stop_token_id = finish, stop_token_id
    return outs


def _chunked(outs: list[EngineOutput], sizes: list[int]) -> list[EngineOutput]:
    merged, i, k = [], 0, 0
    while i < len(outs):
        size = sizes[k % len(sizes)]
        k += 1
        first = EngineOutput(outs[i].request_id, num_prompt_tokens=outs[i].num_prompt_tokens)
        for o in outs[i : i + size]:
            first.merge(o)
        merged.append(first)
        i += size
    return merged


def _stream(params: TextParams, outputs: list[EngineOutput]):
    proc = ChoiceProcessor(0, TOK, PROMPT, params)
    pieces = [p for p in (proc.process(o) for o in outputs) if p is not None]
    last = pieces[-1]
    return (
        "".join(p.text for p in pieces),
        [t for p in pieces for t in p.token_ids],
        [
            (lp.token_id, lp.token, lp.logprob, lp.rank, [(t.token_id, t.token) for t in lp.top])
            for p in pieces
            for lp in p.logprobs
        ],
        [(lp.token_id, lp.token) for p in pieces for lp in p.prompt_logprobs],
        (last.finish_reason, last.stop_str, last.stop_token_id, last.usage),
        sum(1 for p in pieces if p.finished),
    )


TEXT = "The river runs past the old mill, and a small boat drifts along under a grey sky."
CASES = {
    "no stops": (TextParams(return_token_ids=True, prompt_logprobs=True), FinishReason.LENGTH, None),
    "stop string held back": (
        TextParams(stop=["old mill", "boat d"], return_token_ids=True),
        FinishReason.LENGTH,
        None,
    ),
    "stop string kept": (
        TextParams(stop=["small b"], include_stop_str_in_output=True, return_token_ids=True),
        FinishReason.LENGTH,
        None,
    ),
    "min_tokens": (TextParams(stop=["the"], min_tokens=4, return_token_ids=True), FinishReason.LENGTH, None),
    "stop token": (TextParams(return_token_ids=True), FinishReason.STOP, "eos"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_merged_outputs_stream_the_same_as_one_token_each(case, sizes):
    params, finish, stop = CASES[case]
    ids = ids_of(TEXT)
    stop_token_id = None
    if stop == "eos":
        stop_token_id = TOK.eos_token_ids[0]
        ids = [*ids, stop_token_id]
    one_each = _stream(params, _outputs(ids, finish, stop_token_id))
    assert _stream(params, _chunked(_outputs(ids, finish, stop_token_id), sizes)) == one_each
    # split() undoes the merge: --stream-interval 1 gets one piece per token again.
    split = [part for o in _chunked(_outputs(ids, finish, stop_token_id), sizes) for part in o.split()]
    assert [len(o.new_token_ids) for o in split] == [1] * len(ids)
    assert _stream(params, split) == one_each


def test_split_keeps_prompt_logprobs_first_and_the_end_last():
    merged = _chunked(_outputs([5, 6, 7], FinishReason.STOP, 7), [3])[0]
    parts = merged.split()
    assert [p.new_token_ids for p in parts] == [[5], [6], [7]]
    assert parts[0].prompt_logprobs and not parts[1].prompt_logprobs and not parts[2].prompt_logprobs
    assert [p.finish_reason for p in parts] == [None, None, FinishReason.STOP] and parts[2].stop_token_id == 7
    assert [p.logprobs[0].token_id for p in parts] == [5, 6, 7]
