"""``rank_pattern`` / ``alpha_pattern``: PEFT's lookup, on an engine that cannot be made slow.

PEFT (``peft/utils/other.py::get_pattern_key``, 0.15 and later, 0.21 as installed) gives a
module the value of the first key, in the config's order, for which
``re.match(rf"(.*\\.)?({key})$", module)`` matches, the module named as in the base model
(``model.layers.3.self_attn.q_proj``); with none, the value stored under the module's
exact name; else the config's ``r`` / ``lora_alpha``. The key is a regular expression
pasted into that text unescaped, so ``q_proj`` names every q_proj, ``layers.0.self_attn.q_proj``
one of them, and a key may even close the group it sits in: we build the same text and
anchor it the same way, so every key means what it means to PEFT. Older PEFT differs:
0.14 matched ``rf".*\\.{key}$"`` (a key could not start at the name's first character);
0.13 and earlier tried the keys of both patterns together and looked the first match's key
up in each, so a module named by ``alpha_pattern`` alone got the default ``r``. An adapter
trained by those versions with keys where the rules differ is served by today's rule.

Why not Python's ``re``: it backtracks, and a key such as ``(.|.)*Z`` takes exponential
time in the name while holding the GIL, which stops every thread of the engine, the step
loop included. The ``regex`` package bounds matching with ``timeout=`` but not compiling:
``((a{1000}){1000}){1000}`` compiled for more than 20 s. RE2 (``google-re2``, Google's own
bindings) matches in time linear in the name and compiles within a memory budget
(``max_mem`` below; it also refuses counted repetitions nested past 1000), so every key
costs milliseconds at most. What RE2 does not have (look-arounds, back-references) or what
exceeds the budget is refused at load, naming the file and the key; an adapter's real keys
are module names and alternations of them, which RE2 takes. Names are ASCII, where RE2's
classes (``\\d``, ``\\w``) and ``$`` (end of text; PEFT's also matches before a final
newline, which no module name has) agree with ``re``'s.

Bounds: ``MAX_KEYS`` keys per pattern (a key per projection of a 128-layer model, 896,
fits), ``MAX_KEY_MEMORY`` bytes of compiled program per key (a real key needs a few KiB;
a key at the bound compiles in about 6 ms), so an adapter's patterns cost at most seconds
on a large model whatever they hold, each call milliseconds.
"""

from __future__ import annotations

import math
from typing import Any

import re2

MAX_KEYS = 1024
MAX_KEY_MEMORY = 1 << 20
_OPTIONS = re2.Options()
_OPTIONS.max_mem = MAX_KEY_MEMORY
_OPTIONS.log_errors = False  # a refused key is reported in one line, by LoraError
_OPTIONS.never_capture = True  # only whether it matches counts


class PatternError(ValueError):
    """A pattern key or value the engine refuses; the message names the key."""


class Patterns:
    """One of ``rank_pattern`` / ``alpha_pattern``, compiled: ``value(module, default)``."""

    def __init__(self, field: str, patterns: dict) -> None:
        if len(patterns) > MAX_KEYS:
            raise PatternError(f"{field} has {len(patterns)} keys; at most {MAX_KEYS} are served")
        self._values = dict(patterns)
        self._compiled: list[tuple[Any, float]] = []  # (an RE2 regexp, the value)
        for key, value in patterns.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PatternError(f"{field} key {_shown(key)}: the value must be a positive number, got {value!r}")
            try:
                regexp = re2.compile(rf"(.*\.)?({key})$", _OPTIONS)
            except re2.error as e:
                raise PatternError(
                    f"{field} key {_shown(key)} is not a pattern this engine takes ({_reason(e)})"
                ) from None
            self._compiled.append((regexp, value))

    def value(self, module: str, default: float) -> float:
        """PEFT's value for ``module`` (its full name in the base model)."""
        name = module.encode()
        for regexp, value in self._compiled:
            if regexp.match(name):
                return value
        return self._values.get(module, default)


def _shown(key: str) -> str:
    return repr(key) if len(key) <= 80 else f"{key[:77]!r}..."


def _reason(e: Exception) -> str:
    reason = e.args[0] if e.args else e
    return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)  # RE2's own words
