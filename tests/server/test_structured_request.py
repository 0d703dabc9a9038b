"""server.structured_request: the request fields that ask for structured output, each error naming
its field (the HTTP cases, as 400s, are in test_structured.py)."""

from __future__ import annotations

import pytest
from gptserve.engine.errors import RequestError
from gptserve.model import get_tokenizer
from gptserve.server.protocol import CompletionRequest
from gptserve.server.structured_request import (
    constraint_from_fields,
    constraint_from_request,
)

OBJ = "object"


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "strin"},
        {"type": OBJ, "properties": 5},
        {"type": "integer", "minimum": 5, "maximum": 2},
        {"$ref": "#/$defs/missing"},
        {"not": {"type": "string"}},
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    ],
)
def test_bad_schema_names_the_field_it_came_in(tok, schema):
    with pytest.raises(RequestError) as err:
        wrapper = {"name": "x", "schema": schema}
        constraint_from_request(
            tok, response_format={"type": "json_schema", "json_schema": wrapper}
        )
    assert err.value.param == "response_format"
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, guided_json=schema)
    assert err.value.param == "guided_json"


@pytest.mark.parametrize(
    "spec",
    [None, [], {"name": "x"}, {"name": "x", "schema": True}, {"name": "bad name!", "schema": {}}],
)
def test_bad_json_schema_wrapper(tok, spec):
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, response_format={"type": "json_schema", "json_schema": spec})
    assert err.value.param == "response_format"


@pytest.mark.parametrize("pattern", ["((", "a{3,2}", "(?<=a)b", r"(a)\1", r"\bword", "[z-a]"])
def test_bad_regex(tok, pattern):
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, guided_regex=pattern)
    assert err.value.param == "guided_regex"
    assert "\n" not in err.value.message


@pytest.mark.parametrize("choices", [[], "yes", ["a", 1]])
def test_bad_choice(tok, choices):
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, guided_choice=choices)
    assert err.value.param == "guided_choice"


def test_from_request(tok):
    assert constraint_from_request(tok) is None
    assert constraint_from_request(tok, response_format={"type": "text"}) is None
    c = constraint_from_request(tok, response_format={"type": "json_object"})
    assert c is not None and c.kind == "json_object"
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    assert constraint_from_request(tok, response_format=schema).kind == "json_schema"
    assert constraint_from_request(tok, guided_json='{"type": "boolean"}').kind == "json"
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, guided_json="{not json")
    assert err.value.param == "guided_json"
    assert constraint_from_request(tok, guided_regex="a+").kind == "regex"
    assert constraint_from_request(tok, guided_choice=["a"]).kind == "choice"
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, response_format={"type": "xml"})
    assert err.value.param == "response_format"
    with pytest.raises(RequestError) as err:
        constraint_from_request(tok, guided_regex="a", guided_choice=["a"])
    assert err.value.param == "guided_choice"


def test_the_constraint_is_the_one_asked_for(tok):
    asked = constraint_from_request(tok, guided_choice=["yes", "no"])
    allowed = asked.constraint.allowed_mask()
    assert allowed[tok.encode("yes")[0]] and not allowed[tok.encode(" maybe")[0]]


def body(**fields) -> CompletionRequest:  # noqa: ANN003
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_a_parsed_body_asks_the_same_ways(tok):
    assert constraint_from_fields(body(), tok) is None
    assert constraint_from_fields(body(response_format={"type": "text"}), tok) is None
    asked = constraint_from_fields(body(structured_outputs={"json_object": True}), tok)
    assert (asked.kind, asked.param) == ("json_object", "structured_outputs")
    asked = constraint_from_fields(body(guided_json={"type": "integer"}), tok)
    assert (asked.kind, asked.param) == ("json", "guided_json")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_grammar": "root ::= (("}, "guided_grammar", "does not parse"),
        ({"structured_outputs": {}}, "structured_outputs", "needs one of"),
        ({"structured_outputs": {"grammar": "start: a"}}, "structured_outputs", "grammar: invalid grammar"),
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", ".regex: invalid"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"guided_json": {"type": OBJ}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ],
)  # fmt: skip
def test_a_parsed_body_is_refused_naming_the_field(tok, fields, param, words):
    with pytest.raises(RequestError) as err:
        constraint_from_fields(body(**fields), tok)
    assert err.value.param == param and words in err.value.message
    assert "\n" not in err.value.message
