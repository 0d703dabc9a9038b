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
