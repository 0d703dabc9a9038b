"""Reading a completion's text back as content and tool calls, whole or piece by piece."""

from __future__ import annotations

import json
import random

import pytest
from gptserve.server.chat.tools.formats import HERMES, LLAMA3_JSON, ToolCallFormat
from gptserve.server.chat.tools.parser import ToolCallParser

WEATHER = '{"city":"Os\\"lo}","days":[1,{"a":[2]}]}'
HERMES_TEXT = (
    "Let me look.\n<tool_call>\n"
    f'{{"name":"get_weather","arguments":{WEATHER}}}\n</tool_call>\n'
    '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'
)
LLAMA3_TEXT = f'{{"name":"get_weather","parameters":{WEATHER}}}; {{"name":"now","parameters":{{}}}}'


def streamed(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, dict[int, dict], str | None]:
    """Feed pieces as a stream does; the content, each call as its deltas add up, the reason."""
    parser, content, calls, reason = ToolCallParser(fmt), "", {}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, reason = parser.stream_delta(piece, "stop" if last else None)
        content += delta.get("content", "")
        for item in delta.get("tool_calls", []):
            if item["index"] not in calls:  # its first delta names it
                assert item["id"].startswith("call_") and item["type"] == "function"
                calls[item["index"]] = {"name": item["function"]["name"], "arguments": ""}
            else:
                assert set(item) == {"index", "function"}  # only more of its arguments
                assert set(item["function"]) == {"arguments"}
            calls[item["index"]]["arguments"] += item["function"]["arguments"]
    return content, calls, reason


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(("fmt", "text"), [(HERMES, HERMES_TEXT), (LLAMA3_JSON, LLAMA3_TEXT)])
def test_whole_and_streamed_answers_agree(fmt: ToolCallFormat, text: str) -> None:
    parser = ToolCallParser(fmt)
    message = parser.parse_all(text)
    assert parser.finish_reason("stop") == "tool_calls"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("get_weather", WEATHER), ("now", "{}")]
    assert json.loads(calls[0][1]) == {"city": 'Os"lo}', "days": [1, {"a": [2]}]}
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    content = "Let me look." if fmt is HERMES else None
    assert message["content"] == content
    rng = random.Random(0)
    splits = [list(text), [text]] + [random_pieces(text, rng) for _ in range(30)]
    for pieces in splits:
        got_content, got_calls, reason = streamed(fmt, pieces)
        assert got_content == (content or "") and reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in got_calls.values()] == calls


@pytest.mark.parametrize(
    "text",
    ["Just text, ending in spaces  \n", "a <tool and <tool_cal", "", "x < y <tool_callz> done"],
)
def test_an_answer_without_calls_is_its_text_exactly(text: str) -> None:
    for fmt in (HERMES, LLAMA3_JSON):
        parser = ToolCallParser(fmt)
        assert parser.parse_all(text) == {"role": "assistant", "content": text}
        assert parser.finish_reason("stop") == "stop"
        pieces = list(text) or [""]
        assert streamed(fmt, pieces) == (text, {}, "stop")


def test_llama3_json_text_is_an_answer_that_does_not_begin_with_a_brace() -> None:
    text = ' {"name":"now","parameters":{}}'
    assert ToolCallParser(LLAMA3_JSON).parse_all(text)["content"] == text


def test_a_call_cut_short_keeps_its_arguments_and_the_choice_its_reason() -> None:
    parser = ToolCallParser(HERMES)
    message = parser.parse_all('<tool_call>\n{"name":"f","arguments":{"a":"b')
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a":"b'}
    assert message["content"] is None and parser.finish_reason("length") == "length"
    # cut before its name was whole: not a call; nor is the start of one after whole calls
    assert ToolCallParser(HERMES).parse_all('Hm. <tool_call>\n{"name":"f')["content"] == "Hm."
    whole = '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n<'
    message = ToolCallParser(HERMES).parse_all(whole)
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_whitespace_between_calls_is_not_content_but_text_after_them_is() -> None:
    text = '\n\n<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n\n then more  '
    message = ToolCallParser(HERMES).parse_all(text)
    assert message["content"] == "then more"
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ["{}"]


PARIS = '{"city":"Paris","unit":"celsius"}'


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{arguments}}}\n</tool_call>'


