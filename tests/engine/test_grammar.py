"""Structured-output constraints on the real GPT-2 vocabulary: random walks over allowed tokens.

Each walk picks uniformly among the allowed tokens (seeded), ends at EOS with some chance once
the grammar allows it, and after a token budget steers toward an end: EOS when allowed, else
(every other step) the first allowed closer of `"`, `]`, `}`, else a random allowed one-character
token. Every walk must finish, and every finished output must satisfy its constraint.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from gptserve.engine.grammar import (
    JSON_OBJECT_SCHEMA,
    Constraint,
    ConstraintViolation,
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
    bitmask_to_bool,
    cache_info,
    compile_constraint,
    fill_bitmask,
)
from gptserve.model import get_tokenizer

from tests.schemas import BOUNDED_MAX_TOKENS, BOUNDED_SCHEMAS

BUDGET = 30  # free tokens before the walk steers toward an end
CAP = 1500  # a walk still going after this many tokens fails the test


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def walker(tok):
    closers = [tok.encode(s)[0] for s in ('"', "]", "}")]
    one_char = np.array(
        [len(b) == 1 and 32 <= b[0] < 127 for b in map(tok.token_bytes, range(tok.vocab_size))]
    )
    eos = tok.eot_token

    def walk(constraint: Constraint, seed: int) -> tuple[str, bool]:
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for step in range(CAP):
            allowed = constraint.allowed_mask().numpy()  # numpy: one thread, no pool wake-ups
            ids = np.flatnonzero(allowed[: tok.vocab_size])
            ids = ids[ids != eos]
            if allowed[eos] and (
                not len(ids) or step >= BUDGET or torch.rand((), generator=gen) < 0.25
            ):
                constraint.advance(eos)
                assert constraint.is_finished()
                return tok.decode(out), True
            assert len(ids), "a constraint allowed no token at all"
            if step >= BUDGET:
                close = [t for t in closers if allowed[t]]
                if close and torch.rand((), generator=gen) < 0.5:
                    ids = np.array(close[:1])
                elif one_char[ids].any():
                    ids = ids[one_char[ids]]
            token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
            constraint.advance(token)
            out.append(token)
        return tok.decode(out), False

    return walk


OBJ = "object"
SCHEMAS: list[dict] = [
    {"type": OBJ, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": OBJ, "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": OBJ, "properties": {"t": {"type": "integer", "minimum": -50, "maximum": -10}}, "required": ["t"]},
    {"type": OBJ, "properties": {"x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}, "required": ["x"]},
    {"type": OBJ, "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"]},
    {"type": OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": OBJ, "properties": {"v": {"enum": ["a", 1, None, True, 2.5]}}, "required": ["v"]},
    {"type": OBJ, "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}}, "required": ["kind", "x"]},
    {"type": OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": OBJ, "properties": {"nothing": {"type": "null"}}, "required": ["nothing"]},
    {"type": OBJ, "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"]},
    {"type": OBJ, "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 5}}, "required": ["code"]},
    {"type": OBJ, "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": OBJ, "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}}, "required": ["sku"]},
    {"type": OBJ, "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": OBJ, "properties": {"mail": {"type": "string", "format": "email"}}, "required": ["mail"]},
    {"type": OBJ, "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": OBJ, "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}}, "required": ["xs"]},
    {"type": OBJ, "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}, "required": ["tags"]},
    {
        "type": OBJ,
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": OBJ,
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": OBJ,
        "properties": {"user": {"type": OBJ, "properties": {"name": {"type": "string"}, "admin": {"type": "boolean"}}, "required": ["name", "admin"]}},
        "required": ["user"],
    },
    {
        "type": OBJ,
        "properties": {
            "a": {"type": OBJ, "properties": {"b": {"type": OBJ, "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}
        },
        "required": ["a"],
    },
    {"type": OBJ, "properties": {"id": {"type": "integer"}, "nick": {"type": "string"}, "age": {"type": "integer"}}, "required": ["id"]},
    {"type": OBJ, "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}},
    {"type": OBJ, "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "required": ["a"], "additionalProperties": False},
    {"type": OBJ, "additionalProperties": {"type": "integer", "minimum": 0}},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}], "items": False},
    {"anyOf": [{"type": OBJ, "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}, {"type": "string", "maxLength": 8}]},
    {
        "$defs": {"point": {"type": OBJ, "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}},
        "type": OBJ,
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    {
        "$defs": {"node": {"type": OBJ, "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
    {"allOf": [{"type": OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}, "maxItems": 3},
    {"type": OBJ, "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]},
    {"type": OBJ, "properties": {"mood": {"enum": ["joyeux", "très bien", "☃ snow", "日本"]}}, "required": ["mood"]},
    {
        "type": OBJ,
        "properties": {k: {"type": t} for k, t in zip("abcdefghij", ["string", "integer", "number", "boolean", "null"] * 2)},
        "required": list("abcdefghij"),
        "additionalProperties": False,
    },
    {
        "type": OBJ,
        "properties": {
            "orders": {
                "type": "array",
                "items": {
                    "type": OBJ,
                    "properties": {"status": {"enum": ["open", "shipped", "closed"]}, "lines": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
                    "required": ["status", "lines"],
                },
                "maxItems": 3,
            }
        },
        "required": ["orders"],
    },
    {"type": OBJ, "properties": {"parent": {"anyOf": [{"type": OBJ, "properties": {"id": {"type": "integer"}}, "required": ["id"]}, {"type": "null"}]}}, "required": ["parent"]},
    {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 5},
    {"type": "string", "pattern": "^[a-z]{3,8}$"},
    {"type": "integer", "minimum": 1000, "maximum": 1999},
    {"type": "number"},
    {"enum": ["north", "south", "east", "west"]},
    {"type": OBJ, "properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]},
    {"type": OBJ, "properties": {"iso": {"type": "string", "minLength": 3, "maxLength": 3}}, "required": ["iso"]},
    {"type": OBJ, "properties": {"none": {"type": "array", "maxItems": 0}}, "required": ["none"]},
    {"type": OBJ, "properties": {"hex": {"type": "string", "pattern": "^(red|green|blue)-[a-f0-9]{6}$"}}, "required": ["hex"]},
    {"type": OBJ, "properties": {"a b": {"type": "integer"}, 'quote"d': {"type": "string"}, "clé": {"type": "boolean"}}, "required": ["a b", 'quote"d', "clé"]},
    {"type": OBJ, "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "integer", "minimum": 100, "maximum": 109}]}}, "required": ["v"]},
    {
        "title": "Book",
        "description": "A book, as pydantic would describe it",
        "type": OBJ,
        "properties": {
            "title": {"title": "Title", "type": "string", "description": "the title"},
            "year": {"title": "Year", "type": "integer", "default": 2000},
            "isbn": {"anyOf": [{"type": "string", "pattern": "^[0-9]{13}$"}, {"type": "null"}], "default": None},
        },
        "required": ["title"],
    },
    {"type": OBJ, "properties": {"scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}, "minItems": 1, "maxItems": 4}}, "required": ["scores"]},
]  # fmt: skip


def test_fifty_schemas_listed():
    assert len(SCHEMAS) == 50


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_schema(tok, walker, i):
    schema = SCHEMAS[i]
    constraint = compile_constraint("json", schema, tok)
    text, finished = walker(constraint, seed=i)
    assert finished, f"walk did not finish: {text[-200:]!r}"
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("i", range(len(BOUNDED_SCHEMAS)))
def test_bounded_schema_ends_unsteered(tok, i):
    """The engine tests' schemas end within their token budget on uniform picks alone."""
    constraint = compile_constraint("json", BOUNDED_SCHEMAS[i], tok)
    gen = torch.Generator().manual_seed(i)
    for _ in range(3):
        c, out = constraint.fork(), []
        while not c.is_finished():
            assert len(out) < BOUNDED_MAX_TOKENS, tok.decode(out)
            ids = np.flatnonzero(c.allowed_mask().numpy())
            token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
            c.advance(token)
            if token == tok.eot_token:
                break
            out.append(token)
        jsonschema.validate(json.loads(tok.decode(out)), BOUNDED_SCHEMAS[i])


