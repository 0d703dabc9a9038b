"""The Responses API (`/v1/responses`) through the `openai` client against live servers over
random-weight models (the ChatML one whose template renders tools, and the plain GPT-2 one, of
tests/server/chat/tools/test_tools.py): a greedy response says what the same chat completion
says, whole and streamed (the typed events in order, their deltas joining to the final text),
instructions, max_output_tokens, json_schema, a tool round trip, previous_response_id, the
store per API key, the message's logprobs (the chat completion's), input_items, and a 400
naming the field for what cannot be honoured."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from gptserve.server.settings import Settings
from openai import OpenAI

from tests.server.chat.tools.test_tools import (  # noqa: F401 (fixtures)
    WEATHER,
    chatml_checkpoint,
    plain_checkpoint,
)
from tests.server.conftest import LiveServer, live_server

KEYS = ["key-a", "key-b"]
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
TIME = {"type": "function", "name": "get_time", "description": "The time now"}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object"}}
DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def chatml(chatml_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    with live_server(Settings(model=str(chatml_checkpoint), max_num_seqs=8)) as live:
        yield live


@pytest.fixture(scope="module")
def plain(plain_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    settings = Settings(model=str(plain_checkpoint), max_num_seqs=8, api_keys=list(KEYS))
    with live_server(settings) as live:
        yield live


def client_of(live: LiveServer, key: str = KEYS[0]) -> OpenAI:
    return OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)


def name(live: LiveServer) -> str:
    return live.state.loaded.name


def chat_text(live: LiveServer, messages: list[dict], max_tokens: int) -> str:
    """What the greedy chat completion of `messages` says."""
    answer = client_of(live).chat.completions.create(
        model=name(live), messages=messages, max_tokens=max_tokens, temperature=0
    )
    return answer.choices[0].message.content


def texts(response: Any) -> list[str]:  # noqa: ANN401
    return [
        part.text for item in response.output if item.type == "message" for part in item.content
    ]


def streamed(live: LiveServer, key: str = KEYS[0], **fields: Any) -> tuple[list, Any]:  # noqa: ANN401
    """A stream's events (checked in order) and its final response."""
    events = list(client_of(live, key).responses.create(stream=True, **fields))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.id == events[0].response.id
    # each item opens, is written and closes before the next; its deltas join to its text
    i, output = 2, []
    while i < len(events) - 1:
        added = events[i]
        assert added.type == "response.output_item.added", kinds[i:]
        index, item = added.output_index, added.item
        assert index == len(output) and item.status == "in_progress"
        i += 1
        if item.type == "message":
            assert events[i].type == "response.content_part.added"
            i += 1
            text = ""
            while events[i].type == "response.output_text.delta":
                assert events[i].item_id == item.id and events[i].delta
                text += events[i].delta
                i += 1
            assert events[i].type == "response.output_text.done" and events[i].text == text
            assert events[i + 1].type == "response.content_part.done"
            assert events[i + 1].part.text == text
            i += 2
        else:
            assert item.type == "function_call" and item.arguments == ""
            arguments = ""
            while events[i].type == "response.function_call_arguments.delta":
                assert events[i].item_id == item.id
                arguments += events[i].delta
                i += 1
            assert events[i].type == "response.function_call_arguments.done"
            assert events[i].arguments == arguments
            i += 1
        done = events[i]
        assert done.type == "response.output_item.done" and done.output_index == index
        assert done.item.id == item.id
        output.append(done.item)
        i += 1
    assert [item.model_dump() for item in output] == [item.model_dump() for item in final.output]
    return events, final


def test_a_response_says_what_the_chat_completion_says_whole_and_streamed(
    plain: LiveServer,
) -> None:
    expected = chat_text(plain, [{"role": "user", "content": "Hello there"}], 8)
    fields = dict(model=name(plain), input="Hello there", max_output_tokens=8, temperature=0)
    whole = client_of(plain).responses.create(**fields)
    assert re.fullmatch(r"resp_[0-9a-f]{32}", whole.id) and whole.object == "response"
    assert whole.model == name(plain) and whole.store is True
    assert len(whole.output) == 1 and whole.output[0].type == "message"
    message = whole.output[0]
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert message.content[0].text == expected == whole.output_text
    usage = whole.usage
    assert usage.output_tokens == 8 and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens > 8
    # a random model runs to the limit: incomplete, and says why
    assert whole.status == "incomplete" and message.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    events, final = streamed(plain, **fields)
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert texts(final) == [expected] and final.usage.output_tokens == 8
    assert final.incomplete_details.reason == "max_output_tokens"
    metrics = httpx.get(f"{plain.url}/metrics", timeout=10).text
    assert (
        'gptserve_requests_total{endpoint="responses",finish_reason="length",status="200"}'
        in metrics
    )


