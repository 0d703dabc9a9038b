"""Structured output end to end: the engine under mixed batches, and the HTTP fields that ask for it.

The sweep runs 50 JSON schemas, regexes and choices through one Engine at once, with free requests
in the same steps, on the random-weight tiny model and on the bundled default model: every
constrained output must parse and satisfy its constraint. The HTTP tests cover each way to ask
(`response_format`, vLLM's `structured_outputs` and the older `guided_*` fields), streaming, the
400s for bad constraints, and combinations with the other sampling fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.grammar import Constraint, compile_constraint
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, SHAKESPEARE_DIR, Tokenizer, get_tokenizer, load_checkpoint
from gptserve.model.cpu import optimize_for_cpu
from gptserve.server.settings import Settings
from openai import OpenAI

from tests.schemas import BOUNDED_MAX_TOKENS, BOUNDED_SCHEMAS, CHOICES, REGEXES
from tests.server.conftest import API_KEY, LiveServer, live_server

C, H = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Describe a customer as JSON."}]
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["x", "tag"],
    "additionalProperties": False,
}


# ---- the engine: 50 schemas, regexes and choices, with free requests in the same steps ------


@dataclass
class Ask:
    """One engine request and how to check its output."""

    kind: str  # "json", "regex", "choice" or "free"
    spec: Any = None
    params: SamplingParams = field(default_factory=SamplingParams)
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None

    def check(self) -> None:
        out = "".join(self.text)
        assert self.error is None, self.error
        if self.kind == "free":
            assert self.finish in ("stop", "length")
            return
        assert self.finish == "stop", (self.kind, self.spec, out)
        if self.kind == "json":
            jsonschema.validate(json.loads(out), self.spec)
        elif self.kind == "regex":
            assert re.fullmatch(self.spec, out), (self.spec, out)
        else:
            assert out in self.spec, (self.spec, out)


def sweep(model: GPT, tok: Tokenizer) -> list[Ask]:
    """Every schema, regex and choice (two completions each for some) plus free requests, all
    admitted together, run to the end; returns them with their outputs."""
    engine = Engine(model, tok, EngineConfig(max_num_seqs=96, max_batch_tokens=2048))
    vocab = model.config.vocab_size
    asks: list[Ask] = []

    def constrained(kind: str, spec: Any, constraint: Constraint, i: int) -> Ask:
        greedy = i % 5 == 4  # some greedy rows among the sampled ones
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0, seed=i, max_tokens=BOUNDED_MAX_TOKENS,
            n=2 if i % 7 == 0 else 1, logprobs=2 if i % 3 == 0 else None, constraint=constraint,
        )  # fmt: skip
        return Ask(kind, spec, params)

    for i, schema in enumerate(BOUNDED_SCHEMAS):
        c = compile_constraint("json", schema, tok, vocab_size=vocab)
        asks.append(constrained("json", schema, c, i))
    for i, regex in enumerate(REGEXES):
        c = compile_constraint("regex", regex, tok, vocab_size=vocab)
        asks.append(constrained("regex", regex, c, 100 + i))
    for i, choices in enumerate(CHOICES):
        c = compile_constraint("choice", choices, tok, vocab_size=vocab)
        asks.append(constrained("choice", choices, c, 200 + i))
    for i in range(0, len(asks), 8):  # free requests, interleaved
        asks.insert(i, Ask("free", params=SamplingParams(max_tokens=24, seed=i)))

    prompt = tok.encode("A record:\n")
    runs: dict[tuple[str, int], Ask] = {}
    for r, ask in enumerate(asks):
        engine.add_request(f"r{r}", prompt, ask.params)
        for index in range(ask.params.n):
            runs[(f"r{r}", index)] = ask if index == 0 else Ask(ask.kind, ask.spec, ask.params)
    steps, widest = 0, 0
    while engine.has_work():
        for event in engine.step():
            run = runs[(event.request_id, event.index)]
            run.text.append(event.text)
            run.finish = event.finish_reason or run.finish
            run.error = event.error or run.error
        steps += 1
        widest = max(widest, engine.num_running)
        assert steps < 10 * BOUNDED_MAX_TOKENS, "the sweep did not end"
    assert widest > len(asks) // 2  # they did run together
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return list(runs.values())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer("gpt2")


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_every_constrained_output_is_valid(
    which: str, tiny_checkpoint: Path, tok: Tokenizer
) -> None:
    path = tiny_checkpoint if which == "tiny" else SHAKESPEARE_DIR
    model = optimize_for_cpu(load_checkpoint(path, dtype=torch.float32))
    runs = sweep(model, tok)
    assert sum(r.kind == "json" for r in runs) >= 50
    failures = []
    for run in runs:
        try:
            run.check()
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{run.kind} {json.dumps(run.spec)[:80]}: {exc}"[:300])
    assert not failures, "\n".join(failures)


# ---- HTTP: each way to ask --------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    settings = Settings(model=str(tiny_checkpoint), api_keys=[API_KEY], max_num_seqs=16)
    with live_server(settings) as server:
        yield server


def post(live: LiveServer, path: str, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(live.url + path, json=body, headers=headers, timeout=60)


def answer(live: LiveServer, path: str, **body: Any) -> list[dict]:
    r = post(live, path, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "point", "schema": schema}}


# (path, fields, check on the output text)
WAYS = [
    (H, {"response_format": json_schema_format(POINT)}, "point"),
    (C, {"response_format": json_schema_format(POINT)}, "point"),
    (H, {"structured_outputs": {"json": POINT}}, "point"),
    (C, {"structured_outputs": {"json": json.dumps(POINT)}}, "point"),  # a schema as JSON text
    (C, {"guided_json": POINT}, "point"),
    (H, {"guided_json": json.dumps(POINT)}, "point"),
    (C, {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
    (H, {"guided_regex": r"(yes|no)!"}, r"(yes|no)!"),
    (C, {"structured_outputs": {"choice": ["up", "down"]}}, ["up", "down"]),
    (H, {"guided_choice": ["left", "right"]}, ["left", "right"]),
]


def check_text(out: str, want: Any) -> None:
    if want == "point":
        jsonschema.validate(json.loads(out), POINT)
    elif isinstance(want, str):
        assert re.fullmatch(want, out), out
    else:
        assert out in want


@pytest.mark.parametrize(("path", "fields", "want"), WAYS, ids=range(len(WAYS)))
def test_each_way_to_ask(live: LiveServer, path: str, fields: dict, want: Any) -> None:
    body = {"prompt": "Hi"} if path == C else {"messages": USER}
    choices = answer(live, path, **body, **fields, max_tokens=60, seed=1)
    assert choices[0]["finish_reason"] == "stop"
    check_text(text_of(choices[0]), want)


def test_json_object(live: LiveServer, tok: Tokenizer) -> None:
    """JSON mode: any object. A free object has no end a random model finds, so a bias toward
    `{` and `}` closes it at once; the point is that what comes back is one object."""
    braces = {str(tok.encode(b)[0]): 100 for b in "{}"}
    for path, body in ((C, {"prompt": "Hi"}), (H, {"messages": USER})):
        for fields in ({"response_format": {"type": "json_object"}},
                       {"structured_outputs": {"json_object": True}}):  # fmt: skip
            choices = answer(live, path, **body, **fields, logit_bias=braces, max_tokens=20)
            assert json.loads(text_of(choices[0])) == {}
            assert choices[0]["finish_reason"] == "stop"
        # unbiased, the object is still one as far as it goes
        choices = answer(live, path, **body, response_format={"type": "json_object"}, max_tokens=4)
        assert text_of(choices[0]).startswith("{")


def test_text_format_is_no_constraint(live: LiveServer) -> None:
    choices = answer(live, C, prompt="Hi", response_format={"type": "text"}, max_tokens=5, seed=2)
    free = answer(live, C, prompt="Hi", max_tokens=5, seed=2)
    assert choices[0]["text"] == free[0]["text"]


def test_openai_client(live: LiveServer) -> None:
    """What current clients send: `response_format`, and `structured_outputs` in extra_body."""
    client = OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY)
    chat = client.chat.completions.create(
        model="tiny-gpt", messages=USER, max_tokens=60, response_format=json_schema_format(POINT)
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), POINT)
    done = client.completions.create(
        model="tiny-gpt", prompt="Mood:", max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["happy", "sad"]}},
    )  # fmt: skip
    assert done.choices[0].text in ("happy", "sad")


@pytest.mark.parametrize("path", [C, H])
def test_streaming(live: LiveServer, path: str) -> None:
    body = {"prompt": "Hi"} if path == C else {"messages": USER}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    request = {**body, "response_format": json_schema_format(POINT), "stream": True}
    pieces, finish = [], None
    with httpx.stream("POST", live.url + path, json=request, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            finish = choice["finish_reason"] or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(pieces)), POINT)


# ---- combinations with the other fields ----------------------------------------------------


def test_max_tokens_before_the_grammar_closes_is_length(live: LiveServer) -> None:
    long = {"type": "string", "minLength": 40, "maxLength": 50}
    for path, body in ((C, {"prompt": "Hi"}), (H, {"messages": USER})):
        for max_tokens in (1, 5):
            choices = answer(live, path, **body, guided_json=long, max_tokens=max_tokens)
            assert choices[0]["finish_reason"] == "length"
            assert choices[0]["text" if path == C else "message"]


def test_max_tokens_one_that_completes_is_stop(live: LiveServer) -> None:
    """A one-token choice is complete after that token: "stop", not "length"."""
    choices = answer(live, C, prompt="Grade:", guided_choice=["A", "B"], max_tokens=1)
    assert choices[0]["finish_reason"] == "stop"
    assert choices[0]["text"] in ("A", "B")


def test_logprobs_are_of_the_masked_distribution(live: LiveServer) -> None:
    """Only allowed tokens appear as alternatives, and their probabilities sum to one."""
    grades = ["A", "B", "C", "D"]
    choices = answer(live, C, prompt="Grade:", guided_choice=grades, logprobs=8, max_tokens=3)
    top = choices[0]["logprobs"]["top_logprobs"][0]
    assert set(top) == set(grades)  # 4 of the 8 asked: the others were impossible
    assert math.fsum(math.exp(v) for v in top.values()) == pytest.approx(1.0, abs=1e-4)
    chat = answer(
        live, H, messages=USER, structured_outputs={"choice": grades},
        logprobs=True, top_logprobs=6, max_tokens=3,
    )  # fmt: skip
    entry = chat[0]["logprobs"]["content"][0]
    assert {t["token"] for t in entry["top_logprobs"]} == set(grades)
    assert all(math.isfinite(t["logprob"]) for t in entry["top_logprobs"])


def test_n_completions_each_valid(live: LiveServer) -> None:
    choices = answer(live, H, messages=USER, guided_json=POINT, n=3, max_tokens=60)
    assert len(choices) == 3
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), POINT)


def test_stop_string_cuts_the_output(live: LiveServer) -> None:
    """A stop string still ends the output where it appears (as in vLLM): the text is cut."""
    choices = answer(live, C, prompt="Hi", guided_json=POINT, stop=[","], max_tokens=60)
    assert choices[0]["finish_reason"] == "stop"
    out = choices[0]["text"]
    assert out.startswith('{"x":') and "," not in out


def test_echo_keeps_the_prompt_before_the_output(live: LiveServer) -> None:
    prompt = "Point: "
    choices = answer(
        live, C, prompt=prompt, echo=True, logprobs=1, guided_json=POINT, max_tokens=60
    )
    out = choices[0]["text"]
    assert out.startswith(prompt)
    jsonschema.validate(json.loads(out[len(prompt) :]), POINT)
    assert choices[0]["logprobs"]["token_logprobs"][0] is None  # the echoed prompt's first token


def test_many_prompts_share_one_constraint(live: LiveServer) -> None:
    choices = answer(live, C, prompt=["a", "b", "c"], guided_regex="[a-z]{2}[0-9]", max_tokens=20)
    assert len(choices) == 3
    assert all(re.fullmatch("[a-z]{2}[0-9]", c["text"]) for c in choices)


def test_min_tokens_and_other_fields(live: LiveServer) -> None:
    """min_tokens, penalties, top-k/p, a tiny temperature: the grammar still wins."""
    fields = {
        "min_tokens": 3, "presence_penalty": 2, "frequency_penalty": 2, "repetition_penalty": 1.5,
        "top_k": 3, "top_p": 0.5, "min_p": 0.2, "ignore_eos": True,
    }  # fmt: skip
    for temperature in (1.0, 1e-300, 0.0):
        choices = answer(
            live, C, prompt="Hi", guided_json=POINT, max_tokens=60, temperature=temperature,
            **fields,
        )  # fmt: skip
        jsonschema.validate(json.loads(choices[0]["text"]), POINT)


COMBOS = ["logprobs", "n", "stop", "max_tokens_1", "echo"]  # echo last: completions only


def collect(live: LiveServer, path: str, body: dict) -> dict[int, tuple[str, str]]:
    """{choice index: (text, finish_reason)}, from a stream or a whole answer."""
    if not body.get("stream"):
        return {c["index"]: (text_of(c), c["finish_reason"]) for c in answer(live, path, **body)}
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", live.url + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    piece = c.get("text") or c.get("delta", {}).get("content") or ""
                    texts.setdefault(c["index"], []).append(piece)
                    finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    return {i: ("".join(t), finish[i]) for i, t in texts.items()}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "combo"), [(p, c) for p in (C, H) for c in COMBOS[: 5 - (p == H)]]
)
def test_combinations_on_both_endpoints(
    live: LiveServer, path: str, combo: str, stream: bool
) -> None:
    """logprobs, n=2, stop strings, max_tokens 1, echo (completions only): each with a schema,
    whole or streamed."""
    prompt = "Point: "
    body: dict[str, Any] = {"prompt": prompt} if path == C else {"messages": USER}
    body |= {"guided_json": POINT, "max_tokens": 60, "stream": stream}
    body |= {
        "logprobs": {"logprobs": 3} if path == C else {"logprobs": True, "top_logprobs": 3},
        "n": {"n": 2},
        "stop": {"stop": [","]},
        "max_tokens_1": {"max_tokens": 1},
        "echo": {"echo": True},
    }[combo]
    out = collect(live, path, body)
    assert sorted(out) == list(range(body.get("n", 1)))
    for text, finish in out.values():
        if combo == "echo":
            assert text.startswith(prompt)
            text = text[len(prompt) :]
        if combo == "max_tokens_1":
            assert finish == "length" and text and '{"x":'.startswith(text)  # one token of it
        elif combo == "stop":
            assert finish == "stop" and text.startswith('{"x":') and "," not in text
        else:
            assert finish == "stop"
            jsonschema.validate(json.loads(text), POINT)


# ---- bad constraints: a 400 naming the field, and the engine keeps serving -----------------

BAD = [
    ({"response_format": json_schema_format({"type": "object", "properties": 5})},
     "response_format", "invalid"),
    ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
     "response_format", "uniqueItems"),
    ({"response_format": json_schema_format({"type": "integer", "minimum": 5, "maximum": 1})},
     "response_format", "minimum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"response_format": json_schema_format({"$ref": "#/$defs/missing"})}, "response_format", ""),
    ({"guided_json": {"type": "string", "format": "phone"}}, "guided_json", "phone"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "guided_json", "oneOf"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regular expression"),
    ({"guided_regex": "a(?=b)"}, "guided_regex", "look"),
    ({"guided_regex": "(a)\\1"}, "guided_regex", ""),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", 5]}, "guided_choice", ""),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs", "nope"),
    ({"structured_outputs": {}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"grammar": "start: a"}}, "structured_outputs", "grammar: invalid grammar"),
    ({"structured_outputs": {"whitespace_pattern": " *", "json": {}}}, "structured_outputs", ""),
    ({"structured_outputs": {"json": POINT, "disable_additional_properties": True}},
     "structured_outputs", "additionalProperties"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "at most one"),
    ({"structured_outputs": {"rgx": "a"}}, "structured_outputs", ""),
    ({"structured_outputs": "json"}, "structured_outputs", ""),
    ({"guided_grammar": "root ::= (("}, "guided_grammar", "does not parse"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"guided_json": POINT, "structured_outputs": {"json": POINT}}, "guided_json", "at most one"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "at most one"),
    ({"guided_choice": ["a"], "min_tokens": 1, "stop_token_ids": [64]}, "stop_token_ids", ""),
    ({"guided_regex": "a" * 200_001}, "guided_regex", "longer"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD, ids=range(len(BAD)))
@pytest.mark.parametrize("path", [C, H])
def test_bad_constraint_is_a_400_naming_the_field(
    live: LiveServer, path: str, fields: dict, param: str, words: str
) -> None:
    body = {"prompt": "Hi"} if path == C else {"messages": USER}
    r = post(live, path, **body, **fields, max_tokens=5)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert words in err["message"], err
    assert "\n" not in err["message"] and len(err["message"]) < 400


def test_engine_keeps_serving_after_everything(live: LiveServer) -> None:
    """After the cases above (bad, constrained, free): the engine is healthy and holds no block."""
    assert live.engine.num_failed_steps == 0
    assert httpx.get(live.url + "/health", timeout=10).json()["status"] == "ok"
    choices = answer(live, C, prompt="Hi", max_tokens=3)
    assert choices[0]["finish_reason"] == "length"
    assert live.wait_blocks_free()


# ---- the bundled default model over HTTP --------------------------------------------------


def test_default_model_over_http() -> None:
    with live_server(Settings(model=str(SHAKESPEARE_DIR), max_num_seqs=8)) as server:
        for schema in BOUNDED_SCHEMAS[::10]:
            body = {
                "messages": [{"role": "user", "content": "ROMEO, answer in JSON."}],
                "response_format": json_schema_format(schema), "max_tokens": BOUNDED_MAX_TOKENS,
                "temperature": 0.8, "seed": 3,
            }  # fmt: skip
            r = httpx.post(server.url + H, json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        r = httpx.post(
            server.url + C, json={"prompt": "JULIET:", "guided_choice": CHOICES[3], "max_tokens": 8}
        )
        assert r.json()["choices"][0]["text"] in CHOICES[3]