def llama3_call(name: str, arguments: str) -> str:
    return f'{{"name":"{name}","parameters":{arguments}}}'


def until_finished(fmt: ToolCallFormat, pieces: list[str]) -> tuple[list[dict], str | None, int]:
    """Feed pieces as a stream does, the engine never ending it, until the parser ends the
    answer; every delta item, the finish reason, and how many pieces were read."""
    parser, items = ToolCallParser(fmt), []
    for read, piece in enumerate(pieces, 1):
        delta, reason = parser.stream_delta(piece, None)
        items += delta.get("tool_calls", [])
        if reason is not None:
            return items, reason, read
    return items, None, len(pieces)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_a_repeated_call_ends_the_answer_without_it(fmt: ToolCallFormat) -> None:
    """The same call three times (the third with its keys in another order and spaced out: the
    same JSON): one call, "tool_calls", whatever the engine says; streamed, the repeat is never
    handed out and the answer ends where the second call's arguments end."""
    call, sep = (hermes_call, "\n") if fmt is HERMES else (llama3_call, "; ")
    again = '{ "unit": "celsius", "city": "Paris" }'
    text = sep.join([call("get_weather", PARIS), call("get_weather", PARIS),
                     call("get_weather", again)])  # fmt: skip
    for engine_reason in ("stop", "length", None):
        parser = ToolCallParser(fmt)
        message = parser.parse_all(text)
        assert parser.repeated and parser.finish_reason(engine_reason) == "tool_calls"
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]] == [("get_weather", PARIS)]  # fmt: skip
        assert message["content"] is None
    second_args_end = text.index(PARIS, len(call("get_weather", PARIS))) + len(PARIS)
    rng = random.Random(1)
    for pieces in [list(text), [text]] + [random_pieces(text, rng) for _ in range(30)]:
        items, reason, read = until_finished(fmt, pieces)
        assert reason == "tool_calls"
        assert {item["index"] for item in items} == {0}
        assert "".join(item["function"]["arguments"] for item in items) == PARIS
        assert len("".join(pieces[:read])) >= second_args_end  # not before it was whole
        assert len("".join(pieces[: read - 1])) < second_args_end  # nor later


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_other_calls_are_handed_out_and_a_repeat_of_any_earlier_one_ends(
    fmt: ToolCallFormat,
) -> None:
    """Another function streams at once; the same function with other arguments is held until
    its arguments are whole, then handed out; repeating the first call (not the last) ends."""
    call, sep = (hermes_call, "\n") if fmt is HERMES else (llama3_call, "; ")
    oslo = '{"city":"Oslo","unit":"celsius"}'
    calls = [("get_weather", PARIS), ("get_time", "{}"), ("get_weather", oslo)]
    text = sep.join(call(*c) for c in [*calls, calls[0], ("get_time", '{"zone":"UTC"}')])
    parser = ToolCallParser(fmt)
    message = parser.parse_all(text)
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == calls  # fmt: skip
    assert parser.finish_reason(None) == "tool_calls"
    parser = ToolCallParser(fmt)
    streamed_items = [parser.stream_delta(char, None)[0].get("tool_calls", []) for char in text]
    oslo_head = text.index('"get_weather"', text.index("get_time"))
    oslo_end = text.index(oslo) + len(oslo)
    firsts: dict[int, int] = {}  # each call's first delta: at which character
    for at, items in enumerate(streamed_items):
        for item in items:
            firsts.setdefault(item["index"], at)
    assert firsts[1] < text.index("{}")  # get_time named before its arguments
    assert oslo_head < firsts[2] == oslo_end - 1  # the Oslo call once its arguments were whole
    assert 3 not in firsts


def test_a_call_cut_short_while_held_back_is_handed_out_as_written() -> None:
    text = (
        hermes_call("get_weather", PARIS) + '\n<tool_call>\n{"name":"get_weather","arguments":{"ci'
    )
    parser = ToolCallParser(HERMES)
    delta, reason = parser.stream_delta(text, None)
    assert [item["index"] for item in delta["tool_calls"]] == [0] and reason is None
    delta, reason = parser.stream_delta("", "length")  # max_tokens cut it
    assert delta["tool_calls"][0]["index"] == 1 and reason == "length"
    assert delta["tool_calls"][0]["function"]["arguments"] == '{"ci'
    assert not parser.repeated