def test_instructions_are_a_system_message_first(chatml: LiveServer) -> None:
    messages = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hi"}]  # fmt: skip
    expected = chat_text(chatml, messages, 10)
    answer = client_of(chatml).responses.create(
        model=name(chatml), instructions="Answer in French.", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        ], max_output_tokens=10, temperature=0,
    )  # fmt: skip
    assert answer.instructions == "Answer in French." and texts(answer) == [expected]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_output_is_valid_json_under_the_schema(
    chatml: LiveServer, stream: bool
) -> None:
    fmt = {"type": "json_schema", "name": "digit", "schema": DIGIT, "strict": True}
    fields = dict(model=name(chatml), input="A digit?", text={"format": fmt}, max_output_tokens=50)
    for seed_temperature in (0, 1.0):
        fields["temperature"] = seed_temperature
        if stream:
            _, answer = streamed(chatml, **fields)
        else:
            answer = client_of(chatml).responses.create(**fields)
        assert answer.status == "completed" and answer.incomplete_details is None
        jsonschema.validate(json.loads(texts(answer)[0]), DIGIT)
        assert answer.text.format.type == "json_schema"


def check_calls(answer: Any, parallel: bool = True) -> list:  # noqa: ANN401
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in answer.output)
    assert parallel or len(calls) == 1
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.call_id) and call.id.startswith("fc_")
        assert call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def outputs(calls: list) -> list[dict]:
    return [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 3}'}
            for c in calls]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("which", ["chatml", "plain"])
