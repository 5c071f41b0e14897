"""ChoiceProcessor: engine token outputs -> text pieces with stops, min_tokens, logprobs, usage."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.text.output_processor import ChoiceProcessor, TextParams
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.types import EngineOutput
from tandem_common.types import FinishReason, Logprob
from tests.frontend.tokenizer_factory import KINDS, tokenizer_files

TOKENIZERS = {kind: Tokenizer.from_files(tokenizer_files(kind)) for kind in KINDS}
TOK = TOKENIZERS["byte_level"]
PROMPT = TOK.encode("Hello world!")
EOS = TOK.eos_token_ids[0]


def ids_of(text: str, tok: Tokenizer = TOK) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def out(ids, finish: FinishReason | None = None, **kw) -> EngineOutput:
    return EngineOutput("r", list(ids), finish_reason=finish, num_prompt_tokens=len(PROMPT), **kw)


def run(proc: ChoiceProcessor, outputs: list[EngineOutput]):
    return [p for p in (proc.process(o) for o in outputs) if p is not None]


def one_token_at_a_time(ids, finish=FinishReason.LENGTH, **kw) -> list[EngineOutput]:
    return [out([t]) for t in ids[:-1]] + [out(ids[-1:], finish, **kw)]


def joined(pieces) -> str:
    return "".join(p.text for p in pieces)


def test_plain_stream_is_the_full_decode_and_counts_usage():
    ids = ids_of(" The quick brown fox jumps over the lazy dog.")
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams())
    pieces = run(proc, one_token_at_a_time(ids, num_cached_tokens=3))
    assert joined(pieces) == TOK.decode(ids)
    last = pieces[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.stop_str is None and last.stop_token_id is None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        len(PROMPT),
        len(ids),
        3,
    )
    assert all(p.usage is None for p in pieces[:-1])
    assert proc.process(out([1, 2])) is None  # nothing after the end


def test_stop_string_cuts_text_drops_later_tokens_and_asks_for_an_abort():
    ids = ids_of(" The quick brown fox jumps over the lazy dog.")
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(stop=["fox"], return_token_ids=True))
    pieces = run(proc, [out(ids)])  # one merged output holding every token
    assert len(pieces) == 1
    piece = pieces[0]
    assert piece.text == " The quick brown "
    assert piece.finish_reason is FinishReason.STOP and piece.stop_str == "fox"
    assert piece.abort_engine
    # Exactly the tokens up to the one that completed "fox" count.
    n = next(k for k in range(1, len(ids) + 1) if "fox" in TOK.decode(ids[:k]))
    assert piece.token_ids == ids[:n]
    assert piece.usage.completion_tokens == n


def test_stop_string_found_across_many_small_outputs_and_text_is_held_back():
    ids = ids_of(" one two three four five")
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(stop=["three four"]))
    pieces = run(proc, one_token_at_a_time(ids))
    assert joined(pieces) == " one two "
    assert pieces[-1].stop_str == "three four"
    # Text that could still turn into the stop was never sent: no piece ends in "three".
    assert not any(p.text.endswith("three") for p in pieces)


def test_include_stop_str_in_output_keeps_the_match():
    ids = ids_of(" one two three four five")
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(stop=["two"], include_stop_str_in_output=True))
    assert joined(run(proc, [out(ids)])) == " one two"


def test_held_prefix_is_released_when_the_engine_finishes():
    ids = ids_of(" abc x")
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(stop=["xyz"]))
    pieces = run(proc, [out(ids[:-1]), out(ids[-1:]), out([], FinishReason.LENGTH)])
    assert joined(pieces) == " abc x"
    assert pieces[-1].finish_reason is FinishReason.LENGTH and pieces[-1].stop_str is None
    assert not pieces[-1].abort_engine


def test_min_tokens_protects_the_first_tokens_from_stop_strings():
    ids = ids_of(" dog cat dog cat")
    n_first = next(k for k in range(1, len(ids)) if "dog" in TOK.decode(ids[:k]))
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(stop=["dog"], min_tokens=n_first))
    pieces = run(proc, [out(ids)])
    # The first " dog" lies within min_tokens; the second one stops the choice.
    assert joined(pieces) == " dog cat "
    assert pieces[-1].stop_str == "dog"
    assert pieces[-1].usage.completion_tokens > n_first


def test_engine_stop_token_counts_but_is_not_shown():
    ids = ids_of(" hi there") + [EOS]
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(skip_special_tokens=False, return_token_ids=True))
    pieces = run(proc, one_token_at_a_time(ids, FinishReason.STOP, stop_token_id=EOS))
    assert joined(pieces) == " hi there"
    last = pieces[-1]
    assert last.finish_reason is FinishReason.STOP and last.stop_token_id == EOS and last.stop_str is None
    assert last.usage.completion_tokens == len(ids)
    assert [t for p in pieces for t in p.token_ids] == ids


def test_engine_stop_token_text_is_kept_with_include_stop_str_in_output():
    ids = ids_of(" hi") + [EOS]
    params = TextParams(skip_special_tokens=False, include_stop_str_in_output=True)
    proc = ChoiceProcessor(0, TOK, PROMPT, params)
    assert joined(run(proc, [out(ids, FinishReason.STOP, stop_token_id=EOS)])) == " hi</s>"


def test_logprobs_get_token_text_and_stop_at_the_stop_string():
    ids = ids_of(" red green blue")
    lps = [Logprob(t, -0.5, 1, [(t, -0.5), (5, -2.0)]) for t in ids]
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(stop=["green"]))
    (piece,) = run(proc, [out(ids, logprobs=lps)])
    assert len(piece.logprobs) == piece.usage.completion_tokens < len(ids)
    assert "".join(lp.token for lp in piece.logprobs) == TOK.decode(ids[: len(piece.logprobs)])
    assert piece.logprobs[0].top[1].token == TOK.decode([5], skip_special_tokens=False)


def test_prompt_logprobs_arrive_once_with_the_first_piece():
    plps = [Logprob(t, -1.0, 3) for t in PROMPT[1:]]
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams(prompt_logprobs=True))
    # Chunked prefill: prompt logprobs in two outputs before the first token.
    first = proc.process(out([], prompt_logprobs=plps[:2]))
    assert first is None
    pieces = run(proc, [out([], prompt_logprobs=plps[2:])] + one_token_at_a_time(ids_of(" ok fine")))
    assert [lp.token_id for lp in pieces[0].prompt_logprobs] == PROMPT[1:]
    assert all(not p.prompt_logprobs for p in pieces[1:])


def test_engine_abort_finishes_with_abort_and_flushes_text():
    ids = ids_of(" partial")
    proc = ChoiceProcessor(0, TOK, PROMPT, TextParams())
    pieces = run(proc, [out(ids), out([], FinishReason.ABORT)])
    assert joined(pieces) == " partial" and pieces[-1].finish_reason is FinishReason.ABORT


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_merged_outputs_give_the_same_result_as_single_tokens(kind, data):
    """A slow client gets outputs merged; text, stop and usage must not depend on it."""
    tok = TOKENIZERS[kind]
    text = data.draw(st.text(st.sampled_from(list("ab cd,é日😀")), min_size=1, max_size=30))
    stops = data.draw(st.lists(st.text(st.sampled_from(list("abcd ")), min_size=1, max_size=3), max_size=3))
    min_tokens = data.draw(st.integers(0, 4))
    ids = ids_of(text, tok)
    if not ids:
        return
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)]) if ids[a:b]]
    prompt = tok.encode("Hi")
    params = TextParams(stop=stops, min_tokens=min_tokens, return_token_ids=True)

    def result(outputs):
        proc = ChoiceProcessor(0, tok, prompt, params)
        pieces = run(proc, outputs)
        last = pieces[-1]
        return joined(pieces), last.stop_str, last.finish_reason, last.usage, [t for p in pieces for t in p.token_ids]

    single = result([EngineOutput("r", [t]) for t in ids] + [EngineOutput("r", [], finish_reason=FinishReason.LENGTH)])
    merged = result([EngineOutput("r", c) for c in chunks] + [EngineOutput("r", [], finish_reason=FinishReason.LENGTH)])
    assert single == merged
    if single[1] is None:
        assert single[0] == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
