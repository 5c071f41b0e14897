"""Parse the concatenated JSON objects that grpcurl and buf curl print for a stream."""

from __future__ import annotations

import json


def json_objects(text: str) -> list[dict]:
    decoder, pos, items = json.JSONDecoder(), 0, []
    text = text.strip()
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        items.append(obj)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return items


def stop_candidate(text: str, start: int = 4, length: int = 3) -> str | None:
    """A short run of letters and spaces from the middle of ``text``, to use as a stop string."""
    for i in range(start, len(text) - length):
        piece = text[i : i + length]
        if all(c.isascii() and (c.isalpha() or c == " ") for c in piece) and piece.strip():
            return piece
    return None