def test_json_object(tok, walker):
    for seed in range(6):
        text, finished = walker(compile_constraint("json", JSON_OBJECT_SCHEMA, tok), seed)
        assert finished
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize(
    "pattern",
    [
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
        r"\(\d{3}\) \d{3}-\d{4}",
        r"[a-z]+@[a-z]+\.(com|org|net)",
        r"[A-Z][a-z]{1,9}( [a-z]{1,9}){1,4}\.",
        r"(yes|no|maybe)!?",
        r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    ],
)
def test_regex(tok, walker, pattern):
    for seed in range(3):
        text, finished = walker(compile_constraint("regex", pattern, tok), seed)
        assert finished
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize(
    "choices",
    [
        ["yes", "no"],
        ["a", "ab", "abc"],
        ['say "hi"', "back\\slash", "line\nbreak"],
        ["naïve ☃", "日本語"],
    ],
)
def test_choice(tok, walker, choices):
    for seed in range(4):
        text, finished = walker(compile_constraint("choice", choices, tok), seed)
        assert finished
        assert text in choices


@pytest.mark.parametrize(
    "schema,words",
    [
        ({"type": "strin"}, "strin"),
        ({"type": OBJ, "properties": 5}, "properties"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "pattern": "(("}, "unclosed"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "string", "format": "no-such-format"}, "format"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ],
)
def test_bad_schema(tok, schema, words):
    """The request field each error names: tests/server/test_structured_request.py."""
    with pytest.raises(GrammarError) as err:
        compile_constraint("json", schema, tok)
    assert words.lower() in err.value.message.lower()


