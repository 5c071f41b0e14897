"""Prompt lookup: a request's draft is what followed the latest earlier occurrence of its
last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

The latest occurrence, not the first: in a copy, the text being reproduced is the
nearest one. ``NgramIndex`` keeps, per request, where each token occurs (extended as
tokens are appended), so a lookup visits the occurrences of the last token only, not the
whole context: at 64 requests of 500 tokens a scan costs ~5 ms a step in Python.
"""

from __future__ import annotations


class NgramIndex:
    """Positions of every token of one request's token list, oldest first."""

    __slots__ = ("_positions", "_length")

    def __init__(self) -> None:
        self._positions: dict[int, list[int]] = {}
        self._length = 0  # tokens indexed so far: a prefix of the request's list

    def propose(self, token_ids: list[int], num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the
        last n tokens of ``token_ids`` (the request's whole list, which only grows)."""
        positions = self._positions
        for i in range(self._length, len(token_ids)):
            positions.setdefault(token_ids[i], []).append(i)
        self._length = length = len(token_ids)
        if length < 2 or num_tokens <= 0:
            return []
        ends = positions.get(token_ids[-1], ())
        for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
            suffix = token_ids[length - n :]
            # A match ends at j (the last token's earlier occurrence) and must leave at least
            # one token after it; the list is compared, so a stale position cannot match.
            for j in reversed(ends):
                if n - 1 <= j < length - 1 and token_ids[j - n + 1 : j + 1] == suffix:
                    return token_ids[j + 1 : j + 1 + num_tokens]
        return []


def propose_ngram(token_ids: list[int], num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
    """``NgramIndex.propose`` on a list seen once."""
    return NgramIndex().propose(token_ids, num_tokens, lookup_min, lookup_max)