def test_a_tool_round_trip(request: pytest.FixtureRequest, which: str, stream: bool) -> None:
    live: LiveServer = request.getfixturevalue(which)
    client = client_of(live)
    question = "What is the weather in Oslo?"
    fields = dict(model=name(live), tools=[FLAT_WEATHER, TIME])

    def create(**more: Any) -> Any:  # noqa: ANN401
        more = {"max_output_tokens": 300, **fields, **more}
        if stream:
            return streamed(live, **more)[1]
        return client.responses.create(**more)

    # one call: greedy, a random model would call again and again until the limit
    first = create(input=question, tool_choice="required", temperature=0, parallel_tool_calls=False)
    calls = check_calls(first, parallel=False)
    assert first.status == "completed" and first.tool_choice == "required"
    assert [t.name for t in first.tools] == ["get_weather", "get_time"]
    # the calls' results back, by previous_response_id or by sending the items again: the
    # same greedy answer, in text (the ChatML model is kept from opening another call)
    more = {"tool_choice": "none"} if which == "chatml" else {"tool_choice": "auto"}
    by_id = create(previous_response_id=first.id, input=outputs(calls), temperature=0,
                   max_output_tokens=12, **more)  # fmt: skip
    items = [{"role": "user", "content": question}, *first.output, *outputs(calls)]
    resent = create(input=items, temperature=0, max_output_tokens=12, **more)
    assert by_id.previous_response_id == first.id
    for answer in (by_id, resent):
        assert [item.type for item in answer.output] == ["message"] and texts(answer)[0]
    assert texts(by_id) == texts(resent)
    # and it is the chat completion of the same conversation
    chat_calls = [{"id": c.call_id, "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}} for c in calls]  # fmt: skip
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": None, "tool_calls": chat_calls}]  # fmt: skip
    messages += [{"role": "tool", "tool_call_id": c.call_id, "content": '{"temp": 3}'}
                 for c in calls]  # fmt: skip
    chat = client.chat.completions.create(
        model=name(live), messages=messages, tools=[WEATHER, {"type": "function", "function": {
            "name": "get_time", "description": "The time now"}}], max_tokens=12, temperature=0,
        **more,
    )  # fmt: skip
    assert texts(by_id) == [chat.choices[0].message.content]
    # tools are not carried on (as OpenAI does): without them the earlier calls are history
    bare = client.responses.create(
        model=name(live), previous_response_id=first.id, input=outputs(calls), max_output_tokens=4
    )
    assert bare.tools == [] and [item.type for item in bare.output] == ["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_is_called_once(plain: LiveServer, stream: bool) -> None:
    fields = dict(model=name(plain), input="Time?", tools=[FLAT_WEATHER, TIME],
                  tool_choice={"type": "function", "name": "get_time"}, temperature=1.0,
                  max_output_tokens=300)  # fmt: skip
    for _ in range(2):
        if stream:
            _, answer = streamed(plain, **fields)
        else:
            answer = client_of(plain).responses.create(**fields)
        calls = check_calls(answer, parallel=False)
        assert calls[0].name == "get_time"


def test_previous_response_id_continues_the_conversation(plain: LiveServer) -> None:
    client = client_of(plain)
    first = client.responses.create(
        model=name(plain), input="One", max_output_tokens=5, temperature=0,
        metadata={"topic": "counting"},
    )  # fmt: skip
    assert first.metadata == {"topic": "counting"}
    second = client.responses.create(
        model=name(plain), previous_response_id=first.id, input="Two", max_output_tokens=5,
        temperature=0,
    )  # fmt: skip
    third = client.responses.create(
        model=name(plain), previous_response_id=second.id, input="Three", max_output_tokens=5,
        temperature=0,
    )  # fmt: skip
    messages = [{"role": "user", "content": "One"},
                {"role": "assistant", "content": texts(first)[0]},
                {"role": "user", "content": "Two"},
                {"role": "assistant", "content": texts(second)[0]},
                {"role": "user", "content": "Three"}]  # fmt: skip
    assert texts(third) == [chat_text(plain, messages, 5)]
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    # stored: retrieved as answered, and deleted
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # second still holds the whole conversation
    fourth = client.responses.create(
        model=name(plain), previous_response_id=second.id, input="Three", max_output_tokens=5,
        temperature=0,
    )  # fmt: skip
    assert texts(fourth) == texts(third)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_logprobs_are_the_chat_completions(plain: LiveServer, stream: bool) -> None:
    chat = client_of(plain).chat.completions.create(
        model=name(plain), messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(expected) == 6 and all(len(e["top_logprobs"]) == 3 for e in expected)
    fields = dict(model=name(plain), input="Hello there", max_output_tokens=6, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=3)  # fmt: skip
    if stream:
        events, answer = streamed(plain, **fields)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        joined = [lp.model_dump() for e in deltas for lp in e.logprobs]
        assert joined == expected  # each delta brings its tokens' logprobs
        done = next(e for e in events if e.type == "response.output_text.done")
        assert [lp.model_dump() for lp in done.logprobs] == expected
    else:
        answer = client_of(plain).responses.create(**fields)
    part = answer.output[0].content[0]
    assert [lp.model_dump() for lp in part.logprobs] == expected
    assert "".join(e["token"] for e in expected) == part.text
    assert answer.top_logprobs == 3
    # include alone: the tokens' logprobs without alternatives; neither: none
    alone = client_of(plain).responses.create(**{**fields, "top_logprobs": None})
    got = alone.output[0].content[0].logprobs
    assert [lp.logprob for lp in got] == [e["logprob"] for e in expected]
    assert all(lp.top_logprobs == [] for lp in got)
    plain_answer = client_of(plain).responses.create(
        model=name(plain), input="Hello there", max_output_tokens=6, temperature=0
    )
    assert plain_answer.output[0].content[0].logprobs == [] and plain_answer.top_logprobs == 0


def test_input_items_lists_what_a_stored_response_answered(plain: LiveServer) -> None:
    client = client_of(plain)
    first = client.responses.create(
        model=name(plain), input=[{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": "One"}],
        max_output_tokens=3, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=name(plain), previous_response_id=first.id, input="Two", max_output_tokens=3
    )
    listed = client.responses.input_items.list(first.id, order="asc")
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in listed.data] == [
        ("message", "developer", "input_text", "Be brief."),
        ("message", "user", "input_text", "One"),
    ]
    page = client.responses.input_items.list(second.id)  # newest first
    data = page.data
    assert [(i.role, i.content[0].text) for i in data] == [
        ("user", "Two"), ("assistant", texts(first)[0]), ("user", "One"),
        ("developer", "Be brief."),
    ]  # fmt: skip
    assert data[1].id == first.output[0].id and data[1].content[0].type == "output_text"
    assert data[2].id == listed.data[1].id  # an item keeps its id in the responses after it
    assert len({i.id for i in data}) == 4
    assert [i.status for i in data] == ["completed", "incomplete", "completed", "completed"]
    assert page.first_id == data[0].id and page.last_id == data[-1].id and not page.has_more
    # pages of two, after a cursor
    url = f"{plain.url}/v1/responses/{second.id}/input_items"
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    r = httpx.get(url, params={"limit": 2}, headers=headers, timeout=10).json()
    assert [i["id"] for i in r["data"]] == [i.id for i in data[:2]] and r["has_more"]
    r = httpx.get(url, params={"limit": 2, "after": r["last_id"]}, headers=headers,
                  timeout=10).json()  # fmt: skip
    assert [i["id"] for i in r["data"]] == [i.id for i in data[2:]] and not r["has_more"]
    bad = (({"limit": 0}, "limit"), ({"after": "msg_nope"}, "after"), ({"order": "up"}, "order"),
           ({"limit": "many"}, "limit"))  # fmt: skip
    for params, param in bad:
        r = httpx.get(url, params=params, headers=headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.NotFoundError):
        client_of(plain, KEYS[1]).responses.input_items.list(second.id)  # another key's


def test_input_items_of_calls_and_their_outputs(plain: LiveServer) -> None:
    client = client_of(plain)
    call = {"type": "function_call", "id": "fc_given", "call_id": "call_1", "name": "get_time",
            "arguments": "{}"}  # fmt: skip
    answer = client.responses.create(
        model=name(plain), input=[{"role": "user", "content": "Time?"}, call,
                                  {"type": "function_call_output", "call_id": "call_1",
                                   "output": "noon"}],
        max_output_tokens=2,
    )  # fmt: skip
    data = client.responses.input_items.list(answer.id, order="asc").data
    assert [i.type for i in data] == ["message", "function_call", "function_call_output"]
    assert data[1].id == "fc_given" and data[1].name == "get_time" and data[1].arguments == "{}"
    assert data[2].call_id == "call_1" and data[2].output == "noon"
    assert data[2].id.startswith("fco_")


def test_sending_back_what_previous_response_id_holds_is_a_400(plain: LiveServer) -> None:
    client = client_of(plain)
    first = client.responses.create(model=name(plain), input="One", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=name(plain), previous_response_id=first.id,
                                input=[*first.output, {"role": "user", "content": "Two"}])  # fmt: skip
    err = error_of(exc)
    assert err["param"] == "input" and first.output[0].id in err["message"]


def _entry(token: str) -> dict:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}


TOKENS = [_entry(t) for t in ("Let", " me", " check", "<tool", "_call>", "{}")]


def test_a_messages_logprobs_are_its_own_tokens_not_the_calls(
    chatml: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gptserve.server.responses import api

    assert api.message_logprobs(TOKENS, "Let me check") == TOKENS[:3]  # the whole answer's
    assert api.message_logprobs(TOKENS, "") == []

    async def text_then_call(accepted: Any) -> Any:  # noqa: ANN401
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": ""}}  # fmt: skip
        yield {"delta": {"content": "Let me"}, "logprobs": {"content": TOKENS[:2]},
               "finish_reason": None}  # fmt: skip
        yield {"delta": {"content": " check"}, "logprobs": {"content": TOKENS[2:3]},
               "finish_reason": None}  # fmt: skip
        # "<tool_call>" held back by the parser, then it opens a call
        yield {"delta": {}, "logprobs": {"content": TOKENS[3:5]}, "finish_reason": None}
        yield {"delta": {"tool_calls": [call]}, "logprobs": {"content": TOKENS[5:]},
               "finish_reason": None}  # fmt: skip
        yield {"delta": {}, "logprobs": None, "finish_reason": "tool_calls"}

    monkeypatch.setattr(api, "stream_pieces", text_then_call)
    events, final = streamed(chatml, input="Hi", include=["message.output_text.logprobs"],
                             tools=[TIME])  # fmt: skip
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == ["Let", " me", " check"]
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert [lp.token for lp in final.output[0].content[0].logprobs] == ["Let", " me", " check"]


def error_of(exc: pytest.ExceptionInfo) -> dict:
    body = exc.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    return body


def test_the_store_is_per_api_key_and_store_false_keeps_nothing(plain: LiveServer) -> None:
    a, b = client_of(plain, KEYS[0]), client_of(plain, KEYS[1])
    kept = a.responses.create(model=name(plain), input="Hi", max_output_tokens=2)
    assert a.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError) as exc:
        b.responses.retrieve(kept.id)
    assert error_of(exc)["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as exc:
        b.responses.create(model=name(plain), input="Hi", previous_response_id=kept.id)
    assert error_of(exc)["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as exc:
        b.responses.delete(kept.id)
    assert a.responses.retrieve(kept.id).id == kept.id  # B could not delete it either
    with pytest.raises(openai.NotFoundError) as exc:
        a.responses.create(model=name(plain), input="Hi", previous_response_id="resp_unknown")
    err = error_of(exc)
    assert err["param"] == "previous_response_id" and "resp_unknown" in err["message"]
    unkept = a.responses.create(model=name(plain), input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unkept.id)
    _, streamed_kept = streamed(plain, model=name(plain), input="Hi", max_output_tokens=2)
    assert a.responses.retrieve(streamed_kept.id).output_text == streamed_kept.output_text


def test_the_store_is_bounded_per_tenant(plain_checkpoint: Path) -> None:  # noqa: F811
    settings = Settings(model=str(plain_checkpoint), responses_store_size=2)
    with live_server(settings) as live:
        client = client_of(live)
        ids = [client.responses.create(input="Hi", max_output_tokens=1).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the least recently used went
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


TOOLS = [FLAT_WEATHER]
BAD = [
    ({"input": 5}, "input", "input"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"content": "x"}]}, "input", "input[0]: an item needs a type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"input": [{"type": "function_call_output", "output": "3"}]}, "input", "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input", "not JSON"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools", "tools[0].parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "not supported"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "'nope' is not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text", "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text"),
    ({"text": {"verbosity": "high"}}, "text", "verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "context length"),
    ({"background": True}, "background", "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text"),
    ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs", "top_logprobs"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"input": [{"role": "user", "content": "a", "id": "m1"},
                {"role": "user", "content": "b", "id": "m1"}]}, "input", "duplicate item id 'm1'"),
    ({"input": [{"role": "user", "content": "a", "id": 5}]}, "input", "input[0].id"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
    ({"metadata": {"k": 3}}, "metadata", "metadata"),
    ({"previous_response_id": 5}, "previous_response_id", "previous_response_id"),
    ({"instructions": ["x"]}, "instructions", "instructions"),
    ({"input": "go " * 3000}, "input", "context length"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "said"), BAD, ids=range(len(BAD)))
def test_a_malformed_request_is_a_400_naming_the_field(
    chatml: LiveServer, fields: dict, param: str, said: str
) -> None:
    body = {"model": name(chatml), "input": "Hi", "max_output_tokens": 4, **fields}
    r = httpx.post(f"{chatml.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and said in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_accepted_values_of_unsupported_fields_and_unknown_fields(chatml: LiveServer) -> None:
    body = {"input": "Hi", "max_output_tokens": 2, "background": False, "include": [],
            "truncation": "disabled", "service_tier": "auto", "made_up": 1,
            "prompt_cache_key": "k", "text": {"format": {"type": "text"}, "verbosity": "medium"}}  # fmt: skip
    r = httpx.post(f"{chatml.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == {"format": {"type": "text"}}


def test_an_error_after_the_stream_started_is_an_error_event(
    chatml: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gptserve.server.responses import api

    async def failing(accepted: Any) -> Any:  # noqa: ANN401
        from gptserve.server.errors import APIError

        yield {"delta": {"content": "a"}, "finish_reason": None}
        raise APIError(503, "the engine failed this request: boom", code="engine_error")

    monkeypatch.setattr(api, "stream_pieces", failing)
    events = list(client_of(chatml).responses.create(input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "error" and "response.completed" not in kinds
    assert events[-1].code == "engine_error" and "boom" in events[-1].message
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_store_drops_the_least_recently_used_by_count_and_by_bytes() -> None:
    from gptserve.server.responses.store import ResponseStore

    def body(i: int, size: int = 10) -> dict:
        return {"id": f"resp_{i}", "pad": "x" * size}

    store = ResponseStore(per_tenant=3, max_bytes=1000)
    for i in range(3):
        assert store.put("a", body(i), [])
    assert store.get("a", "resp_0") is not None  # now the most recently used
    store.put("a", body(3), [])
    assert store.get("a", "resp_1") is None and store.get("a", "resp_0") is not None
    assert store.get("b", "resp_0") is None and not store.delete("b", "resp_0")
    assert store.put("b", body(9), [{"type": "message"}]) and len(store) == 4
    assert store.put("a", body(4, 900), [])  # past the bytes: the oldest go until it fits
    kept = [i for i in range(5) if store.get("a", f"resp_{i}") is not None]
    assert kept == [0, 4] and len(store) == 3  # 0 was read last; b's is its own
    assert not store.put("a", body(5, 2000), [])  # bigger than the whole bound: not kept
    assert store.delete("a", "resp_4") and store.get("a", "resp_4") is None
    assert not ResponseStore(per_tenant=0).put("a", body(0), [])
