"""How deep a request's JSON nests, measured without recursion, and the one limit on it.

Python's json, a chat template's ``tojson`` and its recursive macros, and the engine's
grammar compiler all recurse once per level of nesting; past ~1,000 levels Python raises
RecursionError wherever it happens to be. So every nested value a request brings (tool
schemas, tool-call arguments, template variables) is measured where it enters, and one
deeper than MAX_NESTING is refused naming its field. 128 is the grammar compiler's own
limit (tandem_common/constraint_cost.py), which a forced tool call's schema meets anyway.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tandem_common.constraint_cost import MAX_JSON_SCHEMA_DEPTH

MAX_NESTING = MAX_JSON_SCHEMA_DEPTH


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of objects and arrays in ``value`` (a scalar: 0), counted up to ``limit`` + 1:
    a walk over containers only, that stops as soon as it passes ``limit``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


class TooDeep(ValueError):
    """A value nests deeper than MAX_NESTING; the message says so, for the field's error."""

    def __init__(self) -> None:
        super().__init__(f"nests objects and arrays more than {MAX_NESTING} levels deep; the limit is {MAX_NESTING}")


def too_deep(value: Any) -> str | None:
    """What to fix when ``value`` nests deeper than MAX_NESTING, else None."""
    return str(TooDeep()) if nesting(value) > MAX_NESTING else None


def loads(text: str) -> Any:
    """``json.loads`` that raises TooDeep, never RecursionError, for nesting past MAX_NESTING
    (json.JSONDecodeError for text that is not JSON, as json.loads)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep() from None
    if nesting(value) > MAX_NESTING:
        raise TooDeep()
    return value
