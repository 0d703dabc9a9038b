"""The grammar of tool calls, walked at random: whatever tokens are picked among those it allows,
the calls parse and their arguments validate against the schemas as sent."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from gptserve.engine.grammar import GrammarError, compile_constraint
from gptserve.model.tokenizers import get_tokenizer
from gptserve.server.chat.tools.bounds import (
    MAX_ITEMS,
    MAX_MAGNITUDE,
    MAX_STRING_CHARS,
    bounded_schema,
)
from gptserve.server.chat.tools.formats import HERMES, LLAMA3_JSON, ToolCallFormat
from gptserve.server.chat.tools.grammar import FunctionGrammar, tool_call_grammar
from gptserve.server.chat.tools.parser import ToolCallParser

TOK = get_tokenizer()
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "number", "minimum": 0, "maximum": 10},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
}
COUNT = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
    },
    "required": ["n", "tags"],
    "$defs": {"tag": {"enum": ["a", "b"]}},
}
SCHEMAS = {"get_weather": WEATHER, "count": COUNT}
FUNCTIONS = [FunctionGrammar(name, bounded_schema(s)) for name, s in SCHEMAS.items()]


def walk(grammar: str, seed: int, prefix: str = "", limit: int = 400) -> tuple[str, bool]:
    """Tokens picked uniformly among those the grammar allows (a random model's choices) after
    a forced `prefix`; the text, and whether the grammar ended it within `limit` tokens."""
    constraint = compile_constraint("lark", grammar, TOK)
    rng = random.Random(seed)
    ids = TOK.encode(prefix)
    for token in ids:
        constraint.advance(token)
    for _ in range(limit):
        token = rng.choice(constraint.allowed_mask().nonzero().flatten().tolist())
        if token == TOK.eot_token:
            return TOK.decode(ids), True
        constraint.advance(token)
        ids.append(token)
        if constraint.is_finished():
            return TOK.decode(ids), True
    return TOK.decode(ids), False


def check_calls(fmt: ToolCallFormat, text: str, names: set[str]) -> list[dict]:
    parser = ToolCallParser(fmt)
    message = parser.parse_all(text)
    assert parser.finish_reason("stop") == "tool_calls", text
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return message["tool_calls"]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_always_parse_and_validate(fmt: ToolCallFormat, parallel: bool) -> None:
    grammar = tool_call_grammar(fmt, FUNCTIONS, "required", parallel)
    counts = set()
    for seed in range(6):
        text, ended = walk(grammar, seed)
        assert ended, text
        calls = check_calls(fmt, text, set(SCHEMAS))
        counts.add(len(calls))
    assert counts == {1} if not parallel else max(counts) > 1


def test_a_named_function_is_the_only_one_called() -> None:
    grammar = tool_call_grammar(HERMES, FUNCTIONS[1:], "required", parallel=True)
    for seed in range(4):
        text, _ = walk(grammar, seed)
        assert {c["function"]["name"] for c in check_calls(HERMES, text, {"count"})} == {"count"}


def test_auto_leaves_text_free_until_a_call_opens_then_constrains_it() -> None:
    grammar = tool_call_grammar(HERMES, FUNCTIONS, "auto", parallel=False)
    constraint = compile_constraint("lark", grammar, TOK)
    for token in TOK.encode('Any text at all: {"name": 1} <tool_ call> </tool_call>'):
        assert constraint.is_allowed(token)
        constraint.advance(token)
    assert constraint.accepts_eos()
    for token in TOK.encode(" Now <tool_call>"):
        constraint.advance(token)
    assert not constraint.accepts_eos()  # a call has begun: it must be finished
    assert not constraint.is_allowed(TOK.encode("x")[0])
    for seed in range(4):
        text, ended = walk(grammar, seed, prefix="I will check. <tool_call>")
        assert ended and text.startswith("I will check.")
        message = ToolCallParser(HERMES).parse_all(text)
        assert message["content"] == "I will check." and len(message["tool_calls"]) == 1
        check_calls(HERMES, text, set(SCHEMAS))


def test_llama3_json_auto_is_a_call_when_the_answer_opens_with_a_brace() -> None:
    grammar = tool_call_grammar(LLAMA3_JSON, FUNCTIONS, "auto", parallel=True)
    text, ended = walk(grammar, 0, prefix="{")
    assert ended
    check_calls(LLAMA3_JSON, text, set(SCHEMAS))
    constraint = compile_constraint("lark", grammar, TOK)
    for token in TOK.encode('Plain {"name": text}'):
        constraint.advance(token)
    assert constraint.accepts_eos()


UNBOUNDED = {
    "type": "object",
    "properties": {
        "note": {"type": "string", "minLength": 300},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 5}},
        "x": {"type": "number", "exclusiveMaximum": -3},
        "inner": {"type": "object", "properties": {"a": {"type": "boolean"}}},
        "free": {"type": "object"},
        "pick": {"enum": ["a", 1]},
    },
}


def test_bounds_give_every_part_an_end_and_keep_the_schema() -> None:
    bounded = bounded_schema(UNBOUNDED)
    props = bounded["properties"]
    assert props["note"]["maxLength"] == max(300, MAX_STRING_CHARS)
    assert props["xs"]["maxItems"] == MAX_ITEMS
    assert props["xs"]["items"] == {"type": "integer", "minimum": 5, "maximum": 5 + MAX_MAGNITUDE}
    assert props["x"]["minimum"] == -3 - MAX_MAGNITUDE and props["x"]["multipleOf"] == 1e-6
    assert "maximum" not in props["x"]  # the schema's own exclusiveMaximum bounds it
    assert props["inner"]["additionalProperties"] is False
    assert bounded["additionalProperties"] is False
    assert props["free"] == {"type": "object"} and props["pick"] == {"enum": ["a", 1]}
    assert "maxLength" not in UNBOUNDED["properties"]["note"]  # the schema sent is untouched
    # every output of the bounded schema is valid under the one sent
    grammar = tool_call_grammar(HERMES, [FunctionGrammar("f", bounded)], "required", False)
    for seed in range(3):
        text, ended = walk(grammar, seed, limit=1500)
        assert ended
        arguments = ToolCallParser(HERMES).parse_all(text)["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(arguments["arguments"]), UNBOUNDED)


def test_a_grammar_that_does_not_build_is_a_grammar_error() -> None:
    with pytest.raises(GrammarError, match="invalid grammar"):
        compile_constraint("lark", "start: undefined_rule", TOK)
    with pytest.raises(GrammarError, match="Lark grammar"):
        compile_constraint("lark", {"start": 1}, TOK)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_named_function_allows_exactly_one_call(parallel: bool | None) -> None:
    from gptserve.server.chat.tools.request import read_tools
    from gptserve.server.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]  # fmt: skip
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "count"}}}  # fmt: skip
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    request = read_tools(ChatCompletionRequest(**body), TOK)
    constraint = request.constraint(HERMES, TOK)
    call = '<tool_call>\n{"name":"count","arguments":{"n":1,"tags":[]}}\n</tool_call>'
    for token in TOK.encode(call):
        constraint.advance(token)
    # after one whole call only the end may follow, never a second call
    assert constraint.allowed_mask().nonzero().flatten().tolist() == [TOK.eot_token]
