"""Output constraints and their checkers, shared by the engine-level and the gRPC tests.

Each checker uses an independent implementation of its format: ``jsonschema`` for the
schema, ``re`` for the regex, ``lark``'s own parser for the grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark

from tandem_common.sampling import StructuredOutput

# Keys the demo tokenizer spells in one or two tokens, so a whole object fits in ~50 tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "age": {"type": "number", "minimum": 0, "maximum": 10},
        "day": {"enum": ["sun", "rain"]},
        "way": {"type": "string", "maxLength": 4},
        "home": {
            "type": "object",
            "properties": {"east": {"type": "integer", "minimum": 1, "maximum": 5}, "rain": {"type": "boolean"}},
            "required": ["east", "rain"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "age", "day", "way", "home", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2,3}"
CHOICES = ("red", "green", "blue sky", "yellow-ish")
ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
_ARITHMETIC_PARSER = lark.Lark(ARITHMETIC, start="start")

CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", REGEX),
    "choice": StructuredOutput("choice", choices=CHOICES),
    "grammar": StructuredOutput("grammar", ARITHMETIC),
}


def _json_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _arithmetic_valid(text: str) -> bool:
    try:
        _ARITHMETIC_PARSER.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


VALID = {
    "json_schema": _json_valid,
    "regex": lambda text: re.fullmatch(REGEX, text) is not None,
    "choice": lambda text: text in CHOICES,
    "grammar": _arithmetic_valid,
}
