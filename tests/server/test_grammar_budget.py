"""Adversarial grammars from one API key cannot hurt another key's stream.

One key streams a greedy completion while another sends counted repetitions nested, huge
alternations, deep nesting, long literal sets and costly schemas. Each adversarial request is
refused with a 400 that names its field (or, where its grammar gives up later, ends alone with
that 400), or is answered with text its constraint accepts. The other stream's tokens are the
ones it gets alone, no step fails, and /health stays 200.
"""

import json
import random
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from gptserve.server.settings import Settings

from tests.server.conftest import live_server

KEY_A, KEY_B = "key-streams", "key-attacks"
STREAM_BOUND_S = 30.0  # the victim's whole stream, 48 tokens of a tiny model, attacks or not
WORDS = ["".join(random.Random(i).choice("abcdefghij") for _ in range(8)) for i in range(3000)]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


ATTACKS: list[tuple[str, object]] = [
    ("guided_regex", "(ab{1000}){1000}"),
    ("guided_regex", "a{1000}{1000}"),
    ("guided_regex", "a{600}{600}"),
    ("guided_regex", "(a|aa){500}{500}"),
    ("guided_regex", "hello world, x{5}(a{600}){600}"),
    ("guided_regex", "((a{2,50}){2,50}){2,50}"),
    ("guided_regex", "[a-z ]{1,20}(b{300}){300}"),
    ("guided_regex", "(" * 3000 + "a" + ")" * 3000),
    ("guided_regex", "(" + "|".join(WORDS) + ")"),
    ("guided_choice", WORDS),
    ("guided_json", _nested(100)),
    ("guided_json", {"anyOf": [{"const": w} for w in WORDS[:2000]]}),
    ("guided_json", {"type": "string", "pattern": "a{1000}{1000}"}),
    ("guided_json", {"type": "array", "items": {"type": "integer"}, "minItems": 5000}),
]


def _post(url: str, key: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def _stream_tokens(url: str) -> tuple[str, float]:
    body = {"prompt": "To be, or not", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start, text = time.monotonic(), []
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
                time.sleep(0.01)  # a slow reader keeps the stream open while the attacks run
    return "".join(text), time.monotonic() - start


def _check_attack(field: str, spec: object, r: httpx.Response) -> None:
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["param"] == field, err
        assert err["code"] in (None, "grammar_too_costly"), err
        return
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if field == "guided_regex" and choice["finish_reason"] == "stop":
        assert re.fullmatch(spec, choice["text"]), choice["text"]
    if field == "guided_choice":
        assert choice["text"] in spec


@pytest.mark.timeout(600)
def test_adversarial_grammars_leave_other_tenants_alone(tiny_checkpoint: Path) -> None:
    settings = Settings(model=str(tiny_checkpoint), api_keys=[KEY_A, KEY_B], max_num_seqs=8)
    with live_server(settings) as live:
        alone, _ = _stream_tokens(live.url)
        results: list[tuple[str, object, httpx.Response]] = []

        def attack() -> None:
            for field, spec in ATTACKS:
                body = {"prompt": "x", "max_tokens": 24, "temperature": 1.0, "seed": 1, "n": 2,
                        field: spec}  # fmt: skip
                results.append((field, spec, _post(live.url, KEY_B, body)))

        attacker = threading.Thread(target=attack)
        attacker.start()
        together, seconds = _stream_tokens(live.url)
        attacker.join(300)
        assert not attacker.is_alive()
        assert together == alone  # the same tokens as alone
        assert seconds < STREAM_BOUND_S
        refused = 0
        for field, spec, r in results:
            _check_attack(field, spec, r)
            refused += r.status_code == 400
        assert refused >= 8  # the counted repetitions and the oversized sets at least
        health = httpx.get(f"{live.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["failed_steps"] == 0
        # a refused grammar sent again is refused again, at once, never answered with empty text
        again = _post(live.url, KEY_B, {"prompt": "x", "guided_regex": "a{600}{600}"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "guided_regex"


def _chain(n: int, gbnf: bool) -> str:
    """n rules, each naming the next: what the grammar compiler would recurse through."""
    if gbnf:
        return (
            "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
        )
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def _ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


# (endpoint, field, value): each overflowed the compiler's native stack (SIGSEGV) before it was
# bounded; the 50k chains are past the grammar's length limit as well
DEEP = [
    ("chat/completions", "grammar", _chain(5_000, gbnf=True)),
    ("chat/completions", "grammar", _chain(50_000, gbnf=True)),
    ("completions", "guided_grammar", _chain(5_000, gbnf=False)),
    ("completions", "guided_grammar", _chain(50_000, gbnf=False)),
    ("completions", "guided_json", _ref_chain(5_000)),
    ("chat/completions", "response_format",
     {"type": "json_schema", "json_schema": {"name": "deep", "schema": _ref_chain(5_000)}}),
    ("completions", "guided_json", "NESTED"),  # 5,000 objects deep: sent as text, json can't
]  # fmt: skip


@pytest.mark.timeout(600)
def test_grammars_deep_enough_to_crash_the_compiler_are_refused(tiny_checkpoint: Path) -> None:
    settings = Settings(model=str(tiny_checkpoint), api_keys=[KEY_A, KEY_B], max_num_seqs=8)
    with live_server(settings) as live:
        alone, _ = _stream_tokens(live.url)
        answers: list[httpx.Response] = []

        def attack() -> None:
            headers = {"Authorization": f"Bearer {KEY_B}"}
            for endpoint, field, value in DEEP:
                body: dict = {"max_tokens": 8, field: value}
                if endpoint == "completions":
                    body["prompt"] = "x"
                else:
                    body["messages"] = [{"role": "user", "content": "x"}]
                text = json.dumps(body)
                if value == "NESTED":  # deeper than Python's json writes
                    deep = '{"type":"object","properties":{"a":' * 5_000 + '{"type":"string"}'
                    text = text.replace('"NESTED"', deep + "}}" * 5_000)
                url = f"{live.url}/v1/{endpoint}"
                headers["Content-Type"] = "application/json"
                answers.append(httpx.post(url, content=text, headers=headers, timeout=120))

        attacker = threading.Thread(target=attack)
        attacker.start()
        together, seconds = _stream_tokens(live.url)
        attacker.join(300)
        assert not attacker.is_alive()
        assert together == alone and seconds < STREAM_BOUND_S
        for (_, field, value), r in zip(DEEP, answers, strict=True):
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            if value == "NESTED":  # deeper than the body's JSON parser goes: refused there
                assert err["type"] == "invalid_request_error", err
                continue
            assert (err["param"], err["code"]) == (field, "grammar_too_costly"), err
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
