"""Tool calling through the `openai` client against live servers over random-weight models: a
Llama-shaped one whose ChatML template renders tools (its tokenizer has <tool_call> as a token,
as Qwen's has) and a GPT-2-shaped one with the plain template, which gets the default system
block. Calls, their arguments, streaming, the loop back with tool results, /metrics, and a 400
naming the field for each malformed request."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from gptserve.model import GPT, ModelConfig, save_checkpoint
from gptserve.server.settings import Settings
from openai import OpenAI
from tokenizers import AddedToken

from tests.conftest import byte_level_bpe, save_tiny_gpt
from tests.server.conftest import LiveServer, live_server

# ChatML with tools, as Qwen's and Hermes' templates write it
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and tools %}{% continue %}{% endif %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object"}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def chatml_checkpoint(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Path:
    """A tiny random Llama-shaped model with a byte-level BPE tokenizer: ChatML's special
    tokens, <tool_call> and </tool_call> as added (non-special) tokens, and CHATML_TOOLS."""
    text = shakespeare_path.read_text(encoding="utf-8")[:60_000]
    chunks = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    rust = byte_level_bpe(chunks, 400, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    rust.add_tokens([AddedToken("<tool_call>", special=False),
                     AddedToken("</tool_call>", special=False)])  # fmt: skip
    path = tmp_path_factory.mktemp("chatml") / "tiny-chatml"
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=rust.get_vocab_size(), block_size=2048, n_layer=2, n_head=4, n_embd=64,
        intermediate_size=96, bias=False, tie_embeddings=False, pos_encoding="rotary",
        norm="rmsnorm", activation="swiglu", rope_theta=10000.0, tokenizer="hf",
    )  # fmt: skip
    tokenizer_config = {"eos_token": "<|im_end|>", "chat_template": CHATML_TOOLS}
    save_checkpoint(GPT(config), path, {"tokenizer_config.json": json.dumps(tokenizer_config)})
    rust.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2-shaped model with room for the default tool block in its context."""
    return save_tiny_gpt(tmp_path_factory.mktemp("plain") / "tiny-plain", block_size=1024)


@pytest.fixture(scope="module")
def chatml(chatml_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(chatml_checkpoint), max_num_seqs=8)) as live:
        yield live


@pytest.fixture(scope="module")
def plain(plain_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(plain_checkpoint), max_num_seqs=8)) as live:
        yield live


def client_of(live: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def tool_call_token(live: LiveServer) -> int:
    return live.state.loaded.tokenizer.encode("<tool_call>")[0]


def ask(live: LiveServer, stream: bool, **fields: Any) -> dict:
    """One choice as {"content", "tool_calls", "finish_reason"}, from a whole answer or from a
    stream's chunks put together (checking each call's first chunk names it)."""
    client = client_of(live)
    fields = {"model": live.state.loaded.name, "max_tokens": 300, **fields}
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "tool_calls": calls,
                "finish_reason": choice.finish_reason}  # fmt: skip
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        if delta.content:
            content = (content or "") + delta.content
        for item in delta.tool_calls or []:
            if item.index not in calls:
                assert item.id and item.type == "function" and item.function.name
                calls[item.index] = {"id": item.id, "type": "function",
                                     "function": {"name": item.function.name, "arguments": ""}}  # fmt: skip
            else:
                assert item.id is None and not item.function.name
            calls[item.index]["function"]["arguments"] += item.function.arguments or ""
    return {"content": content, "tool_calls": list(calls.values()), "finish_reason": finish}


def check_calls(answer: dict, schemas: dict[str, dict], parallel: bool = True) -> None:
    """Whole calls, each to a known function with arguments valid under its schema."""
    assert answer["finish_reason"] == "tool_calls", answer
    assert answer["content"] is None and answer["tool_calls"]
    assert parallel or len(answer["tool_calls"]) == 1
    for call in answer["tool_calls"]:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def replies(answer: dict) -> list[dict]:
    """The assistant message back, and a tool message answering each of its calls."""
    out = [{"role": "assistant", "content": answer["content"], "tool_calls": answer["tool_calls"]}]
    for call in answer["tool_calls"]:
        out.append({"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 3}'})
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("which", ["chatml", "plain"])
def test_the_model_calls_gets_the_results_and_answers_in_text(
    request: pytest.FixtureRequest, which: str, stream: bool
) -> None:
    live: LiveServer = request.getfixturevalue(which)
    first = ask(live, stream, messages=USER, tools=TOOLS, tool_choice="required", seed=1)
    check_calls(first, SCHEMAS)
    # the same seed answers the same calls, whole or streamed
    other = ask(live, not stream, messages=USER, tools=TOOLS, tool_choice="required", seed=1)
    assert [c["function"] for c in other["tool_calls"]] == [c["function"] for c in first["tool_calls"]]  # fmt: skip
    bias = {str(tool_call_token(live)): -100} if which == "chatml" else None
    second = ask(
        live, stream, messages=USER + replies(first), tools=TOOLS, tool_choice="auto",
        max_tokens=12, seed=2, logit_bias=bias,
    )  # fmt: skip
    assert second["tool_calls"] == [] and second["finish_reason"] in ("stop", "length")
    assert isinstance(second["content"], str) and second["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_constrains_a_call_once_the_model_opens_one(chatml: LiveServer, stream: bool) -> None:
    # pushed to open a call at once; from there on the grammar holds it to a valid one
    fields = dict(messages=USER, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    bias = {str(tool_call_token(chatml)): 100}
    for seed in range(3):
        answer = ask(chatml, stream, logit_bias=bias, seed=seed, **fields)
        check_calls(answer, SCHEMAS, parallel=False)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, arrays, enums, numbers, strings and booleans nested at random, with bounds
    (and, now and then, a number or object whose end the server's bounds must supply)."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    kind = rng.choice(kinds + (["array", "object"] if depth < 2 else []))
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 10)}
    if kind in ("integer", "number"):
        if rng.random() < 0.25:
            return {"type": kind}
        low = rng.randint(-1000, 1000)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 3, 4.5, None, True, "日本"], rng.randint(1, 4))}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}  # fmt: skip
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["alpha", "beta", "gamma", "delta", "eps"], rng.randint(1, 4))
    schema: dict = {
        "type": "object",
        "properties": {name: random_schema(rng, depth) for name in names},
        "required": rng.sample(names, rng.randint(0, len(names))),
    }
    if rng.random() < 0.7:
        schema["additionalProperties"] = False
    return schema