@pytest.mark.parametrize("schema", [None, [], True, "{}", {"x": float("nan")}])
def test_a_schema_that_is_not_a_json_object(tok, schema):
    with pytest.raises(GrammarError):
        compile_constraint("json", schema, tok)


@pytest.mark.parametrize("pattern", ["((", "a{3,2}", "(?<=a)b", r"(a)\1", r"\bword", "[z-a]"])
def test_bad_regex(tok, pattern):
    with pytest.raises(GrammarError) as err:
        compile_constraint("regex", pattern, tok)
    assert "\n" not in err.value.message


@pytest.mark.parametrize("choices", [[], "yes", ["a", 1], None])
def test_bad_choice(tok, choices):
    with pytest.raises(GrammarError):
        compile_constraint("choice", choices, tok)


def test_an_unknown_kind(tok):
    with pytest.raises(GrammarError, match="unknown constraint kind"):
        compile_constraint("json_schema", {"type": "integer"}, tok)  # the server's wrapper


def test_cache_and_fork(tok):
    schema = {"type": OBJ, "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    compile_constraint("json", schema, tok)
    hits = cache_info().hits
    a = compile_constraint("json", schema, tok)
    assert cache_info().hits == hits + 1
    for t in tok.encode('{"k":'):
        a.advance(t)
    b = a.fork()
    a.advance(tok.encode("7")[0])
    assert not b.is_allowed(tok.encode("}")[0])  # b is still before the value
    b.advance(tok.encode("12")[0])
    a.advance(tok.encode("}")[0])
    assert a.accepts_eos() and a.is_finished() and not b.accepts_eos()
    assert a.allowed_mask().nonzero()[:, 0].tolist() == [tok.eot_token]
    fresh = compile_constraint("json", schema, tok)  # copies from the cache start untouched
    assert fresh.is_allowed(tok.encode("{")[0]) and not fresh.accepts_eos()


@pytest.mark.parametrize("parallel", [False, True])
def test_batch_fill_matches_rows(tok, parallel):
    cons = [
        compile_constraint("json", JSON_OBJECT_SCHEMA, tok),
        None,
        compile_constraint("regex", r"[0-9]+", tok),
        compile_constraint("choice", ["alpha", "beta"], tok),
    ]
    cons[2].advance(tok.encode("42")[0])
    bitmask = allocate_bitmask(5, tok.vocab_size)
    bitmask.zero_()
    fill_bitmask(cons, bitmask, parallel=parallel)
    mask = bitmask_to_bool(bitmask, tok.vocab_size)
    assert mask.shape == (5, tok.vocab_size)
    assert mask[1].all() and not mask[4].any()  # None row: everything; row 4 untouched
    for i in (0, 2, 3):
        assert torch.equal(mask[i], cons[i].allowed_mask())
    assert mask[2, tok.eot_token] and not mask[0, tok.eot_token]
    logits = torch.zeros(5, tok.vocab_size)
    apply_bitmask(logits, bitmask)
    assert torch.equal(torch.isfinite(logits), mask)


def test_violation_and_padded_vocab(tok):
    c = compile_constraint("choice", ["yes", "no"], tok, vocab_size=50304)
    assert c.allowed_mask().shape == (50304,)
    assert not c.allowed_mask()[tok.vocab_size :].any()
    with pytest.raises(ConstraintViolation):
        c.advance(tok.encode(" maybe")[0])
    # a broken constraint allows only EOS, so the sampler never sees a row of -inf
    assert c.allowed_mask().nonzero()[:, 0].tolist() == [tok.eot_token]
