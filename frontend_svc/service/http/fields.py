"""Typed reads of a JSON request body: each wrong type is a 400 that names its field.

JSON gives ``true`` for a bool and ``1`` for an int, and Python's bool is an int: every
reader here tells them apart, so ``"n": true`` is refused instead of meaning n = 1. A
field that is absent or ``null`` reads as its default (the OpenAI SDKs send ``null`` for
some unset fields). Unknown fields are ignored, as OpenAI's API does.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python's json reads into a
``str`` that no UTF-8 encoder takes: ``unencodable_field`` finds such a string, so that the
body is refused with 400 naming it before any tokenizer or encoder meets it.
"""

from __future__ import annotations

import builtins
import math
import re
from typing import Any

from frontend_svc.service.http.errors import HttpError, bad_request

_MISSING = object()


class Fields:
    """The members of one JSON object, read by type; ``path`` prefixes nested names."""

    def __init__(self, body: Any, path: str = "") -> None:
        if not isinstance(body, dict):
            where = path or "the request body"
            raise HttpError(400, f"{where} must be a JSON object, got {json_type(body)}", param=path or None)
        self.body = body
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.body.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key)
        return default if value is None else value

    def int(self, key: str, default: Any = None, *, lo: int | None = None) -> Any:
        value = self.body.get(key, _MISSING)
        if value is _MISSING or value is None:
            return default
        if isinstance(value, float) and value.is_integer():  # 16.0 from a loosely typed client
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(self.name(key), f"must be an integer, got {json_type(value)}")
        if lo is not None and value < lo:
            raise bad_request(self.name(key), f"must be at least {lo}, got {value}")
        return value

    def float(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key, _MISSING)
        if value is _MISSING or value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(self.name(key), f"must be a finite number, got {json_type(value)}")
        return float(value)

    def bool(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key, _MISSING)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(self.name(key), f"must be true or false, got {json_type(value)}")
        return value

    def str(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key, _MISSING)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(self.name(key), f"must be a string, got {json_type(value)}")
        return value

    def object(self, key: builtins.str) -> Fields | None:
        value = self.body.get(key)
        return None if value is None else Fields(value, self.name(key))

    def list(self, key: builtins.str) -> builtins.list | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise bad_request(self.name(key), f"must be an array, got {json_type(value)}")
        return value

    def str_or_strs(self, key: builtins.str) -> builtins.list[builtins.str]:
        """A string or an array of strings (``stop``), as a list."""
        value = self.body.get(key)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise bad_request(self.name(key), f"must be a string or an array of strings, got {json_type(value)}")

    def ints(self, key: builtins.str) -> builtins.list[builtins.int]:
        value = self.body.get(key)
        if value is None:
            return []
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        raise bad_request(self.name(key), "must be an array of integers")


# A \\u escape of a surrogate (U+D800-U+DFFF): only a body that holds one can hold a lone
# one (pairs are joined by the parser). Invalid UTF-8 bytes fail the parse itself.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def unencodable_field(raw: bytes, body: Any) -> str | None:
    """The path (``messages[0].content``) of a string or key of ``body``, parsed from ``raw``,
    that UTF-8 cannot encode; None if there is none. Walks ``body`` only when ``raw`` holds a
    surrogate escape at all, so an ordinary body costs one scan of its bytes."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return None
    stack: builtins.list[tuple[Any, builtins.str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                return path or "the request body"
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):  # a member's name: shown with the surrogate escaped
                    key = key.encode("utf-8", "backslashreplace").decode()
                    return f"{path}.{key}" if path else key
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _encodable(text: builtins.str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
