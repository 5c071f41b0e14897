"""IncrementalDetokenizer against full decodes, on both tokenizer families.

Reference (see frontend_svc/text/detokenizer.py):
    seed = last SEED_TOKENS prompt ids (skipped special tokens left out)
    det.seed_text + "".join(deltas) + det.flush() == decode(seed + output_ids)
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_svc.text.detokenizer import SEED_TOKENS, IncrementalDetokenizer, seed_token_ids
from frontend_svc.text.tokenizer import Tokenizer
from tests.frontend.tokenizer_factory import KINDS, tokenizer_files

REPL = "\ufffd"
TOKENIZERS = {kind: Tokenizer.from_files(tokenizer_files(kind)) for kind in KINDS}

# Letters, spaces, newlines, accents, CJK (some in the sentencepiece vocabulary, some
# not), emoji including ZWJ sequences and a skin-tone modifier.
ALPHABET = (
    list("abcdefgh xyzXYZ,.!?\n\t")
    + list("éèçñüøåßÆ")
    + list("日本語中文北京世界한국")
    + [
        "😀",
        "🚀",
        "👍🏽",
        "👨‍👩‍👧",
        "❤️",
        "🦀",
        "\u0301",
    ]
)
TEXT = st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seed_of(tok: Tokenizer, prompt_ids: list[int], skip: bool) -> list[int]:
    seed = seed_token_ids(tok, prompt_ids, skip)
    return seed


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:])]


def stream(tok: Tokenizer, prompt_ids: list[int], chunks: list[list[int]], skip: bool):
    det = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [det.push(c) for c in chunks]
    return det, deltas, det.flush()


def check_against_reference(tok, prompt_ids, output_ids, cuts, skip):
    det, deltas, tail = stream(tok, prompt_ids, chunked(output_ids, cuts), skip)
    seed = seed_of(tok, prompt_ids, skip)
    full = tok.decode(seed + output_ids, skip_special_tokens=skip)
    out = "".join(deltas) + tail
    if not full.startswith(det.seed_text):
        # ByteFallback re-rendered the prompt's last bytes: they and the first output bytes
        # make one run that is not valid UTF-8, which no stream can follow.
        # Only a seed that ends inside a character, or one of byte tokens alone, allows it.
        assert tok.decode(seed, skip_special_tokens=skip).endswith(REPL) or all(
            t in tok.byte_fallback_bytes for t in seed
        )
        return det, out, None
    assert det.seed_text + out == full
    # Each push's text is final: a U+FFFD in a delta is one the full decode has there.
    pos = len(det.seed_text)
    for d in deltas:
        assert d == full[pos : pos + len(d)]
        pos += len(d)
    return det, out, full


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
@SETTINGS
@given(prompt=TEXT, output=TEXT, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_random_text_any_chunking(kind, skip, prompt, output, cuts):
    tok = TOKENIZERS[kind]
    prompt_ids = tok.encode(prompt)  # with BOS
    output_ids = tok.encode(output, add_special_tokens=False)
    det, out, full = check_against_reference(tok, prompt_ids, output_ids, cuts, skip)
    # A text prompt ends on a character boundary: its whole tail is the seed text, and the
    # output is exactly what a full decode shows after the prompt.
    seed = seed_of(tok, prompt_ids, skip)
    assert det.seed_text == tok.decode(seed, skip_special_tokens=skip)
    assert full is not None
    if kind == "byte_level" or not seed:
        # Nothing before the output that could keep its leading space: decode(output_ids).
        assert out == tok.decode(output_ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
@SETTINGS
@given(data=st.data())
def test_random_ids_any_chunking(kind, skip, data):
    tok = TOKENIZERS[kind]
    # Byte tokens and ids of pieces of multi-byte characters are likely draws here.
    ids = st.integers(0, tok.vocab_size - 1)
    prompt_ids = data.draw(st.lists(ids, max_size=10), label="prompt")
    output_ids = data.draw(st.lists(ids, max_size=30), label="output")
    cuts = data.draw(st.lists(st.integers(0, 200), max_size=10), label="cuts")
    check_against_reference(tok, prompt_ids, output_ids, cuts, skip)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(prompt=TEXT, output=TEXT)
def test_nothing_held_at_a_character_boundary(kind, prompt, output):
    """Liveness: after a token that ends a character (and, for ByteFallback, is not a
    byte token), everything decoded so far has been emitted."""
    tok = TOKENIZERS[kind]
    prompt_ids = tok.encode(prompt)
    output_ids = tok.encode(output, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_ids)
    seed = seed_of(tok, prompt_ids, True)
    emitted = det.seed_text
    for i, tid in enumerate(output_ids):
        emitted += det.push([tid])
        so_far = tok.decode(seed + output_ids[: i + 1])
        if not so_far.endswith(REPL) and tid not in tok.byte_fallback_bytes:
            assert emitted == so_far


@pytest.mark.parametrize("kind", KINDS)
def test_emoji_split_over_tokens_is_held_then_whole(kind):
    tok = TOKENIZERS[kind]
    ids = tok.encode("ok 🦀 done", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.push([t]) for t in ids] + [det.flush()]
    assert "".join(deltas) == "ok 🦀 done"
    assert all(REPL not in d for d in deltas)
    assert any("🦀" in d for d in deltas)
    # The emoji needs several tokens, so some pushes had to hold their bytes back.
    assert len(tok.encode("🦀", add_special_tokens=False)) > 1
    assert deltas.count("") >= 1


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt():
    tok = TOKENIZERS["sentencepiece"]
    prompt_ids = tok.encode("The capital of France is")
    output_ids = tok.encode("Paris.", add_special_tokens=False)  # "▁Paris", "."
    assert tok.backend.id_to_token(output_ids[0]).startswith("▁")

    det = IncrementalDetokenizer(tok, prompt_ids)
    assert det.push(output_ids) + det.flush() == " Paris."
    # decode(output_ids) sees "▁Paris" first and strips the space.
    assert tok.decode(output_ids) == "Paris."
    # No prompt (or a prompt of special tokens only): the first token is first.
    for prompt in ([], [tok.bos_token_id]):
        det = IncrementalDetokenizer(tok, prompt)
        assert det.push(output_ids) + det.flush() == "Paris."


def test_byte_level_output_equals_decode_of_output_ids():
    tok = TOKENIZERS["byte_level"]
    prompt_ids = tok.encode("The capital of France is")
    output_ids = tok.encode(" Paris, 東京 😀.", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_ids)
    text = "".join(det.push([t]) for t in output_ids) + det.flush()
    assert text == tok.decode(output_ids) == " Paris, 東京 😀."


@pytest.mark.parametrize("kind", KINDS)
def test_skip_special_tokens(kind):
    tok = TOKENIZERS[kind]
    bos, eos = tok.bos_token_id, tok.eos_token_ids[0]
    body = tok.encode("Hello world", add_special_tokens=False)
    output_ids = body[:1] + [eos] + body[1:] + [eos]

    det = IncrementalDetokenizer(tok, [bos], skip_special_tokens=True)
    assert "".join(det.push([t]) for t in output_ids) + det.flush() == "Hello world"

    det = IncrementalDetokenizer(tok, [bos], skip_special_tokens=False)
    text = "".join(det.push([t]) for t in output_ids) + det.flush()
    full = tok.decode([bos] + output_ids, skip_special_tokens=False)
    assert text == full[len(tok.decode([bos], skip_special_tokens=False)) :]
    assert text.count("</s>") == 2


def test_prompt_ending_mid_character_is_completed_by_the_output():
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode("ab 😀", add_special_tokens=False)
    # Find a split inside the emoji's bytes.
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPL))
    det = IncrementalDetokenizer(tok, ids[:split])
    # The seed text stops before the token that holds the emoji's first bytes.
    assert det.seed_text == tok.decode(ids[: split - 1])
    out = det.push(ids[split:]) + det.flush()
    assert det.seed_text + out == "ab 😀"
    assert out.endswith("😀")


def test_sentencepiece_prompt_ending_in_byte_tokens_is_not_repeated():
    tok = TOKENIZERS["sentencepiece"]
    prompt_ids = tok.encode("Tell me about 🦀")
    assert prompt_ids[-1] in tok.byte_fallback_bytes
    det = IncrementalDetokenizer(tok, prompt_ids)
    output_ids = tok.encode("Hello", add_special_tokens=False)
    assert det.push(output_ids) + det.flush() == " Hello"


@pytest.mark.parametrize("kind", KINDS)
def test_flush_releases_an_unfinished_character(kind):
    tok = TOKENIZERS[kind]
    ids = tok.encode("x😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    text = det.push(ids[:-1])
    assert REPL not in text
    tail = det.flush()
    assert text + tail == tok.decode(ids[:-1])
    assert tail.endswith(REPL)
    assert det.flush() == ""


def test_ids_outside_the_vocabulary_are_ignored():
    tok = TOKENIZERS["byte_level"]
    det = IncrementalDetokenizer(tok, [])
    ids = tok.encode("hi there", add_special_tokens=False)
    assert det.push([ids[0], tok.vocab_size + 5]) + det.push(ids[1:]) + det.flush() == "hi there"


@pytest.mark.parametrize("kind", KINDS)
def test_push_cost_per_token(kind, capsys):
    """A 500-token stream, one token per push: the whole frontend has 100 µs per token."""
    tok = TOKENIZERS[kind]
    text = " ".join(["The quick brown fox jumps over the lazy dog, café 日本 😀."] * 40)
    output_ids = tok.encode(text, add_special_tokens=False)[:500]
    assert len(output_ids) == 500
    prompt_ids = tok.encode("Tell me a story.")
    best = float("inf")
    for _ in range(5):
        det = IncrementalDetokenizer(tok, prompt_ids)
        start = time.perf_counter()
        for t in output_ids:
            det.push([t])
        det.flush()
        best = min(best, time.perf_counter() - start)
    us = best / len(output_ids) * 1e6
    with capsys.disabled():
        print(f"\n[detokenizer] {kind}: {us:.1f} us/token over {len(output_ids)} tokens")
    assert us < 50


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
@SETTINGS
@given(data=st.data())
def test_seed_is_a_decodable_prompt_suffix(kind, skip, data):
    tok = TOKENIZERS[kind]
    prompt_ids = data.draw(st.lists(st.integers(-2, tok.vocab_size + 2), max_size=90))
    seed = seed_token_ids(tok, prompt_ids, skip)
    kept = [t for t in prompt_ids if 0 <= t < tok.vocab_size and not (skip and t in tok.all_special_ids)]
    byte_values = tok.byte_fallback_bytes
    run = 0
    while run < len(kept) and kept[len(kept) - 1 - run] in byte_values:
        run += 1
    # The seed ends where the prompt ends, or before a trailing run of byte tokens that is
    # complete UTF-8 and follows an ordinary token.
    end = len(kept)
    if kept[end - len(seed) :] != seed or not seed and kept:
        end = len(kept) - run
        assert 0 < end < len(kept)
        bytes(byte_values[t] for t in kept[end:]).decode("utf-8")
    assert seed == kept[end - len(seed) : end]
    assert len(seed) >= min(end, SEED_TOKENS)
    if seed and len(seed) < end:
        # It does not start inside a character's byte tokens.
        assert not 0x80 <= byte_values.get(seed[0], 0) <= 0xBF
