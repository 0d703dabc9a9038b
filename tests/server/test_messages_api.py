"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the `anthropic`
client, unchanged, against live servers over the random-weight GPT-2-shaped model of
tests/server/chat/tools/test_tools.py (the plain template, which gets the default tool block): a
greedy message says what the same chat completion says, whole and streamed (the named events in
order, their deltas joining to the final message), max_tokens and stop sequences, a tool round
trip (a named tool's input valid under its schema, then its tool_result), a reasoning model's
thought as a thinking block, count_tokens, x-api-key and Bearer keys, and every error in
Anthropic's shape (a catalogue with a malformed case for every request field)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic import Anthropic
from gptserve.server.messages.request import CountTokensRequest, MessagesRequest
from gptserve.server.settings import Settings

from tests.conftest import save_tiny_gpt
from tests.server.chat.tools.test_tools import WEATHER, plain_checkpoint  # noqa: F401 (fixture)
from tests.server.conftest import LiveServer, live_server

KEY = "messages-key"
M, COUNT = "/v1/messages", "/v1/messages/count_tokens"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
ZONE = {"enum": ["utc", "local"]}
TIME_TOOL = {
    "name": "get_time",
    "description": "The time now",
    "input_schema": {"type": "object", "properties": {"zone": ZONE}, "required": ["zone"],
                     "additionalProperties": False},
}  # fmt: skip
HELLO = [{"role": "user", "content": "Hello there"}]
QUESTION = "What is the weather in Oslo?"
# sampling fields through extra_body: anthropic 2.x dropped them from create()'s keywords
GREEDY = {"temperature": 0}
# a plain chat template (chat_template.txt) whose stop strings are common letters: the model
# ends its turn within a few tokens, as a template's turn end ends it
ENDING_TEMPLATE = "{name}: {content}\n\n---\nAssistant:\n---\ne\na\no\ni\nt\nn\ns\nr\n"


@pytest.fixture(scope="module")
def plain(plain_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    settings = Settings(model=str(plain_checkpoint), max_num_seqs=8, api_keys=[KEY])
    with live_server(settings) as live:
        yield live


@pytest.fixture(scope="module")
def thinking(plain_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    """The same model read as DeepSeek-R1 writes: everything before </think> is its thought."""
    settings = Settings(model=str(plain_checkpoint), reasoning_parser="deepseek_r1")
    with live_server(settings) as live:
        yield live


@pytest.fixture(scope="module")
def ending(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = save_tiny_gpt(tmp_path_factory.mktemp("ending") / "tiny-ending")
    (path / "chat_template.txt").write_text(ENDING_TEMPLATE, encoding="utf-8")
    with live_server(Settings(model=str(path))) as live:
        yield live


def client_of(live: LiveServer, key: str = KEY, **options: Any) -> Anthropic:  # noqa: ANN401
    return Anthropic(base_url=live.url, api_key=key, max_retries=0, **options)


def name(live: LiveServer) -> str:
    return live.state.loaded.name


def text_of(message: Any) -> str:  # noqa: ANN401
    return "".join(block.text for block in message.content if block.type == "text")


def chat_text(live: LiveServer, messages: list[dict], max_tokens: int, **fields: Any) -> str:  # noqa: ANN401
    """What the greedy chat completion of `messages` says."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def streamed(live: LiveServer, **fields: Any) -> tuple[str, Any]:  # noqa: ANN401
    """A stream's text_stream joined, and its final message (messages.stream)."""
    with client_of(live).messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    return text, final


def raw_events(live: LiveServer, body: dict) -> list[tuple[str, dict]]:
    """A stream's events as (name, data), each checked to be `event: NAME` and `data: {...}`
    with the same `type` inside (`body`: a client call's fields, extra_body's among them)."""
    body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(f"{live.url}{M}", json={**body, "stream": True}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        kind, obj = head[7:], json.loads(data[6:])
        assert obj["type"] == kind
        events.append((kind, obj))
    return events


def check_event_order(events: list[tuple[str, dict]]) -> list[dict]:
    """message_start, ping, each block started, written and stopped in turn, message_delta,
    message_stop; returns the blocks the deltas built."""
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    blocks, i = [], 2
    while kinds[i] == "content_block_start":
        block = dict(events[i][1]["content_block"])
        assert events[i][1]["index"] == len(blocks)
        i += 1
        json_text = ""
        while kinds[i] == "content_block_delta":
            data = events[i][1]
            assert data["index"] == len(blocks)
            delta = data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                json_text += delta["partial_json"]
            i += 1
        if block["type"] == "tool_use":
            block["input"] = json.loads(json_text) if json_text else {}
        assert kinds[i] == "content_block_stop" and events[i][1]["index"] == len(blocks)
        blocks.append(block)
        i += 1
    assert blocks and i == len(events) - 2
    return blocks


# ---- text ----------------------------------------------------------------------------------


def test_a_message_says_what_the_chat_completion_says(plain: LiveServer) -> None:
    expected = chat_text(plain, HELLO, 8)
    message = client_of(plain).messages.create(
        model=name(plain), messages=HELLO, max_tokens=8, extra_body=GREEDY
    )
    assert re.fullmatch(r"msg_[0-9a-f]{32}", message.id)
    assert message.type == "message" and message.role == "assistant"
    assert message.model == name(plain)
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == expected
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 0


def test_system_and_content_blocks_are_the_chat_messages(plain: LiveServer) -> None:
    system = "You are terse."
    user = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    message = client_of(plain).messages.create(
        model=name(plain), system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": user}], max_tokens=6, metadata={"user_id": "u-1"},
        extra_body={"temperature": 0, "top_k": 40, "top_p": 1.0},
    )  # fmt: skip
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "Hello\nthere"}]
    assert text_of(message) == chat_text(plain, chat, 6)
    count = client_of(plain).messages.count_tokens(
        model=name(plain), system=system, messages=[{"role": "user", "content": user}]
    )
    assert count.input_tokens == message.usage.input_tokens


def test_a_turn_that_ends_is_end_turn(ending: LiveServer) -> None:
    message = client_of(ending).messages.create(
        model=name(ending), messages=HELLO, max_tokens=60, extra_body=GREEDY
    )
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens < 60
    # the template's stop strings are no stop sequence of the request's
    again = client_of(ending).messages.create(
        model=name(ending), messages=HELLO, max_tokens=60, stop_sequences=["zqx"], extra_body=GREEDY
    )
    assert again.stop_reason == "end_turn" and text_of(again) == text_of(message)


def test_a_stop_sequence_ends_the_message_and_is_named(plain: LiveServer) -> None:
    client = client_of(plain)
    fields = dict(model=name(plain), messages=HELLO, extra_body=GREEDY)
    full = text_of(client.messages.create(max_tokens=16, **fields))
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    message = client.messages.create(max_tokens=16, stop_sequences=["zqxv", stop], **fields)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == cut
    text, final = streamed(plain, max_tokens=16, stop_sequences=["zqxv", stop], **fields)
    assert text == cut == text_of(final)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_streamed_message_is_the_whole_one(plain: LiveServer) -> None:
    fields = dict(model=name(plain), messages=HELLO, max_tokens=12, extra_body=GREEDY)
    whole = client_of(plain).messages.create(**fields)
    text, final = streamed(plain, **fields)
    assert text == text_of(final) == text_of(whole) and text
    assert final.id.startswith("msg_") and final.id != whole.id
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens
    # the wire format: each event named on its line and in its data, in Anthropic's order
    events = raw_events(plain, fields)
    blocks = check_event_order(events)
    assert blocks == [{"type": "text", "text": text_of(whole)}]
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"] == {"output_tokens": 12}


# ---- tools ---------------------------------------------------------------------------------


def check_tool_use(message: Any, name_: str) -> Any:  # noqa: ANN401
    """The one tool_use block of a message that had to call `name_`."""
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == name_, message.content
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", calls[0].id)
    schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[name_]["input_schema"]
    jsonschema.validate(calls[0].input, schema)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    return calls[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_tool_round_trip(plain: LiveServer, stream: bool) -> None:
    client = client_of(plain)
    fields = dict(model=name(plain), tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=300,
                  extra_body=GREEDY)  # fmt: skip
    question = [{"role": "user", "content": QUESTION}]
    choice = {"type": "tool", "name": "get_weather"}
    if stream:
        _, first = streamed(plain, messages=question, tool_choice=choice, **fields)
        whole = client.messages.create(messages=question, tool_choice=choice, **fields)
        same = [b.model_dump(exclude={"id"}, exclude_none=True) for b in whole.content]
        assert [b.model_dump(exclude={"id"}, exclude_none=True) for b in first.content] == same
        events = raw_events(plain, {**fields, "messages": question, "tool_choice": choice})
        blocks = check_event_order(events)
        assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == same
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    else:
        first = client.messages.create(messages=question, tool_choice=choice, **fields)
    call = check_tool_use(first, "get_weather")
    # the result back: accepted, and the greedy answer is the chat completion's of the same turns
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"temp": 3}'}
    turns = [*question, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [result]}]  # fmt: skip
    follow = client.messages.create(messages=turns, tool_choice={"type": "none"},
                                    **{**fields, "max_tokens": 10})  # fmt: skip
    assert follow.stop_reason in ("max_tokens", "end_turn") and text_of(follow)
    calls = [{"id": call.id, "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.input)}}]  # fmt: skip
    chat = [*question, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
              "parameters": t["input_schema"]}} for t in (WEATHER_TOOL, TIME_TOOL)]  # fmt: skip
    assert text_of(follow) == chat_text(plain, chat, 10, tools=tools, tool_choice="none")


def test_any_tool_and_a_tool_result_of_blocks(plain: LiveServer) -> None:
    client = client_of(plain)
    fields = dict(model=name(plain), tools=[TIME_TOOL], max_tokens=300, extra_body=GREEDY)
    first = client.messages.create(
        messages=[{"role": "user", "content": "Time?"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, **fields,
    )  # fmt: skip
    call = check_tool_use(first, "get_time")
    result = {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
              "content": [{"type": "text", "text": "no clock"}]}  # fmt: skip
    turns = [{"role": "user", "content": "Time?"},
             {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [result, {"type": "text", "text": "Sorry?"}]}]  # fmt: skip
    follow = client.messages.create(messages=turns, **{**fields, "max_tokens": 4})
    assert follow.usage.output_tokens >= 1


def test_count_tokens_is_the_messages_input_tokens(plain: LiveServer) -> None:
    client = client_of(plain)
    question = [{"role": "user", "content": QUESTION}]
    for more in ({}, {"system": "Be brief."}, {"tools": [WEATHER_TOOL, TIME_TOOL]}):
        count = client.messages.count_tokens(model=name(plain), messages=question, **more)
        message = client.messages.create(model=name(plain), messages=question, max_tokens=1,
                                         **more)  # fmt: skip
        assert count.input_tokens == message.usage.input_tokens > 0
    assert (
        client.messages.count_tokens(model=name(plain), messages=question,
                                     tools=[WEATHER_TOOL]).input_tokens
        > client.messages.count_tokens(model=name(plain), messages=question).input_tokens
    )  # fmt: skip


# ---- thinking ------------------------------------------------------------------------------


def test_a_reasoning_models_thought_is_a_thinking_block(thinking: LiveServer) -> None:
    fields = dict(model=name(thinking), messages=HELLO, max_tokens=10, extra_body=GREEDY)
    whole = client_of(thinking, "unused").messages.create(**fields)
    assert [block.type for block in whole.content] == ["thinking"]
    thought = whole.content[0].thinking
    assert thought and whole.content[0].signature == ""
    assert whole.stop_reason == "max_tokens"
    events = raw_events(thinking, fields)
    assert check_event_order(events) == [{"type": "thinking", "thinking": thought,
                                          "signature": ""}]  # fmt: skip
    with client_of(thinking, "unused").messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    # without thinking the same tokens are the answer's text
    plain = client_of(thinking, "unused").messages.create(thinking={"type": "disabled"}, **fields)
    assert [block.type for block in plain.content] == ["text"] and text_of(plain) == thought
    # an earlier answer's thinking block is accepted and not shown again
    turns = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in whole.content]
                      + [{"type": "text", "text": "Hi"}]}, {"role": "user", "content": "And?"}]  # fmt: skip
    bare = [*HELLO, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "And?"}]
    client = client_of(thinking, "unused")
    assert (client.messages.count_tokens(model=name(thinking), messages=turns).input_tokens
            == client.messages.count_tokens(model=name(thinking), messages=bare).input_tokens)  # fmt: skip


