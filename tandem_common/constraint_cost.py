"""What a constraint may ask the grammar compiler to build, checked from its text alone.

Two shapes cost the engine far more than their size on the wire, so both services refuse
them before any compile (the numbers are in docs/limits.md):

* **Deep JSON.** The compiler reads a schema with serde_json, which stops at 128 levels of
  nesting; Python's json recurses once per level too and, on a thread already deep in
  its stack, raises RecursionError well before that. The depth is measured here by a
  scan that keeps no stack, so no schema can make either side recurse.
* **Counted repetitions that multiply.** ``(x{1000}){999}`` is 14 bytes but unrolls to
  999,000 copies of ``x``: about a second of compile and ~190 MiB per distinct regex.
  What is bounded is the atoms the ``{n}``/``{n,m}`` counts add (``*``, ``+`` and ``?``
  add none); written text adds none, so any text within the size limit passes. 10,000
  added atoms compile in milliseconds; 100,000 took a second. The same scan runs over
  Lark and GBNF grammars, whose terminals are regexes and whose rules take counts too.
"""

from __future__ import annotations

import re

MAX_JSON_SCHEMA_DEPTH = 128  # nested objects and arrays: serde_json's limit in the compiler
MAX_REPEATED_ATOMS = 10_000  # atoms counted repetitions may add (regexes, schema patterns, grammars)

_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {n} {n,} {n,m}; anything else is a literal brace
_BRACED_ESCAPES = frozenset("pPxuU")  # \p{Greek}, \x{10FFFF}, \u{...}: the braces belong to the escape


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (strings skipped; no stack)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def repeated_atoms(pattern: str) -> int:
    """How many atoms the counted repetitions of ``pattern`` add once unrolled.

    ``x{1000}`` adds 999, ``(x{1000}){999}`` 998,999; a written literal adds none. A scan,
    not a parser: groups are a stack of running sums, a class ``[...]`` and an escape are
    one atom, and a count multiplies the atom or group just before it. A malformed
    pattern gets a figure too; the compiler refuses it with its own message.
    """
    frames: list[int] = [0]  # the unrolled size of each open group, outermost first
    last = 0  # the unrolled size of the atom or group just ended: what a count would repeat
    written = 0  # atoms as written
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "(":
            frames.append(0)
            i += 1
            continue
        if ch == "{" and (m := _COUNT.match(pattern, i)):
            copies = max(int(m.group(1)), int(m.group(2) or 0))
            frames[-1] += last * (copies - 1)  # the atom itself was counted once already
            last *= copies
            i = m.end()
            continue
        if ch in "|*+?^$":
            last = 0 if ch in "|^$" else last
            i += 1
            continue
        if ch == ")":
            last = frames.pop() if len(frames) > 1 else 0
            i += 1
        else:
            if ch == "\\":
                i += 2
                if pattern[i - 1 : i] in _BRACED_ESCAPES and pattern[i : i + 1] == "{":
                    i = _skip_to(pattern, i, "}")
            elif ch == "[":
                i = _skip_class(pattern, i)
            else:
                i += 1
            last = 1
            written += 1
        frames[-1] += last
    return sum(frames) - written


def _skip_to(text: str, i: int, end: str) -> int:
    j = text.find(end, i)
    return len(text) if j < 0 else j + 1


def _skip_class(text: str, i: int) -> int:
    """The index just past the class opened at ``text[i] == '['`` (nested classes, escapes,
    and a ``]`` first in the class, which is a literal)."""
    depth, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
            i += 1
            if i < n and text[i] == "^":
                i += 1
            if i < n and text[i] == "]":
                i += 1
            continue
        if ch == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def schema_patterns(schema: object) -> list[str]:
    """Every regex a parsed JSON Schema holds (``pattern`` values, ``patternProperties`` keys)."""
    found: list[str] = []
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(node["patternProperties"])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found
