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
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        # An empty stop string cannot stop anything meaningful; it is ignored.
        self._stops = sorted({s for s in stop if s}, key=len, reverse=True)
        self._include = include_stop_str_in_output
        self._max_prefix_len = max((len(s) for s in self._stops), default=1) - 1
        self._proper_prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
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
            return text, None

        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self._done = True
            self.matched_stop = stop
            return text[: start + len(stop) if self._include else start], stop

        keep = self._tail_to_hold(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def finish(self) -> str:
        """At the end of the stream: releases what was held back (nothing after a match)."""
        if self._done:
            return ""
        self._done = True
        text, self._held = self._held, ""
        return text

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # Released text never holds the start of a stop (see _tail_to_hold), so a match
        # lies inside held + delta. The stops are longest first, so a strict "<" keeps the
        # longest among matches that end at the same place.
        best: tuple[int, str] | None = None
        best_end = len(text) + 1
        for stop in self._stops:
            i = text.find(stop, 0, best_end)
            if i >= 0 and i + len(stop) < best_end:
                best, best_end = (i, stop), i + len(stop)
        return best

    def _tail_to_hold(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for n in range(min(len(text), self._max_prefix_len), 0, -1):
            if text[-n:] in self._proper_prefixes:
                return n
        return 0
