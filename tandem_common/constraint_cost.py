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
_TOKEN = re.compile(
    r"""(?P<literals>[^\\\[\](){}|*+?^$.]+)
    |(?P<count>\{(?P<min>\d+)(?:,(?P<max>\d*))?\})
    |(?P<open>\()
    |(?P<close>\))
    |(?P<operator>[|*+?^$])
    |(?P<escape>\\[pPxuU]\{[^}]*\}|\\.)            # \p{Greek}, \x{10FFFF}: the braces are the escape's
    |(?P<class>\[\^?\]?(?:[^\]\\\[]|\\.)*\])  # a class without nested classes
    |(?P<other>.)""",
    re.DOTALL | re.VERBOSE,
)


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
    pattern gets a figure too; the compiler refuses it with its own message. One regex
    match per token, so 64 KiB of pattern costs milliseconds (the engine runs this on its
    step thread).
    """
    if not _COUNT.search(pattern):
        return 0
    frames: list[int] = [0]  # the unrolled size of each open group, outermost first
    last = 0  # the unrolled size of the atom or group just ended: what a count would repeat
    written = 0  # atoms as written
    i, n = 0, len(pattern)
    while i < n:
        m = _TOKEN.match(pattern, i)
        assert m is not None  # the last alternative takes any one character
        kind, i = m.lastgroup, m.end()
        if kind == "literals":  # only the last of a run can take a count
            written += i - m.start()
            frames[-1] += i - m.start()
            last = 1
        elif kind == "count":
            copies = max(int(m.group("min")), int(m.group("max") or 0))
            frames[-1] += last * (copies - 1)  # the atom itself was counted once already
            last *= copies
        elif kind == "open":
            frames.append(0)
        elif kind == "close":
            last = frames.pop() if len(frames) > 1 else 0
            frames[-1] += last
        elif kind == "operator":
            last = last if m.group() in "*+?" else 0
        else:  # an escape, a class, any other single character
            if m.group() == "[":  # a class with nested classes: the slow path
                i = _skip_class(pattern, m.start())
            written += 1
            frames[-1] += 1
            last = 1
    return sum(frames) - written


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
