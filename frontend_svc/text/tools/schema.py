"""A tool's arguments schema as a forced call writes it: its objects closed.

JSON Schema leaves an object open unless it says otherwise: ``{"properties": {"city": ...}}``
also allows any other key. A grammar that follows that lets a small model go on writing
keys of its own until max_tokens cuts the call, so forced calls close every object that
lists its ``properties`` and says nothing about other keys (``additionalProperties``,
``patternProperties`` or ``unevaluatedProperties``): such an object takes the keys it
lists and no other. One whose ``required`` names a key it does not list stays open, since
that key must come beside the listed ones. What a schema states is kept: ``additionalProperties: true`` (pydantic's
``dict[str, Any]``) stays open, an object with no ``properties`` stays free-form.

Objects composed with others (a node with ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref``
beside its properties, or one member of an ``allOf`` of several) are left as they are:
the keys of one part are the keys another part allows, and closing each part alone would
refuse them. ``$defs`` and ``definitions`` are closed like any other schema and stay where
they are, at the root of the arguments schema, where the schema's own ``$ref``s point
(forcing.py gives each tool's arguments their own ``%json`` root for that reason).

The walk follows the schema's tree, never its references, so a recursive schema is walked
once; its depth is bounded where it entered (nesting.py, MAX_NESTING).
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_COMPOSED_KEYS = ("allOf", "anyOf", "oneOf", "$ref")
# Keywords whose value is a map of names to schemas, a list of schemas, or one schema.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)


def close_objects(schema: Any, close: bool = True) -> Any:
    """``schema`` with each object that lists properties and leaves other keys unsaid closed
    (``additionalProperties: false``); a new value, ``schema`` is not changed."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            alone = key != "allOf" or len(value) == 1  # an allOf's members share their keys
            out[key] = [close_objects(sub, close=alone) for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, (dict, list)):
            out[key] = [close_objects(s) for s in value] if isinstance(value, list) else close_objects(value)
        else:
            out[key] = value
    properties = schema.get("properties")
    if (
        close
        and isinstance(properties, dict)
        and not any(k in schema for k in _OPEN_KEYS)
        and not any(k in schema for k in _COMPOSED_KEYS)
        and _lists_what_it_requires(schema, properties)
    ):
        out["additionalProperties"] = False
    return out


def _lists_what_it_requires(schema: dict[str, Any], properties: dict[str, Any]) -> bool:
    """Whether every required key is among the properties: one that is not is a key the
    object must take beside them, so closing it would leave no valid value."""
    required = schema.get("required")
    return not isinstance(required, list) or all(k in properties for k in required)
