"""Sampling parameters, their defaults and their limits: one table for both services.

The frontend checks a public request against these limits before it reaches an engine;
the engine checks again with the same function, because any client of the engine
protocol can reach it. Names follow vLLM so readers can cross-reference.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tandem_common.constraint_cost import (
    MAX_JSON_SCHEMA_DEPTH,
    MAX_REPEATED_ATOMS,
    json_depth,
    repeated_atoms,
    schema_patterns,
)

DEFAULT_MAX_TOKENS = 16  # when a request does not say (the frontend also caps it to the context left)
MAX_LOGPROBS = 20  # top alternatives per token, for logprobs and prompt_logprobs
# Sizes of the repeated and map fields. Each is checked from its length alone, before any
# per-element work, so that one cheap request cannot make either service scan a huge list
# (the engine tests stop ids every step). docs/limits.md lists every limit of the API.
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS = 1024  # token ids with a bias

# Structured output (docs/structured_output.md). The constraint's text (schema, regex,
# grammar, or all choices together) is compiled by the engine against its tokenizer;
# these bound what one request may ask it to compile.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
GRAMMAR_SYNTAXES = ("lark", "gbnf")
JSON_WHITESPACE = ("compact", "flexible")
MAX_STRUCTURED_BYTES = 64 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint the output must follow, enforced token by token by the engine's sampler.

    A hashable value: the engine caches compiled grammars by it. ``kind`` is one of
    STRUCTURED_KINDS; ``text`` is the JSON Schema, the regex or the grammar (empty for
    json_object, which is any JSON object); ``choices`` the strings for "choice". The JSON
    options apply to json_schema and json_object only: ``json_whitespace`` "compact" (no
    whitespace outside strings) or "flexible" (any JSON whitespace between tokens);
    ``json_lenient`` ignores schema keywords the engine cannot enforce instead of refusing.
    """

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    grammar_syntax: str = "lark"
    json_whitespace: str = "compact"
    json_lenient: bool = False


