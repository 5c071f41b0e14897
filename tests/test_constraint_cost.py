"""The up-front cost checks of a constraint (tandem_common/constraint_cost.py), from text alone."""

from __future__ import annotations

import json

import pytest

from tandem_common.constraint_cost import json_depth, repeated_atoms, schema_patterns


@pytest.mark.parametrize(
    "pattern, added",
    [
        ("(x{1000}){999}", 998_999),
        ("((a{10}){10}){10}", 999),
        ("x{10000}", 9_999),
        ("[a-z]{1000}", 999),
        ("hello{3}", 2),  # the count takes the last character only
        ("ab(cd){2}ef{4}", 5),
        ("a{2,5}", 4),
        ("a{3,}", 2),  # the open end adds no copies
        ("(a|b){2}", 2),
        (r"\d{3}-\d{4}", 5),
        (r"\p{L}{3}", 2),  # the braces of \p{..} are the escape's, not a count
        ("[]a]{4}", 3),  # a ] first in a class is a literal
        ("[[:alpha:]]{5}", 4),
        ("[a-z&&[^x]]{3}", 2),
        ("a*b+c?", 0),
        ("a" * 65_536, 0),  # written text adds nothing, however long
        ("start: /(x{1000}){999}/", 998_999),  # a Lark terminal
        ("x\\", 0),
    ],
)
def test_repeated_atoms(pattern, added):
    assert repeated_atoms(pattern) == added


def test_json_depth_skips_strings_and_keeps_no_stack():
    assert json_depth('{"a":' * 984 + "1" + "}" * 984) == 984
    assert json_depth(json.dumps({"a": "{{{[[[", "b": ["\\"]})) == 2
    assert json_depth("[" * 100_000) == 100_000  # no recursion, however deep


def test_schema_patterns_finds_patterns_and_pattern_properties():
    schema = {
        "properties": {"a": {"type": "string", "pattern": "^x{3}$"}},
        "patternProperties": {"^k[0-9]+$": {"items": [{"pattern": "y"}]}},
    }
    assert sorted(schema_patterns(schema)) == sorted(["^x{3}$", "^k[0-9]+$", "y"])