# ---- keys and errors -----------------------------------------------------------------------


def check_anthropic_error(body: Any, kind: str) -> str:  # noqa: ANN401
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_keys_by_x_api_key_or_bearer_and_a_wrong_key_is_a_401(plain: LiveServer) -> None:
    fields = dict(model=name(plain), messages=HELLO, max_tokens=1)
    assert client_of(plain).messages.create(**fields).usage.output_tokens == 1  # x-api-key
    bearer = Anthropic(base_url=plain.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**fields).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as info:
        client_of(plain, "wrong").messages.create(**fields)
    assert info.value.status_code == 401
    message = check_anthropic_error(info.value.body, "authentication_error")
    assert "x-api-key" in message
    with pytest.raises(anthropic.AuthenticationError):
        client_of(plain, "wrong").messages.count_tokens(model=name(plain), messages=HELLO)
    # the key works on the OpenAI paths too, and their errors keep OpenAI's shape
    r = httpx.get(f"{plain.url}/v1/models", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200
    r = httpx.get(f"{plain.url}/v1/models", headers={"x-api-key": "wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_an_image_block_is_a_400_in_anthropics_shape(plain: LiveServer) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    content = [{"type": "text", "text": "What is this?"}, image]
    with pytest.raises(anthropic.BadRequestError) as info:
        client_of(plain).messages.create(
            model=name(plain), messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert info.value.status_code == 400
    message = check_anthropic_error(info.value.body, "invalid_request_error")
    assert "image" in message and "messages[0].content[1]" in message


def test_a_missing_max_tokens_and_an_unknown_model(plain: LiveServer) -> None:
    client = client_of(plain)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(  # (a timeout given: the client's default is from max_tokens)
            model=name(plain), messages=HELLO, max_tokens=anthropic.omit, timeout=30
        )
    assert "max_tokens" in check_anthropic_error(info.value.body, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-sonnet-4-5", messages=HELLO, max_tokens=4)
    assert "claude-sonnet-4-5" in check_anthropic_error(info.value.body, "not_found_error")


def test_an_error_after_the_stream_started_is_an_error_event(
    plain: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gptserve.server.errors import APIError
    from gptserve.server.messages import api

    async def failing(accepted: Any) -> Any:  # noqa: ANN401
        yield {"delta": {"content": "a"}, "finish_reason": None}
        raise APIError(503, "the engine failed this request: boom", code="engine_error")

    monkeypatch.setattr(api, "stream_pieces", failing)
    with pytest.raises(anthropic.APIStatusError) as info:
        with client_of(plain).messages.stream(model=name(plain), messages=HELLO,
                                              max_tokens=4) as stream:  # fmt: skip
            "".join(stream.text_stream)
    assert "boom" in check_anthropic_error(info.value.body, "api_error")


def test_other_paths_keep_openais_error_shape(plain: LiveServer) -> None:
    headers = {"x-api-key": KEY}
    r = httpx.post(f"{plain.url}/v1/chat/completions", json={"messages": []}, headers=headers,
                   timeout=10)  # fmt: skip
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.get(f"{plain.url}{M}", headers=headers, timeout=10)  # wrong method
    assert r.status_code == 405
    check_anthropic_error(r.json(), "invalid_request_error")


# (path, fields replacing a valid body's, status, error type, what the message names)
def _body(**fields: Any) -> dict:  # noqa: ANN401
    return {"model": "tiny-plain", "messages": HELLO, "max_tokens": 2, **fields}


USER_BLOCKS = lambda *blocks: [{"role": "user", "content": list(blocks)}]  # noqa: E731
CASES = [
    (M, {"model": 3}, 400, "invalid_request_error", "model"),
    (M, {"model": "other"}, 404, "not_found_error", "other"),
    (M, {"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    (M, {"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    (M, {"max_tokens": "5"}, 400, "invalid_request_error", "max_tokens"),
    (M, {"max_tokens": 10**6}, 400, "invalid_request_error", "max_tokens"),
    (M, {"messages": []}, 400, "invalid_request_error", "messages"),
    (M, {"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "messages"),
    (M, {"messages": [{"role": "user", "content": 3}]}, 400, "invalid_request_error", "messages"),
    (M, {"messages": USER_BLOCKS({"type": "video"})}, 400, "invalid_request_error", "messages"),
    (M, {"messages": USER_BLOCKS({"type": "document", "source": {}})}, 400,
     "invalid_request_error", "document"),
    (M, {"messages": USER_BLOCKS({"type": "tool_use", "id": "x", "name": "f", "input": {}})},
     400, "invalid_request_error", "tool_use"),
    (M, {"messages": [*HELLO, {"role": "assistant", "content": "Hi"}]}, 400,
     "invalid_request_error", "prefill"),
    (M, {"messages": [{"role": "user", "content": "go " * 3000}]}, 400, "invalid_request_error",
     "messages"),
    (M, {"system": 5}, 400, "invalid_request_error", "system"),
    (M, {"system": [{"type": "image"}]}, 400, "invalid_request_error", "system"),
    (M, {"stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
    (M, {"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
    (M, {"stop_sequences": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error",
     "stop_sequences"),
    (M, {"temperature": -1}, 400, "invalid_request_error", "temperature"),
    (M, {"temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    (M, {"top_p": 2}, 400, "invalid_request_error", "top_p"),
    (M, {"top_k": -5}, 400, "invalid_request_error", "top_k"),
    (M, {"top_k": 1.5}, 400, "invalid_request_error", "top_k"),
    (M, {"metadata": {"user_id": 5}}, 400, "invalid_request_error", "metadata"),
    (M, {"metadata": "u"}, 400, "invalid_request_error", "metadata"),
    (M, {"stream": "yes"}, 400, "invalid_request_error", "stream"),
    (M, {"tools": [{"name": "f"}]}, 400, "invalid_request_error", "input_schema"),
    (M, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools"),
    (M, {"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "tools[0].name"),
    (M, {"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, 400,
     "invalid_request_error", "tools"),
    (M, {"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    (M, {"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    (M, {"tools": [TIME_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "tool_choice"),
    (M, {"thinking": {"type": "maybe"}}, 400, "invalid_request_error", "thinking"),
    (M, {"thinking": {"type": "enabled", "budget_tokens": "x"}}, 400, "invalid_request_error",
     "thinking"),
    (M, {"mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error", "mcp_servers"),
    (M, {"container": "c"}, 400, "invalid_request_error", "container"),
    (COUNT, {"max_tokens": None, "model": 3}, 400, "invalid_request_error", "model"),
    (COUNT, {"max_tokens": None, "messages": None}, 400, "invalid_request_error", "messages"),
    (COUNT, {"max_tokens": None, "system": [1]}, 400, "invalid_request_error", "system"),
    (COUNT, {"max_tokens": None, "tools": {"name": "f"}}, 400, "invalid_request_error", "tools"),
    (COUNT, {"max_tokens": None, "tool_choice": "auto"}, 400, "invalid_request_error",
     "tool_choice"),
    (COUNT, {"max_tokens": None, "thinking": {"type": "enabled", "budget_tokens": []}}, 400,
     "invalid_request_error", "thinking"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "status", "kind", "named"), CASES,
                         ids=range(len(CASES)))  # fmt: skip
def test_malformed_request(
    plain: LiveServer, path: str, fields: dict, status: int, kind: str, named: str
) -> None:
    body = {k: v for k, v in _body(**fields).items() if v is not None}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(plain.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert named in check_anthropic_error(r.json(), kind)


def test_every_request_field_has_a_malformed_case() -> None:
    for request, path in ((MessagesRequest, M), (CountTokensRequest, COUNT)):
        named = {case[4] for case in CASES if case[0] == path}
        if request is MessagesRequest:
            named |= {case[4] for case in CASES if case[0] == COUNT}
        missing = set(request.model_fields) - named
        assert not missing, f"{request.__name__} fields with no malformed case: {missing}"


def test_body_limits_and_bad_json_are_anthropic_shaped(plain: LiveServer) -> None:
    headers = {"x-api-key": KEY, "Content-Type": "application/json"}
    r = httpx.post(plain.url + M, content=b"{not json", headers=headers, timeout=10)
    assert r.status_code == 400
    check_anthropic_error(r.json(), "invalid_request_error")
    r = httpx.post(plain.url + M, content=b" " * 1_100_000, headers=headers, timeout=30)
    assert r.status_code == 413
    check_anthropic_error(r.json(), "request_too_large")


def test_unknown_fields_and_accepted_values_of_unsupported_ones(plain: LiveServer) -> None:
    body = _body(service_tier="auto", mcp_servers=[], made_up=1,
                 thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    r = httpx.post(plain.url + M, json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] == "text"


def test_every_field_is_in_the_openapi_schema(plain: LiveServer) -> None:
    schema = httpx.get(f"{plain.url}/openapi.json", timeout=10).json()
    for path, model in ((M, MessagesRequest), (COUNT, CountTokensRequest)):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name_ = ref["schema"]["$ref"].rsplit("/", 1)[1]
        assert set(schema["components"]["schemas"][name_]["properties"]) == set(model.model_fields)
