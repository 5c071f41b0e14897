"""tandem_common.outputs: the per-request output both services merge and split, one rule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_common.outputs import EngineOutput, RequestError
from tandem_common.types import ErrorCode, FinishReason, Logprob


def lp(token_id: int) -> Logprob:
    return Logprob(token_id, -0.5 * token_id, 1, [(token_id, -0.5 * token_id)])


def step(ids: list[int], *, logprobs: bool = True, prompt: int = 0, finish: FinishReason | None = None) -> EngineOutput:
    return EngineOutput(
        "r",
        list(ids),
        [lp(t) for t in ids] if logprobs else [],
        [lp(100 + i) for i in range(prompt)],
        finish_reason=finish,
        stop_token_id=ids[-1] if finish is FinishReason.STOP and ids else None,
        num_prompt_tokens=7,
        num_cached_tokens=4,
    )


def test_merge_concatenates_and_takes_the_last_outputs_finish():
    merged = step([1, 2], prompt=3)
    error = RequestError(ErrorCode.INTERNAL, "the model runner produced no token")
    merged.merge(step([3]))
    merged.merge(EngineOutput("r", [], finish_reason=FinishReason.ERROR, num_prompt_tokens=7, error=error))
    assert merged.new_token_ids == [1, 2, 3]
    assert [x.token_id for x in merged.logprobs] == [1, 2, 3]
    assert [x.token_id for x in merged.prompt_logprobs] == [100, 101, 102]
    assert merged.finish_reason is FinishReason.ERROR and merged.error is error
    assert (merged.num_prompt_tokens, merged.num_cached_tokens) == (7, 4)


def test_an_unfinished_later_output_leaves_the_finish_unset():
    merged = step([1])
    merged.merge(step([2]))
    assert not merged.finished and merged.error is None and merged.stop_token_id is None


def test_copy_shares_no_list():
    out = step([1, 2], prompt=1)
    copy = out.copy()
    copy.merge(step([3], prompt=1))
    assert out.new_token_ids == [1, 2] and len(out.logprobs) == 2 and len(out.prompt_logprobs) == 1


def test_split_at_cuts_a_head_without_the_finish():
    out = step([1, 2, 3], prompt=2, finish=FinishReason.STOP)
    head, tail = out.split_at(2, 1)
    assert (head.new_token_ids, len(head.prompt_logprobs), head.finished) == ([1], 2, False)
    assert (tail.new_token_ids, tail.prompt_logprobs, tail.finish_reason) == ([2, 3], [], FinishReason.STOP)
    assert tail.stop_token_id == 3 and head.stop_token_id is None
    head.new_token_ids.append(9)
    tail.new_token_ids.append(9)
    assert out.new_token_ids == [1, 2, 3]  # neither part aliases the output it came from


def test_split_gives_one_output_per_token():
    out = step([1, 2, 3], prompt=2, finish=FinishReason.LENGTH)
    parts = out.split()
    assert [p.new_token_ids for p in parts] == [[1], [2], [3]]
    assert [len(p.prompt_logprobs) for p in parts] == [2, 0, 0]
    assert [p.finish_reason for p in parts] == [None, None, FinishReason.LENGTH]
    assert step([1]).split()[0].new_token_ids == [1]


def _fields(out: EngineOutput) -> tuple:
    return (
        out.new_token_ids,
        out.logprobs,
        out.prompt_logprobs,
        out.finish_reason,
        out.stop_token_id,
        out.num_prompt_tokens,
        out.num_cached_tokens,
        out.error,
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 50), max_size=12),
    st.integers(0, 4),
    st.booleans(),
    st.sampled_from([None, FinishReason.STOP, FinishReason.LENGTH]),
    st.data(),
)
def test_merging_the_parts_of_any_split_gives_the_output_back(ids, num_prompt, logprobs, finish, data):
    out = step(ids, logprobs=logprobs, prompt=num_prompt, finish=finish)
    head, tail = out.split_at(data.draw(st.integers(0, num_prompt)), data.draw(st.integers(0, len(ids))))
    head.merge(tail)
    assert _fields(head) == _fields(out)
    parts = out.split()
    whole = parts[0].copy()
    for part in parts[1:]:
        whole.merge(part)
    assert _fields(whole) == _fields(out)