def test_arguments_validate_over_30_generated_schemas(chatml: LiveServer) -> None:
    rng = random.Random(7)
    schemas = [random_object(rng, 1) for _ in range(30)]

    def call(i: int) -> tuple[dict, dict]:
        tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": schemas[i]}}
        other = {"type": "function", "function": {"name": "other", "parameters": schemas[i - 1]}}
        choice = {"type": "function", "function": {"name": f"tool_{i}"}} if i % 2 else "required"
        answer = ask(
            chatml, i % 3 == 0, messages=USER, tools=[tool, other], tool_choice=choice,
            max_tokens=800, temperature=1.0, seed=i,
        )  # fmt: skip
        return answer, {f"tool_{i}": schemas[i], "other": schemas[i - 1]}

    with ThreadPoolExecutor(8) as pool:
        for i, (answer, by_name) in enumerate(pool.map(call, range(30))):
            check_calls(answer, by_name)
            if i % 2:  # a named function is the one called
                assert {c["function"]["name"] for c in answer["tool_calls"]} == {f"tool_{i}"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_is_called_exactly_once(plain: LiveServer, stream: bool) -> None:
    # no parallel_tool_calls, as instructor's TOOLS mode sends it: still one call, to that name
    name = TOOLS[1]["function"]["name"]
    choice = {"type": "function", "function": {"name": name}}
    for seed in range(3):
        answer = ask(
            plain, stream, messages=USER, tools=TOOLS, tool_choice=choice, seed=seed,
            temperature=1.0, max_tokens=400,
        )  # fmt: skip
        check_calls(answer, SCHEMAS, parallel=False)
        assert answer["tool_calls"][0]["function"]["name"] == name


def test_a_streamed_answer_of_calls_opens_with_null_content(plain: LiveServer) -> None:
    def opening(choice: object) -> dict:
        body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "stream": True,
                "max_tokens": 300}  # fmt: skip
        with httpx.stream("POST", f"{plain.url}/v1/chat/completions", json=body, timeout=60) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        return json.loads(first[6:])["choices"][0]["delta"]

    named = {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}
    assert opening(named) == {"role": "assistant", "content": None}
    assert opening("required") == {"role": "assistant", "content": None}
    assert opening("auto") == {"role": "assistant", "content": ""}  # it may answer in text


def test_one_call_without_parallel_calls_and_none_means_text(plain: LiveServer) -> None:
    for seed in range(3):
        answer = ask(
            plain, False, messages=USER, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, seed=seed,
        )  # fmt: skip
        check_calls(answer, SCHEMAS, parallel=False)
    answer = ask(plain, True, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert answer["tool_calls"] == [] and answer["finish_reason"] == "length"


def tool_calls_counted(live: LiveServer) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    match = re.search(r"^gptserve_tool_calls_total (\S+)$", text, re.MULTILINE)
    assert match, "gptserve_tool_calls_total is missing"
    return float(match.group(1))


def test_metrics_count_the_calls_returned(plain: LiveServer) -> None:
    before = tool_calls_counted(plain)
    made = 0
    for stream in (False, True):
        answer = ask(plain, stream, messages=USER, tools=TOOLS, tool_choice="required", seed=4)
        made += len(answer["tool_calls"])
    assert tool_calls_counted(plain) - before == made > 0


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
BAD = [
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools", "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function"),
    ({"tools": [TIME, TIME]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
     "tools", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools", "parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not one of the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
     "tool_choice", "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
    ({"messages": USER + [{"role": "tool", "content": "3"}]}, "messages", "tool_call_id"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_time", "arguments": "{oops"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not JSON"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{**CALL, "id": None}]}]},
     "messages", "messages[1].tool_calls[0].id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
     "messages", "only an assistant message"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
     "messages", "only a tool message"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "said"), BAD, ids=range(len(BAD)))
def test_a_malformed_tool_request_is_a_400_naming_the_field(
    plain: LiveServer, fields: dict, param: str, said: str
) -> None:
    body = {"model": plain.state.loaded.name, "messages": USER, "max_tokens": 4, **fields}
    r = httpx.post(f"{plain.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and said in error["message"], error


def test_without_tools_none_and_auto_ask_for_what_happens_anyway(plain: LiveServer) -> None:
    for choice in ("none", "auto"):
        answer = ask(plain, False, messages=USER, tool_choice=choice, max_tokens=4)
        assert answer["tool_calls"] == [] and isinstance(answer["content"], str)
