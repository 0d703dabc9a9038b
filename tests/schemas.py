"""JSON schemas, regexes and choices whose every output is short, shared by the structured-output tests.

Every schema here bounds its output: strings have a maxLength, a pattern or a format of fixed
length, arrays a maxItems, integers a range, objects `additionalProperties: false`. Whatever the
model's weights (a random model picks nearly uniformly among the allowed tokens), generation then
reaches the end of the grammar within BOUNDED_MAX_TOKENS tokens and finishes with "stop".
(tests/model/test_grammar.py keeps its own list, with free strings and numbers: its random walks
steer toward an end, which sampling from a model does not.)
"""

from __future__ import annotations

from typing import Any

OBJ = "object"
BOUNDED_MAX_TOKENS = 160  # at least one byte a token: more than any output below can take


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: only `properties`, all of them required unless `required` says."""
    return {
        "type": OBJ,
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def text(max_length: int = 6, min_length: int = 0) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def integer(low: int = 0, high: int = 99) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def array(items: dict[str, Any], max_items: int = 3, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


BOUNDED_SCHEMAS: list[dict[str, Any]] = [
    obj({"name": text(8), "age": integer(0, 120)}),
    obj({"t": integer(-50, -10)}),
    obj({"n": integer(1000, 1999)}),
    obj({"ok": {"type": "boolean"}}),
    obj({"nothing": {"type": "null"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"v": {"enum": ["a", 1, None, True, 2.5]}}),
    obj({"kind": {"const": "point"}, "x": integer(-9, 9)}),
    obj({"note": {"type": ["string", "null"], "maxLength": 5}}),
    obj({"code": text(5, 2)}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}}),
    obj({"hex": {"type": "string", "pattern": "^(red|green|blue)-[a-f0-9]{6}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"iso": text(3, 3)}),
    obj({"xs": array(integer(0, 9), 4, 2)}),
    obj({"tags": array({"enum": ["a", "b", "c"]}, 3)}),
    obj({"words": array(text(4), 3, 1)}),
    obj({"flags": array({"type": "boolean"}, 4)}),
    obj({"none": array(integer(), 0)}),
    obj({"grid": array(array(integer(0, 9), 3), 3)}),
    obj({"items": array(obj({"sku": text(4), "qty": integer(1, 9)}), 2)}),
    obj({"user": obj({"name": text(6), "admin": {"type": "boolean"}})}),
    obj({"a": obj({"b": obj({"c": integer(0, 9)})})}),
    obj({"id": integer(1, 999), "nick": text(5), "age": integer(0, 99)}, ["id"]),
    obj({"a": text(4), "b": integer()}, []),
    obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, ["a"]),
    obj({"mood": {"enum": ["joyeux", "très bien", "☃ snow", "日本"]}}),
    obj({"a b": integer(0, 9), 'quote"d': text(3), "clé": {"type": "boolean"}}),
    obj({k: t for k, t in zip("abcdef", [text(3), integer(), {"type": "boolean"},
                                         {"type": "null"}, {"enum": [1, 2]}, text(2)])}),  # fmt: skip
    obj({"status": {"enum": ["open", "shipped", "closed"]}, "lines": array(integer(1, 5), 3)}),
    obj({"parent": {"anyOf": [obj({"id": integer(0, 99)}), {"type": "null"}]}}),
    obj({"v": {"anyOf": [integer(0, 9), integer(100, 109)]}}),
    obj({"value": {"anyOf": [text(4), integer(), {"type": "boolean"}]}}),
    obj({"pair": {"type": "array", "prefixItems": [text(3), integer(0, 9)], "items": False}}),
    obj({"point": {"$ref": "#/$defs/point"}}) | {"$defs": {"point": obj({"x": integer(-9, 9), "y": integer(-9, 9)})}},
    obj({"start": {"$ref": "#/$defs/p"}, "end": {"$ref": "#/$defs/p"}}) | {"$defs": {"p": obj({"x": integer(0, 9)})}},
    {"allOf": [obj({"a": integer(0, 9), "b": text(3)}), {"required": ["a", "b"]}]},
    obj({"title": text(8), "year": integer(1900, 2030), "isbn": {"anyOf": [{"type": "string", "pattern": "^[0-9]{13}$"}, {"type": "null"}]}}, ["title"])
    | {"title": "Book", "description": "a book, as pydantic describes it"},
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"const": "x"}}),
    obj({"opt": integer(0, 9)}, []),
    obj({"score": integer(-100, 100), "passed": {"type": "boolean"}}),
    array(text(5), 5, 1),
    array(integer(0, 99), 4),
    {"type": "array", "prefixItems": [text(4), integer(0, 9), {"type": "boolean"}], "items": False},
    {"type": "string", "pattern": "^[a-z]{3,8}$"},
    {"type": "integer", "minimum": 1000, "maximum": 1999},
    {"enum": ["north", "south", "east", "west"]},
    {"anyOf": [obj({"n": integer(0, 9)}), text(8)]},
]  # fmt: skip

# regular expressions (the whole output matches)
REGEXES: list[str] = [
    r"[0-9]{3}-[0-9]{4}",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,5}( [a-z]{1,5}){1,3}\.",
]

CHOICES: list[list[str]] = [
    ["positive", "negative", "neutral"],
    ["A", "B", "C", "D"],
    ["red", "reddish", "red wine"],  # shared prefixes
    ["ROMEO", "JULIET", "MERCUTIO"],
]
