"""The playground's chat with tools, in headless Chromium against a real `gptserve serve`: the
tools box goes out as `tools`, streamed tool calls show in the answer's bubble and go back with
the next turn, and a malformed tools box is reported next to it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, Route, expect

from tests.conftest import save_tiny_gpt
from tests.server.playground_browser import (
    KEY,
    TIMEOUT_MS,
    needs_chromium,
    open_page,
    serve_with_key,
)

pytestmark = needs_chromium

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lima"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tiny random GPT-2-shaped model with room in its context for the tools' system block."""
    path = save_tiny_gpt(tmp_path_factory.mktemp("tools") / "tiny-tools", block_size=1024)
    with serve_with_key(path, tmp_path_factory) as url:
        yield url


@pytest.fixture()
def page(browser: Browser, server_url: str) -> Iterator[Page]:
    with open_page(browser, server_url) as page:
        page.fill("#api_key", KEY)
        yield page


def test_streamed_tool_calls_show_in_the_answer_and_go_back_next_turn(page: Page) -> None:
    sent: list[dict] = []

    def require_a_call(route: Route) -> None:
        # a random model left to "auto" writes text; this request asks for a call
        body = route.request.post_data_json
        sent.append(body)
        if len(sent) == 1:
            body.update(tool_choice="required", parallel_tool_calls=False)
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", require_a_call)
    page.fill("#tools", json.dumps([TOOL]))
    page.fill("#chat_max_tokens", "60")
    page.fill("#message", "Weather?")
    page.press("#message", "Enter")
    calls = page.locator("#messages .msg-assistant .msg-calls li")
    expect(page.locator("#chat-status")).to_contain_text("done", timeout=TIMEOUT_MS)
    expect(page.locator("#chat-status")).to_contain_text("tool_calls")
    expect(calls.first).to_contain_text("get_weather(")
    text = calls.first.inner_text()
    arguments = json.loads(text[len("get_weather(") : -1])
    assert arguments["city"] in ("Oslo", "Lima")
    assert sent[0]["tools"] == [TOOL]
    page.fill("#chat_max_tokens", "4")
    page.fill("#message", "Thanks")
    page.press("#message", "Enter")
    expect(page.locator("#messages .msg-assistant")).to_have_count(2)
    expect(page.locator("#chat-status")).to_contain_text("done", timeout=TIMEOUT_MS)
    earlier = sent[1]["messages"][1]
    assert earlier["role"] == "assistant" and earlier["content"] is None
    function = earlier["tool_calls"][0]["function"]
    assert function["name"] == "get_weather" and json.loads(function["arguments"]) == arguments


@pytest.mark.parametrize(
    ("tools", "said"),
    [("[{", "Tools must be JSON"), ('[{"type": "function", "function": {}}]', "name")],
)
def test_malformed_tools_are_shown_next_to_the_box(page: Page, tools: str, said: str) -> None:
    page.fill("#tools", tools)
    page.fill("#message", "Weather?")
    page.press("#message", "Enter")
    expect(page.locator("#err-tools")).to_be_visible()
    expect(page.locator("#err-tools")).to_contain_text(said)