@dataclass
class SamplingParams:
    """Token-level sampling controls.

    Defaults are the neutral values: temperature 1.0, top_p 1.0, top_k 0 (= off),
    min_p 0.0, penalties 0.0 / 1.0 (off). ``temperature == 0`` means greedy.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives to return besides the chosen token
    prompt_logprobs: int | None = None  # same, for every prompt position
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: StructuredOutput | None = None  # None: free text


@dataclass(frozen=True)
class Range:
    """A closed interval, or half-open at the low end (``lo_open``); NaN and inf never fit."""

    lo: float
    hi: float
    lo_open: bool = False

    def __contains__(self, x: float) -> bool:
        return math.isfinite(x) and (self.lo < x if self.lo_open else self.lo <= x) and x <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


# Float parameters and the values they accept.
RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, lo_open=True),
}
LOGIT_BIAS_RANGE = Range(-100.0, 100.0)


@dataclass(frozen=True)
class FieldError:
    """What is wrong with one field of ``SamplingParams``: ``name`` is the field's name,
    ``message`` says what to fix without repeating the name (each service adds it)."""

    name: str
    message: str


def check_sizes(num_stop_token_ids: int, num_logit_bias: int) -> FieldError | None:
    """The size limits of the repeated and map fields, from their lengths alone: callers
    check these before they copy or scan the fields."""
    if num_stop_token_ids > MAX_STOP_TOKEN_IDS:
        return FieldError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids are allowed, got {num_stop_token_ids}")
    if num_logit_bias > MAX_LOGIT_BIAS:
        return FieldError("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids are allowed, got {num_logit_bias}")
    return None


def check_sampling_params(p: SamplingParams, vocab_size: int) -> FieldError | None:
    """The first limit ``p`` breaks, or None."""
    size_error = check_sizes(len(p.stop_token_ids), len(p.logit_bias))
    if size_error is not None:
        return size_error
    checks: list[tuple[bool, str, str]] = [
        (p.max_tokens >= 1, "max_tokens", f"must be at least 1, got {p.max_tokens}"),
        (p.min_tokens >= 0, "min_tokens", f"must be >= 0, got {p.min_tokens}"),
        (
            p.min_tokens <= p.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({p.max_tokens}), got {p.min_tokens}",
        ),
        (p.top_k >= -1, "top_k", f"must be -1, 0 (all tokens) or positive, got {p.top_k}"),
        (
            p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {p.logprobs}",
        ),
        (
            p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}",
        ),
    ]
    for name, allowed in RANGES.items():
        value = getattr(p, name)
        checks.append((value in allowed, name, f"must be in {allowed}, got {value}"))
    for ok, name, message in checks:
        if not ok:
            return FieldError(name, message)
    for t in p.stop_token_ids:
        if not 0 <= t < vocab_size:
            return FieldError("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})")
    for t, bias in p.logit_bias.items():
        if not 0 <= t < vocab_size:
            return FieldError("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab_size})")
        if bias not in LOGIT_BIAS_RANGE:
            return FieldError("logit_bias", f"the bias of token {t} must be in {LOGIT_BIAS_RANGE}, got {bias}")
    if p.structured is not None:
        return check_structured_output(p.structured)
    return None


def check_structured_output(s: StructuredOutput) -> FieldError | None:
    """What is wrong with a constraint before it is compiled, or None.

    These are the checks that need no tokenizer: a schema that is not JSON, an empty regex,
    an empty choice, a text over the size limit. Whether the schema, regex or grammar can
    be compiled is the engine's answer (an in-band INVALID_ARGUMENT with the compiler's
    message). Field names are the proto's, the same in both APIs.
    """
    if s.kind not in STRUCTURED_KINDS:
        return FieldError(s.kind or "constraint", f"unknown constraint kind; expected one of {STRUCTURED_KINDS}")
    name = "grammar.text" if s.kind == "grammar" else "choice.choices" if s.kind == "choice" else s.kind
    size = len(s.text.encode()) + sum(len(c.encode()) for c in s.choices)
    if size > MAX_STRUCTURED_BYTES:
        return FieldError(name, f"is {size} bytes; the limit is {MAX_STRUCTURED_BYTES} bytes")
    if s.json_whitespace not in JSON_WHITESPACE:
        return FieldError("json_whitespace", f"must be one of {JSON_WHITESPACE}, got {s.json_whitespace!r}")
    if s.kind == "json_schema":
        return _check_json_schema(s.text)
    if s.kind in ("regex", "grammar") and not s.text:
        return FieldError(name, f"the {s.kind} is empty")
    if s.kind == "grammar" and s.grammar_syntax not in GRAMMAR_SYNTAXES:
        return FieldError("grammar.syntax", f"must be one of {GRAMMAR_SYNTAXES}, got {s.grammar_syntax!r}")
    if s.kind in ("regex", "grammar"):
        return _check_regex(name, s.text)
    if s.kind == "choice":
        if not s.choices:
            return FieldError(name, "the list of choices is empty: give at least one string")
        if len(s.choices) > MAX_CHOICES:
            return FieldError(name, f"has {len(s.choices)} choices; the limit is {MAX_CHOICES}")
        empty = next((i for i, c in enumerate(s.choices) if not c), None)
        if empty is not None:
            return FieldError(f"{name}[{empty}]", "is empty: every choice must be a non-empty string")
    return None


def _check_json_schema(text: str) -> FieldError | None:
    if not text.strip():
        return FieldError("json_schema", 'the JSON schema is empty; send a JSON Schema object, e.g. {"type": "object"}')
    # Measured before json.loads, which recurses once per level (tandem_common/constraint_cost.py).
    depth = json_depth(text)
    if depth > MAX_JSON_SCHEMA_DEPTH:
        return FieldError(
            "json_schema", f"nests objects and arrays {depth} levels deep; the limit is {MAX_JSON_SCHEMA_DEPTH} levels"
        )
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        return FieldError("json_schema", f"is not valid JSON: {e}")
    if not isinstance(schema, dict):
        return FieldError("json_schema", f"must be a JSON object (a JSON Schema), got {_json_type(schema)}")
    # Summed over the schema's patterns: a hundred patterns at the limit cost a hundred times as much.
    added = sum(repeated_atoms(pattern) for pattern in schema_patterns(schema))
    if added > MAX_REPEATED_ATOMS:
        return FieldError(
            "json_schema",
            f"has patterns whose counted repetitions ({{n}}, {{n,m}}) add {added} atoms once unrolled; the limit "
            f"is {MAX_REPEATED_ATOMS} for all patterns together: use smaller counts, or * and + where the length "
            "need not be exact",
        )
    return None


def _check_regex(name: str, pattern: str) -> FieldError | None:
    added = repeated_atoms(pattern)
    if added > MAX_REPEATED_ATOMS:
        return FieldError(
            name,
            f"has counted repetitions ({{n}}, {{n,m}}) that add {added} atoms once unrolled; the limit is "
            f"{MAX_REPEATED_ATOMS}: use smaller counts, or * and + where the length need not be exact",
        )
    return None


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "a string" if isinstance(value, str) else "null"
