"""Stop strings over a stream of text deltas.

The checker sits after the detokenizer. It releases text as soon as it can no longer be
part of a stop string and holds back the rest:

    text seen:   "... the answer is 42\\nEN"        stop = ["\\nEND"]
    released:    "... the answer is 42"
    held back:                       "\\nEN"      (a proper prefix of "\\nEND")

Which match wins. Generation stops as soon as the text contains a stop string, so the
winner is the occurrence that ENDS first, and among occurrences ending at the same
place, the longest stop (the one starting earliest). This does not depend on how the
text was cut into deltas. When no stop is a substring of another (the usual case) it
is the same as "the earliest-starting occurrence wins, ties to the longest stop".
With nested stops it is not: for stops ["abcd", "bc"] and text "abcd", "bc" wins,
because the text contained "bc" before "abcd" was complete.

min_tokens (vLLM's rule): stop strings are searched only in text produced after the
first min_tokens output tokens. The caller passes ``check=False`` for deltas before that
point; such text is released at once and never searched, so a stop cannot start in it
(with stop "ab", "...a" before min_tokens and "b..." after is no match).

After a match nothing more is ever released; the caller finishes the request and
aborts it in the engine.

Cost. Each stop string keeps the state of a Knuth-Morris-Pratt matcher: how many of its
first characters end the text seen so far. A delta advances every state by its own
characters only, so a stream costs O(len(text) x number of stops) in total and a delta
never rescans what came before; the failure tables cost one int per stop character,
built once per stop list and shared by every choice that uses it. (Holding back by
testing every prefix of every stop, as a set of strings, took O(L^2) memory and time
per stop of length L.) The planning step bounds both the count and the length of stops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence


@functools.lru_cache(maxsize=64)
def _compile(stops: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...], frozenset[str]]:
    """The distinct non-empty stops, longest first, each one's KMP failure table (``fail[k]``
    is the length of the longest proper prefix of ``stop[: k + 1]`` that is also its
    suffix), and the characters that start a stop."""
    ordered = tuple(sorted({s for s in stops if s}, key=len, reverse=True))
    return ordered, tuple(_failure(s) for s in ordered), frozenset(s[0] for s in ordered)


def _failure(stop: str) -> tuple[int, ...]:
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class StopChecker:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        # An empty stop string cannot stop anything meaningful; it is ignored.
        self._stops, self._fails, self._first_chars = _compile(tuple(stop))
        self._include = include_stop_str_in_output
        # _matched[j]: how many first characters of stop j the text seen so far ends with
        # (always less than the whole stop: a whole one is a match and ends the stream).
        self._matched = [0] * len(self._stops)
        self._held = ""
        self._done = False
        self.matched_stop: str | None = None

    @property
    def finished(self) -> bool:
        """True once a stop matched or ``finish()`` ran."""
        return self._done

    @property
    def held_text(self) -> str:
        """Text received but not released yet."""
        return self._held

    def process(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Takes the next text delta; returns (text to release now, matched stop or None)."""
        if self._done:
            return "", None
        text = self._held + delta
        if not check or not self._stops:
            self._held = ""
            self._matched = [0] * len(self._stops)  # a stop may not start in unchecked text
            return text, None

        match = self._advance(delta)
        if match is not None:
            end, stop = match  # the match ends at delta[end - 1]
            start = len(self._held) + end - len(stop)
            self._held = ""
            self._done = True
            self.matched_stop = stop
            return text[: start + len(stop) if self._include else start], stop

        # The longest suffix that is a proper prefix of a stop is held back (nothing is
        # released that could still be the start of a stop).
        keep = max(self._matched)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def finish(self) -> str:
        """At the end of the stream: releases what was held back (nothing after a match)."""
        if self._done:
            return ""
        self._done = True
        text, self._held = self._held, ""
        return text

    def _advance(self, delta: str) -> tuple[int, str] | None:
        """Feeds ``delta`` to every stop's matcher; returns (end in delta, stop) of the
        occurrence that ends first, the longest among those ending there, or None."""
        matched = self._matched
        starts = self._first_chars.intersection(delta)
        if not starts and not any(matched):  # the usual delta: nothing to look at
            return None
        best: tuple[int, str] | None = None
        limit = len(delta)  # a later (shorter or equal) stop must end strictly earlier to win
        for j, stop in enumerate(self._stops):
            k = matched[j]
            first = stop[0]
            # From state 0 nothing happens before the stop's first character.
            if k == 0:
                if first not in starts:
                    continue
                pos = delta.find(first, 0, limit)
                if pos < 0:
                    continue
            else:
                pos = 0
            fail, n = self._fails[j], len(stop)
            while pos < limit:
                c = delta[pos]
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                pos += 1
                if k == n:
                    best, limit = (pos, stop), pos - 1
                    break
                if k == 0:  # skip ahead to the next possible start
                    pos = delta.find(first, pos, limit)
                    if pos < 0:
                        break
            matched[j] = k
        return best
