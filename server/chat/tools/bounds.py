"""Bounds that make a tool call's arguments finish: the schema a call is generated under.

A grammar guarantees that every token keeps the arguments valid, not that they ever end: a JSON
number may take digit after digit, a free string may never close, an object with no word on
`additionalProperties` may gain key after key. A model that loops (small ones do, and a random
one always does) then runs into `max_tokens` with half a call. So the arguments are generated
under a copy of the tool's schema in which what had no end gets one, and every output of the copy
is valid under the schema as sent:

- a string with no `maxLength`, `enum`, `const` or `format`: at most MAX_STRING_CHARS characters
  (or its `minLength`, if larger);
- an array with no `maxItems`: at most MAX_ITEMS items (or its `minItems`);
- a number or integer: within +-MAX_MAGNITUDE where the schema sets no bound, and a `number` with
  no `multipleOf` in steps of NUMBER_STEP (at most 6 decimals);
- an object that lists `properties` and says nothing of others (no `additionalProperties`,
  `patternProperties` or `unevaluatedProperties`, and no `allOf`, `anyOf`, `oneOf` or `$ref`
  beside them, where the intersection would change): only those properties, as OpenAI's strict
  mode asks.

The caller compiles the bounded copy and falls back to the schema as sent when the copy cannot be
built (a range holding no multiple of NUMBER_STEP, say).
"""

from __future__ import annotations

import copy
from typing import Any

MAX_STRING_CHARS = 256
MAX_ITEMS = 64
MAX_MAGNITUDE = 10**15
NUMBER_STEP = 1e-6
# keywords whose value is one subschema, a list of them, or a name -> subschema map; not `not`
# or `if`, where a narrower subschema would let more through
_ONE = ("items", "additionalProperties", "contains", "then", "else")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_OBJECT_KEYS = (
    "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf",
    "oneOf", "$ref",
)  # fmt: skip


def bounded_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose every instance has a bounded length (see the module docstring)."""
    out = copy.deepcopy(schema)
    _bound(out, in_all_of=False)
    return out


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _bound(node: Any, in_all_of: bool) -> None:
    if not isinstance(node, dict):
        return
    for key in _ONE:
        _bound(node.get(key), False)
    for key in _LIST:
        branches = node.get(key)
        if isinstance(branches, list):
            for branch in branches:
                _bound(branch, in_all_of=key == "allOf")
    for key in _MAP:
        children = node.get(key)
        if isinstance(children, dict):
            for child in children.values():
                _bound(child, False)
    if "enum" in node or "const" in node:
        return
    types = _types(node)
    if "string" in types and "maxLength" not in node and "format" not in node:
        node["maxLength"] = max(MAX_STRING_CHARS, _int(node.get("minLength")))
    if "array" in types and "maxItems" not in node:
        node["maxItems"] = max(MAX_ITEMS, _int(node.get("minItems")))
    if types & {"number", "integer"}:
        _bound_number(node, types)
    if (
        not in_all_of
        and isinstance(node.get("properties"), dict)
        and not any(key in node for key in _OPEN_OBJECT_KEYS)
    ):
        node["additionalProperties"] = False


def _bound_number(node: dict[str, Any], types: set[str]) -> None:
    low = _number(node.get("minimum"), node.get("exclusiveMinimum"))
    high = _number(node.get("maximum"), node.get("exclusiveMaximum"))
    if high is None:
        node["maximum"] = max(MAX_MAGNITUDE, (low or 0) + MAX_MAGNITUDE)
    if low is None:
        node["minimum"] = min(-MAX_MAGNITUDE, (high or 0) - MAX_MAGNITUDE)
    if "number" in types and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP


def _number(*values: Any) -> float | None:
    """The first of `values` that is a number (a bound the schema sets), else None."""
    for value in values:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
