"""Ollama's API (/api/*) through the `ollama` client, unchanged, against live servers over
random-weight models: list, ps, show and version; chat and generate whole and streamed (NDJSON),
each the same greedy answer the chat path gives; raw generate as a completion; embed as
/v1/embeddings; a tool call in Ollama's shape (a ChatML model that knows tools, pushed to open a
call) and its result back; structured output under a schema; a reasoning model's thinking; Bearer
keys (/api/version open); and every error in Ollama's shape, a malformed case for every request
field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
import torch
from gptserve.model import load_checkpoint
from gptserve.model.lora.peft_format import write_peft
from gptserve.server.ollama.request import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Options,
    ShowRequest,
)
from gptserve.server.settings import Settings
from ollama._client import _copy_tools

from gptserve import __version__
from tests.lora_testing import random_adapter
from tests.server.chat.tools.test_tools import (  # noqa: F401 (fixtures)
    chatml_checkpoint,
    plain_checkpoint,
)
from tests.server.conftest import LiveServer, live_server

KEY = "ollama-key"
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 8}
# a tool whose arguments are bounded with what the client's Tool model keeps (type and enum: it
# drops maxLength, minimum and the like), so that a random model's call ends
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Bergen"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(tiny_checkpoint), api_keys=[KEY], max_num_seqs=8)) as s:
        yield s


@pytest.fixture(scope="module")
def chatml(chatml_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    """The ChatML model whose template renders tools, its <tool_call> token pushed up at the next
    step once `push` is set (Ollama's API has no tool_choice or logit_bias)."""
    with live_server(Settings(model=str(chatml_checkpoint), max_num_seqs=8)) as s:
        token = s.state.loaded.tokenizer.encode("<tool_call>")[0]
        forward = s.engine.model.forward_cached
        push = {"on": False}

        def pushed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            out = forward(*args, **kwargs)
            if push["on"] and isinstance(out, torch.Tensor):  # the answer's first token
                push["on"] = False
                out = out.clone()
                out[:, token] += 100
            return out

        s.engine.model.forward_cached = pushed
        s.push = push  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def thinking(plain_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    settings = Settings(model=str(plain_checkpoint), reasoning_parser="deepseek_r1")
    with live_server(settings) as s:
        yield s


def client_of(server: LiveServer, key: str | None = KEY) -> ollama.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return ollama.Client(host=server.url, headers=headers)


def name(server: LiveServer) -> str:
    return server.state.loaded.name


def post(server: LiveServer, path: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers["Content-Type"] = "application/json"
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=60)


def chat_completion(server: LiveServer, path: str, body: dict) -> dict:
    r = post(server, path, {"temperature": 0, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_final(obj: Any) -> None:  # noqa: ANN401
    assert obj.done is True and obj.done_reason in ("stop", "length")
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(obj, field), int) and getattr(obj, field) >= 0, field
    assert obj.prompt_eval_count > 0 and obj.eval_count >= 1


# ---- models ---------------------------------------------------------------------------------


def test_list_ps_show_and_version(live: LiveServer) -> None:
    client = client_of(live)
    (model,) = client.list().models
    assert model.model == name(live) and model.size > 0 and len(model.digest) == 64
    assert model.details.format == "safetensors" and model.details.family == "gpt2"
    assert model.details.parameter_size.endswith(("K", "M")) and model.modified_at is not None
    (running,) = client.ps().models
    assert running.model == name(live) and running.size_vram == 0 and running.expires_at
    assert running.context_length == 256
    shown = client.show(name(live))
    assert shown.capabilities == ["completion"]  # the plain template: no tools, no thinking
    assert shown.modelinfo["general.architecture"] == "gpt2"
    assert shown.modelinfo["gpt2.context_length"] == 256
    assert shown.details.family == "gpt2" and shown.template == ""  # the plain one: no Jinja
    assert shown.parameters == 'stop "\\nUser:"'  # the plain template's stop string
    assert client.show(f"{name(live)}:latest").details.family == "gpt2"
    r = httpx.get(live.url + "/api/version", timeout=10)  # open, as /health is
    assert r.status_code == 200 and r.json() == {"version": __version__}


def test_show_capabilities_of_a_template_with_tools_and_a_reasoning_model(
    chatml: LiveServer, thinking: LiveServer
) -> None:
    shown = client_of(chatml).show(name(chatml))
    assert shown.capabilities == ["completion", "tools"]
    assert "{% if tools %}" in shown.template and shown.details.family == "llama"
    assert client_of(thinking).show(name(thinking)).capabilities == ["completion", "thinking"]


def test_keys_apply_and_errors_are_ollamas(live: LiveServer) -> None:
    for key in (None, "wrong"):
        with pytest.raises(ollama.ResponseError) as err:
            client_of(live, key).list()
        assert err.value.status_code == 401
        r = post(live, "/api/chat", {"messages": HELLO}, key)
        assert r.status_code == 401 and set(r.json()) == {"error"}, r.text
    with pytest.raises(ollama.ResponseError) as err:
        client_of(live).chat("nope", HELLO)
    assert err.value.status_code == 404
    assert err.value.error == 'model "nope" not found, try pulling it first'
    r = httpx.get(live.url + "/api/nope", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 404 and set(r.json()) == {"error"}


@pytest.fixture(scope="module")
def with_adapter(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    config = load_checkpoint(tiny_checkpoint).config
    directory = tmp_path_factory.mktemp("ollama-lora") / "a"
    write_peft(random_adapter(config, "a", seed=0), directory, config, "tiny-gpt")
    settings = Settings(model=str(tiny_checkpoint), api_keys=[KEY], lora=[f"style={directory}"])
    with live_server(settings) as s:
        yield s


def test_each_lora_adapter_is_a_model(with_adapter: LiveServer) -> None:
    client = client_of(with_adapter)
    base = name(with_adapter)
    listed = client.list().models
    assert [m.model for m in listed] == [base, "style"]
    assert listed[0].details.parent_model == "" and listed[1].details.parent_model == base
    assert [m.model for m in client.ps().models] == [base, "style"]
    assert client.show("style").details.parent_model == base
    for model in (base, "style", "style:latest"):
        reply = client.chat(model, HELLO, options=GREEDY)
        assert reply.model == model
        body = {"model": model.removesuffix(":latest"), "messages": HELLO}
        expected = chat_completion(with_adapter, "/v1/chat/completions", body)
        assert reply.message.content == expected["choices"][0]["message"]["content"]


# ---- chat and generate ----------------------------------------------------------------------


def test_chat_whole_and_streamed_say_what_the_chat_path_says(live: LiveServer) -> None:
    client = client_of(live)
    expected = chat_completion(live, "/v1/chat/completions", {"messages": HELLO})
    text = expected["choices"][0]["message"]["content"]
    whole = client.chat(name(live), HELLO, options=GREEDY, keep_alive=0)
    assert whole.message.role == "assistant" and whole.message.content == text
    check_final(whole)
    assert whole.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert whole.eval_count == expected["usage"]["completion_tokens"]
    assert whole.done_reason == ("length" if expected["choices"][0]["finish_reason"] == "length" else "stop")  # fmt: skip
    parts = list(client.chat(name(live), HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and len(parts) > 2
    assert "".join(p.message.content or "" for p in parts) == text
    check_final(parts[-1])
    # raw NDJSON: one object a line
    r = post(live, "/api/chat", {"messages": HELLO, "options": GREEDY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = r.text.strip().split("\n")
    assert [json.loads(line)["done"] for line in lines] == [False] * (len(lines) - 1) + [True]


def test_chat_options_reach_the_sampler(live: LiveServer) -> None:
    client = client_of(live)
    options = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7, "num_predict": 5,
               "repeat_penalty": 1.1, "min_p": 0.05, "typical_p": 0.9, "num_ctx": 256,
               "num_thread": 2, "mirostat": 0}  # fmt: skip
    first = client.chat(name(live), HELLO, options=options)
    second = client.chat(name(live), HELLO, options=options)
    assert first.message.content == second.message.content  # the same seed
    assert first.eval_count <= 5
    body = {"messages": HELLO, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7,
            "max_tokens": 5, "repetition_penalty": 1.1, "min_p": 0.05, "typical_p": 0.9}  # fmt: skip
    r = chat_completion(live, "/v1/chat/completions", body)
    assert r["choices"][0]["message"]["content"] == first.message.content
    stopped = client.chat(name(live), HELLO, options={**GREEDY, "num_predict": 1})
    assert stopped.done_reason == "length" and stopped.eval_count == 1


def test_generate_templated_and_raw(live: LiveServer) -> None:
    client = client_of(live)
    expected = chat_completion(live, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    })  # fmt: skip
    whole = client.generate(name(live), "Hi", system="Be brief.", options=GREEDY, context=[1, 2])
    assert whole.response == expected["choices"][0]["message"]["content"]
    check_final(whole)
    parts = list(client.generate(name(live), "Hi", system="Be brief.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    check_final(parts[-1])
    completion = chat_completion(live, "/v1/completions", {"prompt": "To be, or"})
    raw = client.generate(name(live), "To be, or", raw=True, options=GREEDY)
    assert raw.response == completion["choices"][0]["text"]
    assert raw.prompt_eval_count == completion["usage"]["prompt_tokens"]
    streamed = client.generate(name(live), "To be, or", raw=True, options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == raw.response


def test_an_empty_chat_or_prompt_only_loads(live: LiveServer) -> None:
    client = client_of(live)
    assert client.chat(name(live), []).done_reason == "load"
    loaded = client.generate(name(live), keep_alive=0)
    assert loaded.done_reason == "load" and loaded.response == ""


def test_structured_output_validates_against_the_schema(live: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    client = client_of(live)
    for seed in range(3):
        answer = client.chat(name(live), HELLO, format=schema, options={"seed": seed, "num_predict": 64})  # fmt: skip
        jsonschema.validate(json.loads(answer.message.content), schema)
    parts = client.generate(name(live), "Hi", format=schema, stream=True, options={"num_predict": 64})  # fmt: skip
    jsonschema.validate(json.loads("".join(p.response for p in parts)), schema)
    as_json = client.chat(name(live), HELLO, format="json", options={"num_predict": 64, "seed": 1})
    assert as_json.done_reason == "length" or isinstance(json.loads(as_json.message.content), dict)


# ---- tools and thinking ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_tool_call_in_ollamas_shape_and_its_result_back(chatml: LiveServer, stream: bool) -> None:
    client = client_of(chatml)
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    chatml.push["on"] = True  # type: ignore[attr-defined]
    try:
        answer = client.chat(name(chatml), question, tools=[WEATHER], stream=stream,
                             options={"temperature": 0, "num_predict": 200})  # fmt: skip
        if stream:
            parts = list(answer)
            calls = [c for p in parts for c in p.message.tool_calls or []]
            check_final(parts[-1])
            content = "".join(p.message.content or "" for p in parts)
        else:
            calls, content = list(answer.message.tool_calls or []), answer.message.content
            check_final(answer)
        final = parts[-1] if stream else answer
    finally:
        chatml.push["on"] = False  # type: ignore[attr-defined]
    assert calls and content == "", (calls, content)
    # the schema as the client sends it: its Tool model keeps each property's type, enum,
    # items and description only (no bounds, no additionalProperties)
    (sent,) = [t.model_dump(exclude_none=True, by_alias=True) for t in _copy_tools([WEATHER])]
    if final.done_reason == "length" and len(calls) > 1:
        calls = calls[:-1]  # a later call cut short by num_predict: its arguments {}
    assert final.done_reason == "stop" or len(calls) >= 1
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), sent["function"]["parameters"])
        assert set(call.function.arguments) == {"city", "unit"}
    raw = post(chatml, "/api/chat", {"messages": question, "tools": [WEATHER], "stream": False,
                                     "options": {"num_predict": 1}})  # fmt: skip
    assert raw.status_code == 200, raw.text
    turns = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "content": '{"temp": 3}', "tool_name": "get_weather"},
    ]
    follow = client.chat(name(chatml), turns, tools=[WEATHER], options={"num_predict": 3})
    assert follow.done is True


def test_thinking_comes_apart_and_think_false_turns_it_off(
    thinking: LiveServer, live: LiveServer
) -> None:
    client = client_of(thinking)
    whole = client.chat(name(thinking), HELLO, think=True, options=GREEDY)
    parts = list(client.chat(name(thinking), HELLO, think=True, options=GREEDY, stream=True))
    joined = "".join(p.message.thinking or "" for p in parts)
    assert (whole.message.thinking or "") == joined
    assert (whole.message.content or "") == "".join(p.message.content or "" for p in parts)
    assert whole.message.thinking or whole.message.content
    with pytest.raises(ollama.ResponseError) as err:  # a model that does not think
        client_of(live).chat(name(live), HELLO, think=True)
    assert err.value.status_code == 400 and "does not support thinking" in err.value.error


# ---- embed ----------------------------------------------------------------------------------


def test_embed_is_the_embeddings_path(live: LiveServer) -> None:
    client = client_of(live)
    texts = ["Hello there", "To be, or not to be"]
    got = client.embed(name(live), texts)
    r = post(live, "/v1/embeddings", {"input": texts})
    assert r.status_code == 200, r.text
    want = [item["embedding"] for item in r.json()["data"]]
    assert len(got.embeddings) == len(want)
    for vector, expected in zip(got.embeddings, want):
        assert list(vector) == pytest.approx(expected, abs=1e-5)  # batched as it comes
    assert got.prompt_eval_count == r.json()["usage"]["prompt_tokens"]
    assert got.total_duration >= 0 and got.load_duration == 0
    assert len(client.embed(name(live), "one").embeddings) == 1
    long = "go " * 400  # past the 256-token context: cut unless truncate is false
    assert len(client.embed(name(live), long).embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(name(live), long, truncate=False)
    assert err.value.status_code == 400
    # the older endpoint: one prompt, one vector
    older = client.embeddings(name(live), "Hello there").embedding
    assert list(older) == pytest.approx(want[0], abs=1e-5)  # alone, not batched with another
    assert list(client.embeddings(name(live), "").embedding) == []


# ---- errors ---------------------------------------------------------------------------------

CHAT, GEN, EMBED, SHOW = "/api/chat", "/api/generate", "/api/embed", "/api/show"
EMBEDDINGS = "/api/embeddings"


def chat(**fields: object) -> dict:
    return {"messages": HELLO, "stream": False, "options": {"num_predict": 2}, **fields}


def gen(**fields: object) -> dict:
    return {"prompt": "hi", "stream": False, "options": {"num_predict": 2}, **fields}


# (path, body, status, a word the message holds)
CASES = [
    (CHAT, chat(model="nope"), 404, 'model "nope" not found'),
    (CHAT, chat(model=3), 400, "model"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "images": ["aGk="]}]), 400, "images"),
    (CHAT, chat(messages=[{"role": "user", "content": "go " * 300}]), 400, "messages"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(format="xml"), 400, "format"),
    (CHAT, chat(format={"type": "nope"}), 400, "format"),
    (CHAT, chat(keep_alive=[]), 400, "keep_alive"),
    (CHAT, chat(think="very"), 400, "think"),
    (CHAT, chat(think=True), 400, "does not support thinking"),
    (CHAT, chat(logprobs=True), 400, "logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(options=[]), 400, "options"),
    (CHAT, chat(options={"temperature": -1}), 400, "options.temperature"),
    (CHAT, chat(options={"top_p": 2}), 400, "options.top_p"),
    (CHAT, chat(options={"top_k": -5}), 400, "options.top_k"),
    (CHAT, chat(options={"min_p": 2}), 400, "options.min_p"),
    (CHAT, chat(options={"typical_p": 0}), 400, "options.typical_p"),
    (CHAT, chat(options={"seed": "x"}), 400, "options.seed"),
    (CHAT, chat(options={"stop": [""]}), 400, "options.stop"),
    (CHAT, chat(options={"num_predict": 0}), 400, "options.num_predict"),
    (CHAT, chat(options={"num_predict": 10**6}), 400, "options.num_predict"),
    (CHAT, chat(options={"num_ctx": 100_000}), 400, "options.num_ctx"),
    (CHAT, chat(options={"repeat_penalty": 0}), 400, "options.repeat_penalty"),
    (CHAT, chat(options={"presence_penalty": 3}), 400, "options.presence_penalty"),
    (CHAT, chat(options={"frequency_penalty": -3}), 400, "options.frequency_penalty"),
    (CHAT, chat(options={"mirostat": 2}), 400, "options.mirostat"),
    (GEN, gen(prompt=3), 400, "prompt"),
    (GEN, gen(prompt="go " * 300), 400, "prompt"),
    (GEN, gen(system=3), 400, "system"),
    (GEN, gen(raw="yes"), 400, "raw"),
    (GEN, gen(suffix="end"), 400, "suffix"),
    (GEN, gen(template="{{ .Prompt }}"), 400, "template"),
    (GEN, gen(context="x"), 400, "context"),
    (GEN, gen(images=["aGk="]), 400, "images"),
    (GEN, gen(raw=True, think=True), 400, "think"),
    (GEN, gen(raw=True, options={"temperature": -1}), 400, "options.temperature"),
    (EMBED, {"input": 3}, 400, "input"),
    (EMBED, {}, 400, "input"),
    (EMBED, {"input": "x", "model": "nope"}, 404, 'model "nope" not found'),
    (EMBED, {"input": "x", "truncate": "no"}, 400, "truncate"),
    (EMBED, {"input": "x", "dimensions": 5}, 400, "dimensions"),
    (EMBED, {"input": "x", "options": 1}, 400, "options"),
    (EMBED, {"input": "x", "keep_alive": None, "options": {"seed": "y"}}, 400, "seed"),
    (EMBED, {"input": "x", "keep_alive": {}}, 400, "keep_alive"),
    (EMBEDDINGS, {"prompt": 3}, 400, "prompt"),
    (EMBEDDINGS, {"model": "x"}, 400, "prompt"),
    (EMBEDDINGS, {"prompt": "x", "model": "nope"}, 404, 'model "nope" not found'),
    (EMBEDDINGS, {"prompt": "x", "options": "fast"}, 400, "options"),
    (EMBEDDINGS, {"prompt": "x", "keep_alive": [1]}, 400, "keep_alive"),
    (SHOW, {"model": "nope"}, 404, 'model "nope" not found'),
    (SHOW, {"name": 3}, 400, "name"),
    (SHOW, {"verbose": "yes"}, 400, "verbose"),
    (CHAT, b"{not json", 400, ""),
    (GEN, b"[1]", 400, ""),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "word"), CASES, ids=range(len(CASES)))
def test_malformed_request(
    live: LiveServer, path: str, body: object, status: int, word: str
) -> None:
    r = post(live, path, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()
    assert set(error) == {"error"} and isinstance(error["error"], str) and error["error"]
    assert word in error["error"], error


def test_every_request_field_has_a_malformed_case() -> None:
    """Each field's name is in the error of a case on its path (chat's stand for the fields
    generate shares with it)."""
    for request, paths in ((ChatRequest, (CHAT,)), (GenerateRequest, (GEN, CHAT)),
                           (EmbedRequest, (EMBED,)), (EmbeddingsRequest, (EMBEDDINGS,)),
                           (ShowRequest, (SHOW,))):  # fmt: skip
        words = " ".join(word for p, _, _, word in CASES if p in paths)
        missing = {f for f in request.model_fields if f not in words}
        assert not missing, f"{request.__name__} fields with no malformed case: {missing}"
    words = " ".join(word for _, _, _, word in CASES)
    missing = {f for f in Options.model_fields if f"options.{f}" not in words}
    assert not missing, f"options with no malformed case: {missing}"


def test_no_request_made_a_500(live: LiveServer) -> None:
    metrics = httpx.get(live.url + "/metrics", timeout=10).text
    assert 'status="500"' not in metrics
    assert live.wait_blocks_free()
