"""Grammars users bring: llama.cpp's `grammar` (GBNF), vLLM's `structured_outputs.grammar` and
`guided_grammar` (GBNF or Lark), on both endpoints. Sampled at temperature 1 from a random model
(the grammar alone shapes the text), every answer that ends is accepted by a parser that knows
nothing of the grammar engine: `json`, Python's own `ast`, a regular expression of the shape."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import httpx
import pytest
from gptserve.server.settings import Settings

from tests.server.conftest import LiveServer, live_server

# a JSON object with two known keys, as GBNF (llama.cpp's json.gbnf, cut down to stay short)
JSON_GBNF = r"""
root   ::= "{" ws "\"name\"" ws ":" ws string ws "," ws "\"age\"" ws ":" ws number ws "}"
string ::= "\"" [a-z]{1,8} "\""
number ::= "-"? [1-9] [0-9]{0,2}
ws     ::= " "?
"""
ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-" | "*") term){0,3}
term ::= [1-9] [0-9]{0,2} | "(" [1-9] [0-9]? ("+" | "-") [1-9] [0-9]? ")"
"""
LIST_LARK = r"""
start: item{1,4}
item: "- " WORD "\n"
WORD: /[a-z]{1,10}/
"""
CHESS_GBNF = r"""
root     ::= castle | move
castle   ::= "O-O" "-O"? check?
move     ::= piece? file? "x"? file rank promotion? check?
piece    ::= [NBRQK]
file     ::= [a-h]
rank     ::= [1-8]
promotion ::= "=" [NBRQ]
check    ::= [+#]
"""
SAN = re.compile(r"(O-O(-O)?|[NBRQK]?[a-h]?x?[a-h][1-8](=[NBRQ])?)[+#]?")


def _json_ok(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"name", "age"} and isinstance(value["age"], int)


def _arithmetic_ok(text: str) -> bool:
    tree = ast.parse(text, mode="eval")  # an expression Python reads, of numbers and + - *
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def _list_ok(text: str) -> bool:
    return re.fullmatch(r"(- [a-z]{1,10}\n){1,4}", text) is not None


CASES = [
    ("grammar", JSON_GBNF, _json_ok),
    ("guided_grammar", ARITHMETIC_GBNF, _arithmetic_ok),
    ("structured_outputs", LIST_LARK, _list_ok),
    ("grammar", CHESS_GBNF, lambda text: SAN.fullmatch(text) is not None),
]


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path):
    with live_server(Settings(model=str(tiny_checkpoint), max_num_seqs=8)) as server:
        yield server


def _field(field: str, grammar: str) -> dict:
    if field == "structured_outputs":
        return {"structured_outputs": {"grammar": grammar}}
    return {field: grammar}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("field", "grammar", "accepted"), CASES, ids=["json", "arithmetic", "list", "chess"])  # fmt: skip
def test_every_sampled_answer_follows_the_grammar(
    live: LiveServer, endpoint: str, field: str, grammar: str, accepted
) -> None:
    body = {"max_tokens": 80, "temperature": 1.0, "seed": 3, "n": 6, **_field(field, grammar)}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "go"}]
    else:
        body["prompt"] = "go"
    r = httpx.post(f"{live.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions", json=body, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    ended = 0
    for choice in r.json()["choices"]:
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        if choice["finish_reason"] == "stop":  # ended by the grammar: the whole of it
            assert accepted(text), text
            ended += 1
    assert ended >= 3  # most answers end well within 80 tokens


def test_a_grammar_that_does_not_parse_is_a_400_naming_the_field(live: LiveServer) -> None:
    for field, grammar, words in [
        ("grammar", "root ::= ((", "does not parse"),
        ("guided_grammar", "root ::= undefined_rule", "not found"),
        ("structured_outputs", "start: nothing_here", "unknown name"),
        ("grammar", "", "non-empty"),
    ]:
        body = {"prompt": "go", "max_tokens": 4, **_field(field, grammar)}
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field, (field, err)
        assert words in err["message"], err


def test_a_costly_grammar_is_refused_like_a_regex(live: LiveServer) -> None:
    body = {"prompt": "go", "grammar": 'root ::= ab{600}\nab ::= "a"{600}', "max_tokens": 4}
    r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
    assert "too costly" in r.json()["error"]["message"]
