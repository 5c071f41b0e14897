"""vLLM's structured-output fields -> the engine's StructuredOutput: the constraint the gRPC face carries.

    structured_outputs: {json | regex | choice | grammar | json_object, disable_any_whitespace, disable_fallback}
    guided_json | guided_regex | guided_choice | guided_grammar     (vLLM's older names, one field each)
    response_format: {type: json_schema | json_object | text}       (OpenAI's, read by openai_requests)

At most one constraint per request, from one of these fields; two are a 400 naming the
second, as vLLM refuses them. ``json`` is a JSON Schema given as an object or as its text.
A ``grammar`` holding ``::=`` is GBNF (llama.cpp's, start rule ``root``), any other is
Lark (start rule ``start``): GBNF's rules are written ``name ::= ...``, Lark's
``name: ...``. Each constraint passes the checks that need no tokenizer here, naming
the client's own field; whether a regex, schema or grammar compiles is the engine's
answer, which the HTTP face waits for before a stream starts (endpoint.py), so a bad
regex is a 400 there too.
"""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.service.http.errors import bad_request
from frontend_svc.service.http.fields import Fields, json_type
from frontend_svc.text.nesting import too_deep
from tandem_common.sampling import StructuredOutput, check_structured_output

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' constraint members
# structured_outputs' options: honoured (disable_fallback: there is one grammar engine and it never
# falls back), or refused with what to do.
_OPTIONS = ("disable_any_whitespace", "disable_fallback")
_REFUSED_OPTIONS = {
    "disable_additional_properties": 'set "additionalProperties": false in the schema itself',
    "whitespace_pattern": "set disable_any_whitespace (compact JSON) instead of a pattern",
    "structural_tag": "structural tags are not served; use tools with tool_choice",
}


def structured_constraint(f: Fields) -> tuple[str, StructuredOutput] | None:
    """The constraint of ``structured_outputs`` or a ``guided_*`` field, with the field it came
    from; None when the request has neither. HttpError 400 for two, or for a bad one."""
    found: list[tuple[str, StructuredOutput]] = []
    so = f.object("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    for name in GUIDED:
        if f.has(name):
            found.append((name, _guided(f, name)))
    if len(found) > 1:
        raise bad_request(found[1][0], f"only one output constraint is allowed, and {found[0][0]} sets one")
    return found[0] if found else None


def _structured_outputs(so: Fields) -> StructuredOutput:
    for key in so.body:
        if so.body[key] is None:
            continue
        if key in _REFUSED_OPTIONS:
            if key == "disable_additional_properties" and so.body[key] is False:
                continue
            raise bad_request(so.name(key), f"is not served by this server: {_REFUSED_OPTIONS[key]}")
        if key not in _KINDS and key not in _OPTIONS:
            raise bad_request(so.name(key), f"is not a structured_outputs member; use one of {', '.join(_KINDS)}")
    kinds = [k for k in _KINDS if so.has(k) and not (k == "json_object" and so.body[k] is False)]
    if len(kinds) != 1:
        got = ", ".join(kinds) if kinds else "none"
        raise bad_request(so.path, f"set exactly one of {', '.join(_KINDS)} (got {got})")
    kind = kinds[0]
    compact = so.bool("disable_any_whitespace")
    so.bool("disable_fallback")  # type-checked; always honoured
    if kind == "json_object":
        so.bool("json_object")
        out = StructuredOutput(kind="json_object")
    else:
        out = _constraint(so.body[kind], so.name(kind), kind)
    if compact is False and out.kind in ("json_schema", "json_object"):  # vLLM's default: any whitespace
        out = StructuredOutput(kind=out.kind, text=out.text, json_whitespace="flexible")
    return _checked(out, so.name(kind))


def _guided(f: Fields, name: str) -> StructuredOutput:
    return _checked(_constraint(f.body[name], name, name.removeprefix("guided_")), name)


def _constraint(value: Any, name: str, kind: str) -> StructuredOutput:
    """One constraint's value as vLLM reads it: json (a schema object or its text), regex,
    choice (strings), grammar (GBNF or Lark text)."""
    if kind == "json":
        if isinstance(value, dict):
            problem = too_deep(value)
            if problem is not None:
                raise bad_request(name, problem)
            return StructuredOutput(kind="json_schema", text=json.dumps(value))
        if isinstance(value, str):
            return StructuredOutput(kind="json_schema", text=value)
        raise bad_request(name, f"must be a JSON Schema (an object, or its text), got {json_type(value)}")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad_request(name, f"must be an array of strings, got {json_type(value)}")
        return StructuredOutput(kind="choice", choices=tuple(value))
    if not isinstance(value, str):
        raise bad_request(name, f"must be a string, got {json_type(value)}")
    if kind == "regex":
        return StructuredOutput(kind="regex", text=value)
    return StructuredOutput(kind="grammar", text=value, grammar_syntax="gbnf" if "::=" in value else "lark")


def _checked(out: StructuredOutput, name: str) -> StructuredOutput:
    """The checks that need no tokenizer (tandem_common.sampling), under the client's field name."""
    error = check_structured_output(out)
    if error is not None:
        raise bad_request(name, error.message)
    return out
