"""Grammars the frontend writes, compiled once here before any stream starts.

The engine compiles a request's grammar against its tokenizer and fails the request in
band when it cannot: on a stream that is an HTTP 200 followed by an error event. A
grammar the frontend writes from client input (a forced tool call's schema) is therefore
compiled here first, without a tokenizer, by the engine's own library (llguidance): what
fails here (a ``$ref`` that points nowhere, an unknown type, a bad pattern) is refused as
INVALID_ARGUMENT before the call is answered. What needs the tokenizer (the lexer's fuel
limits) stays the engine's answer.

Results are kept by the grammar's digest, at most CACHE_ENTRIES of them (a few ms each to
compute: a 100-property schema takes ~3 ms), since the same tools come with every turn of
a conversation. Callers bound the text first (tandem_common.constraint_cost: depth,
counted repetitions; spec.py: 64 KiB a schema).
"""

from __future__ import annotations

import hashlib
import re
import threading

import llguidance

CACHE_ENTRIES = 4096  # digests and short messages: well under a MiB
_POSITION = re.compile(r"^at \d+\(\d+\): ")  # where in the grammar: the grammar is ours, not the client's

_lock = threading.Lock()
_cache: dict[bytes, str | None] = {}


def grammar_problem(lark: str) -> str | None:
    """Why the Lark grammar ``lark`` does not compile (the library's first line), or None."""
    key = hashlib.sha256(lark.encode()).digest()
    with _lock:
        if key in _cache:
            return _cache[key]
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
    problem = _POSITION.sub("", error.strip().splitlines()[0]) if error.strip() else None
    with _lock:
        if len(_cache) >= CACHE_ENTRIES:
            _cache.pop(next(iter(_cache)))  # the oldest entry
        _cache[key] = problem
    return problem
