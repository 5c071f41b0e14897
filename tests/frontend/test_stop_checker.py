"""StopChecker: hold-back, matches across deltas, which match wins, include flag, min_tokens."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_svc.text.stop_checker import StopChecker


def run(stops, deltas, include=False, checks=None):
    """Feeds ``deltas``; returns (released text, matched stop, released-per-delta)."""
    sc = StopChecker(stops, include_stop_str_in_output=include)
    pieces, matched = [], None
    for i, d in enumerate(deltas):
        out, m = sc.process(d, check=True if checks is None else checks[i])
        pieces.append(out)
        if m is not None:
            assert matched is None, "a second match after the first"
            matched = m
    pieces.append(sc.finish())
    return "".join(pieces), matched, pieces


def reference(stops, text, include):
    """The text contains a stop from the first position where one ends; among stops ending
    there, the longest."""
    best = None
    for s in (s for s in stops if s):
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    if best is None:
        return text, None
    _, i, s = best
    return text[: i + len(s) if include else i], s


# ---------------------------------------------------------------------- matrix


@pytest.mark.parametrize("include", [False, True])
def test_stop_not_aligned_to_deltas(include):
    text, m, _ = run(["lo w"], ["Hel", "lo wo", "rld"], include)
    assert m == "lo w"
    assert text == ("Hello w" if include else "Hel")


def test_stop_spanning_several_deltas():
    text, m, pieces = run(["bcd"], ["a", "b", "c", "d", "e"])
    assert (text, m) == ("a", "bcd")
    assert pieces == ["a", "", "", "", "", ""]


def test_stop_spanning_two_deltas_releases_the_rest_before_it():
    text, m, pieces = run(["STOP"], ["one two ST", "OP three"])
    assert (text, m) == ("one two ", "STOP")
    assert pieces[0] == "one two "  # "ST" was held back


def test_held_back_prefix_is_released_when_it_stops_matching():
    sc = StopChecker(["\nEND"], include_stop_str_in_output=False)
    assert sc.process("the answer\nEN") == ("the answer", None)
    assert sc.held_text == "\nEN"
    assert sc.process("TRY") == ("\nENTRY", None)
    assert sc.process("\nE") == ("", None)
    assert sc.finish() == "\nE"
    assert sc.finished and sc.matched_stop is None


@pytest.mark.parametrize(
    "deltas, expected",
    [
        (["xa", "b c"], ("x", "ab")),  # "ab" is complete before "b c"
        (["xb", " c"], ("x", "b c")),
        (["xab c"], ("x", "ab")),
    ],
)
def test_overlapping_candidates(deltas, expected):
    text, m, _ = run(["ab", "b c"], deltas)
    assert (text, m) == expected


@pytest.mark.parametrize("include", [False, True])
def test_include_flag(include):
    text, m, _ = run(["</answer>"], ["42</ans", "wer> and more"], include)
    assert m == "</answer>"
    assert text == ("42</answer>" if include else "42")


@pytest.mark.parametrize("include", [False, True])
def test_unicode_stops(include):
    text, m, _ = run(["日本", "😀!"], ["café 日", "本語 😀!"], include)
    assert m == "日本"
    assert text == ("café 日本" if include else "café ")
    text, m, _ = run(["😀!"], ["a 😀", "!b"], include)
    assert (text, m) == ("a 😀!" if include else "a ", "😀!")


def test_stop_inside_the_first_delta():
    text, m, pieces = run(["STOP"], ["hello STOP world", "never seen"])
    assert (text, m) == ("hello ", "STOP")
    assert pieces == ["hello ", "", ""]


def test_several_stops_of_different_lengths():
    stops = ["\n\n", "END", "x"]
    assert run(stops, ["ab", "c\n", "\nd"])[:2] == ("abc", "\n\n")
    assert run(stops, ["abE", "ND"])[:2] == ("ab", "END")
    assert run(stops, ["a\n", "x"])[:2] == ("a\n", "x")


def test_earliest_match_wins_whatever_the_list_order():
    assert run(["world", "hello"], ["say hello world"])[:2] == ("say ", "hello")
    assert run(["world", "hello"], ["say hel", "lo world"])[:2] == ("say ", "hello")


def test_same_end_goes_to_the_longest_stop():
    assert run(["c", "bc"], ["abcd"], include=True)[:2] == ("abc", "bc")
    assert run(["c", "bc"], ["abcd"])[:2] == ("a", "bc")


def test_nested_stops_first_complete_wins_independent_of_chunking():
    # "bc" is in the text before "abcd" is complete, however the text arrives.
    for deltas in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        assert run(["abcd", "bc"], deltas)[:2] == ("a", "bc")


def test_nothing_after_the_stop():
    sc = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert sc.process("a STOP b") == ("a STOP", "STOP")
    assert sc.finished and sc.matched_stop == "STOP"
    assert sc.process("more") == ("", None)
    assert sc.process("STOP") == ("", None)
    assert sc.finish() == ""


def test_no_stops_passes_everything_through():
    sc = StopChecker([], include_stop_str_in_output=False)
    assert sc.process("abc") == ("abc", None)
    assert sc.finish() == ""


def test_empty_stop_strings_are_ignored():
    assert run(["", "z"], ["abc", "dz"])[:2] == ("abcd", "z")
    assert run([""], ["abc"])[:2] == ("abc", None)


def test_before_min_tokens_text_is_released_and_never_searched():
    # check=False (before min_tokens): a stop in that text is no stop, nothing is held.
    sc = StopChecker(["ab"], include_stop_str_in_output=False)
    assert sc.process("xab a", check=False) == ("xab a", None)
    # A stop may not start in unchecked text: "a" + "b" does not match ...
    assert sc.process("b ", check=True) == ("b ", None)
    # ... but one wholly inside checked text does.
    assert sc.process("cab", check=True) == ("c", "ab")


# ---------------------------------------------------------------------- properties

ALPHABET = st.sampled_from(list("ab c\n") + ["é", "日", "😀"])
SMALL_TEXT = st.lists(ALPHABET, max_size=30).map("".join)
STOPS = st.lists(st.lists(ALPHABET, min_size=1, max_size=4).map("".join), max_size=4)


def split(text, cuts):
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


@settings(max_examples=200, deadline=None)
@given(text=SMALL_TEXT, stops=STOPS, include=st.booleans(), cuts=st.lists(st.integers(0, 40), max_size=10))
def test_any_chunking_matches_the_reference(text, stops, include, cuts):
    deltas = split(text, cuts)
    sc = StopChecker(stops, include_stop_str_in_output=include)
    released, matched, seen = "", None, ""
    for d in deltas:
        out, m = sc.process(d)
        released += out
        if m is not None:
            matched = m
            break
        seen += d
        # Released as early as possible: what is held is exactly the longest suffix of the
        # text so far that could still grow into a stop.
        held = sc.held_text
        assert released + held == seen
        longest = max(
            (n for n in range(1, len(seen) + 1) if any(s.startswith(seen[-n:]) and s != seen[-n:] for s in stops if s)),
            default=0,
        )
        assert len(held) == longest
    released += sc.finish()
    assert (released, matched) == reference(stops, text, include)


@settings(max_examples=100, deadline=None)
@given(
    before=SMALL_TEXT,
    after=SMALL_TEXT,
    stops=STOPS,
    include=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_min_tokens_gate(before, after, stops, include, cuts):
    deltas = split(before, cuts) + split(after, cuts)
    checks = [False] * len(split(before, cuts)) + [True] * len(split(after, cuts))
    text, matched, _ = run(stops, deltas, include, checks)
    expected_after, expected_stop = reference(stops, after, include)
    assert (text, matched) == (before + expected_after, expected_stop)


def test_cost_per_delta(capsys):
    """One delta per token of a 500-token stream, four stops."""
    deltas = [" word", ",", " café", " 日本", "\n"] * 100
    best = float("inf")
    for _ in range(5):
        sc = StopChecker(["\n\nUser:", "</answer>", "STOP", "Observation:"], False)
        start = time.perf_counter()
        for d in deltas:
            sc.process(d)
        sc.finish()
        best = min(best, time.perf_counter() - start)
    us = best / len(deltas) * 1e6
    with capsys.disabled():
        print(f"\n[stop_checker] {us:.1f} us/delta over {len(deltas)} deltas")
    assert us < 30


def test_stop_strings_cost_memory_linear_in_their_length():
    """The longest stop list allowed: 16 stops of 1024 characters. Holding back by a set of
    every prefix of every stop took ~8 M characters (16 x 1024^2 / 2) for it."""
    stops = [f"{i:04d}" + "xy" * 510 for i in range(16)]
    text = ["xy" * 2] * 600
    tracemalloc.start()
    try:
        checker = StopChecker(stops)
        released = "".join(checker.process(d)[0] for d in text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert released == "xy" * 1200
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB"
