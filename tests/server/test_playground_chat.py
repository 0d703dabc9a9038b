"""The playground's chat tab, which a user meets first, driven in headless Chromium against a real
`gptserve serve` serving the tiny random checkpoint (its answers are any text; the server's
plain chat template applies).

Set PLAYGROUND_SCREENSHOT=docs/playground.png (and optionally PLAYGROUND_MODEL=a checkpoint
directory, GGUF file or known model name) to rewrite the README's screenshot.
"""

from __future__ import annotations

import json
import math
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Request, expect

from tests.server.playground_browser import (
    KEY,
    TIMEOUT_MS,
    metric,
    needs_chromium,
    open_page,
    post_json,
    run_server,
    serve_with_key,
    wait_until_freed,
)

pytestmark = needs_chromium

ANSWERS = "#messages .msg-assistant"


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_with_key(tiny_checkpoint, tmp_path_factory) as url:
        yield url


@pytest.fixture()
def page(browser: Browser, server_url: str) -> Iterator[Page]:
    """The playground as a user opens it: on the chat."""
    with open_page(browser, server_url) as page:
        yield page


def chat_requests(page: Page) -> list[dict]:
    """The bodies the page sends to /v1/chat/completions, appended as they go."""
    bodies: list[dict] = []

    def record(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            bodies.append(request.post_data_json)

    page.on("request", record)
    return bodies


def settings(page: Page, key: str = KEY, **fields: str) -> None:
    page.fill("#api_key", key)
    for name, value in fields.items():
        page.fill(f"#{name}", value)


def say(page: Page, text: str) -> None:
    """Type `text` into the message box and send it with Enter."""
    page.fill("#message", text)
    page.press("#message", "Enter")


def finished(page: Page, status: str = "done") -> None:
    """Wait for the answer to end (a loaded machine may take longer than expect's 5 s)."""
    expect(page.locator("#chat-status")).to_contain_text(status, timeout=TIMEOUT_MS)


def answer_tokens(page: Page, nth: int = -1) -> list[str]:
    return page.locator(ANSWERS).nth(nth).locator(".tok").all_inner_texts()


def bubbles(page: Page) -> list[list[str]]:
    """[class, text] of each message on the page, in order."""
    return page.eval_on_selector_all(
        "#messages .msg",
        "els => els.map(e => [e.className, e.querySelector('.msg-body').innerText])",
    )


def test_greedy_answer_streams_into_an_assistant_bubble(page: Page, server_url: str) -> None:
    expect(page.locator("#panel-chat")).to_be_visible()  # the chat is what a user sees first
    expect(page.locator("#panel-completion")).to_be_hidden()
    expect(page.locator("#tab-chat")).to_have_attribute("aria-selected", "true")
    # a bounded answer by default: a chat that never ends would run to the request timeout
    expect(page.locator("#chat_max_tokens")).to_have_value("512")
    expect(page.locator("#chat_max_tokens")).to_have_attribute("placeholder", "512")
    sent = chat_requests(page)
    settings(page, chat_temperature="0", chat_max_tokens="24")
    # a slow link, so the stream's events reach the page in several reads even when the tiny
    # model writes all 24 tokens before the browser has read the first
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": 4096, "uploadThroughput": -1},
    )
    page.evaluate(  # the token count of the answer at each change of the page
        """() => { window.counts = [];
        new MutationObserver(() => window.counts.push(
            document.querySelectorAll('#messages .msg-assistant .tok').length))
          .observe(document.getElementById('messages'), {childList: true, subtree: true}); }"""
    )
    page.fill("#message", "Hello")
    page.press("#message", "Shift+Enter")  # a new line, not a send
    page.locator("#message").press_sequentially("there")
    expect(page.locator("#messages .msg")).to_have_count(0)
    page.press("#message", "Enter")
    finished(page)

    [body] = sent
    assert body["messages"] == [{"role": "user", "content": "Hello\nthere"}]
    assert body["stream"] is True and body["logprobs"] is True and body["top_logprobs"] == 5
    expected = post_json(
        f"{server_url}/v1/chat/completions",
        {"messages": body["messages"], "temperature": 0, "max_tokens": 24, "logprobs": True},
    )["choices"][0]
    content = expected["message"]["content"]
    entries = expected["logprobs"]["content"]
    assert bubbles(page) == [
        ["msg msg-user", "Hello\nthere"],
        ["msg msg-assistant", content],
    ]
    tokens = answer_tokens(page)
    assert "".join(tokens) == content and len(tokens) == len(entries) > 1
    whole = [  # each span holds its own token's text (a partial character's goes to the next)
        (shown, entry["token"])
        for shown, entry, before in zip(tokens, entries, [{"token": ""}, *entries])
        if not entry["token"].startswith("bytes:") and not before["token"].startswith("bytes:")
    ]
    assert len(whole) > len(tokens) // 2 and all(a == b for a, b in whole), whole
    counts = page.evaluate("window.counts")
    assert any(0 < n < len(tokens) for n in counts), counts  # it grew token by token
    shades = page.locator(f"{ANSWERS} .tok").evaluate_all(
        "els => els.map(e => Number(e.style.getPropertyValue('--p')))"
    )
    assert shades == pytest.approx([math.exp(e["logprob"]) for e in entries], rel=1e-6)
    expect(page.locator("#message")).to_have_value("")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#chat-stop")).to_be_disabled()

    token = page.locator(f"{ANSWERS} .tok").nth(1)  # an answer's tokens show their alternatives
    token.hover()
    popup = page.locator("#popup")
    rows = popup.locator("li.alt")
    expect(rows).to_have_count(5)
    assert "is-chosen" in (rows.first.get_attribute("class") or "")  # greedy: the top one
    expect(popup.locator(".masked")).to_have_count(0)
    page.keyboard.press("Escape")
    token.focus()  # and to the keyboard: arrows move between them
    page.keyboard.press("ArrowRight")
    expect(page.locator(f"{ANSWERS} .tok").nth(2)).to_be_focused()
    expect(popup).to_be_visible()


def test_second_turn_sends_the_conversation_and_new_chat_forgets_it(page: Page) -> None:
    sent = chat_requests(page)
    settings(page, system="Answer in verse.", chat_temperature="0.8", chat_max_tokens="6")
    say(page, "First question")
    finished(page)
    first_answer = "".join(answer_tokens(page))
    say(page, "Second question")
    finished(page)

    system = {"role": "system", "content": "Answer in verse."}
    assert sent[1]["messages"] == [
        system,
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": first_answer},  # as streamed, byte for byte
        {"role": "user", "content": "Second question"},
    ]
    assert sent[1]["temperature"] == 0.8 and sent[1]["max_tokens"] == 6
    shown = bubbles(page)
    assert [cls for cls, _ in shown] == ["msg msg-user", "msg msg-assistant"] * 2
    assert shown[2][1] == "Second question" and shown[1][1] == first_answer
    expect(page.locator(f"{ANSWERS} .msg-note").first).to_have_text("cut at max tokens")

    page.click("#new-chat")
    expect(page.locator("#messages .msg")).to_have_count(0)
    expect(page.locator("#message")).to_be_focused()
    say(page, "Fresh start")
    finished(page)
    assert sent[2]["messages"] == [system, {"role": "user", "content": "Fresh start"}]


def test_stop_aborts_the_answer_and_keeps_what_came(page: Page, server_url: str) -> None:
    disconnected = metric(server_url, "gptserve_requests_total", status="disconnected")
    sent = chat_requests(page)
    settings(page, chat_max_tokens="200")
    say(page, "Tell me a long story")
    expect(page.locator(f"{ANSWERS} .tok").nth(2)).to_be_attached(timeout=TIMEOUT_MS)
    expect(page.locator("#send")).to_be_disabled()
    page.click("#chat-stop")
    expect(page.locator("#chat-status")).to_contain_text("stopped")
    count = len(answer_tokens(page))
    assert 3 <= count < 200
    page.wait_for_timeout(700)  # several decode steps: nothing more may arrive
    assert len(answer_tokens(page)) == count
    expect(page.locator(f"{ANSWERS} .msg-note")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#chat-stop")).to_be_disabled()
    expect(page.locator("#err-chat")).to_be_hidden()
    wait_until_freed(server_url, disconnected)

    partial = page.locator(f"{ANSWERS} .msg-body").inner_text()
    settings(page, chat_max_tokens="3")  # the server is fine, and the partial answer counts
    say(page, "Go on")
    finished(page, "done (length)")
    assert sent[1]["messages"][1] == {"role": "assistant", "content": partial}
    assert len(answer_tokens(page)) == 3


def test_wrong_api_key_is_a_readable_error_and_the_message_stays(page: Page) -> None:
    settings(page, key="not-the-key", chat_max_tokens="3")
    say(page, "Anyone there?")
    error = page.locator("#err-api_key")
    expect(error).to_be_visible()
    expect(error).to_contain_text("API key rejected")
    expect(page.locator("#chat-status")).to_have_text("not authorized")
    expect(page.locator("#messages .msg")).to_have_count(0)  # the turn is taken back
    expect(page.locator("#message")).to_have_value("Anyone there?")

    page.fill("#api_key", KEY)
    expect(error).to_be_hidden()  # editing the key clears its error
    page.press("#message", "Enter")
    finished(page)
    assert bubbles(page)[0] == ["msg msg-user", "Anyone there?"]
    stored = page.evaluate("[localStorage.length, sessionStorage.length, document.cookie]")
    assert stored == [0, 0, ""]  # the key stays in memory


@pytest.mark.parametrize(
    ("field", "value", "message", "text"),
    [
        ("chat_temperature", "-1", "temperature", "hi"),
        ("chat_max_tokens", "-3", "max_tokens", "hi"),
        ("message", None, "context length", "word " * 400),
        ("message", None, "Type a message first", "   "),
    ],
)
def test_rejected_request_is_shown_next_to_its_field(
    page: Page, field: str, value: str | None, message: str, text: str
) -> None:
    settings(page, **({field: value} if value else {}))
    say(page, text)
    error = page.locator(f"#err-{field}")
    expect(error).to_be_visible()
    expect(error).to_contain_text(message)
    expect(page.locator(f"#{field}")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#err-chat")).to_be_hidden()
    expect(page.locator("#messages .msg")).to_have_count(0)
    expect(page.locator("#send")).to_be_enabled()


@pytest.mark.skipif(
    not os.environ.get("PLAYGROUND_SCREENSHOT"), reason="set PLAYGROUND_SCREENSHOT=path to write it"
)
def test_screenshot(browser: Browser, tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A chat, the second answer still streaming, a token of the first one's alternatives open:
    the picture in the README."""
    out = Path(os.environ["PLAYGROUND_SCREENSHOT"])
    model = os.environ.get("PLAYGROUND_MODEL") or str(tiny_checkpoint)
    slow = 300_000  # ms: a loaded CPU may take minutes for these answers
    with run_server(Path(model), tmp_path / "server.log", startup_timeout=slow / 1000) as url:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
            context = json.loads(resp.read())["data"][0]["max_model_len"]
        with open_page(browser, url) as page:
            settings(page, key="", system="You are a concise assistant.", chat_temperature="0")
            page.fill("#chat_max_tokens", str(min(48, context // 4)))
            say(page, "What is the capital of France?")
            expect(page.locator("#chat-status")).to_contain_text("done", timeout=slow)
            # a slow link keeps a small model's answer going long enough to catch it mid-way
            cdp = page.context.new_cdp_session(page)
            cdp.send("Network.enable")
            conditions = {"offline": False, "latency": 0, "uploadThroughput": -1}
            cdp.send("Network.emulateNetworkConditions", {**conditions, "downloadThroughput": 3000})
            say(page, "Name one thing to see there.")
            streaming = page.locator(ANSWERS).nth(1).locator(".tok")
            expect(streaming.nth(6)).to_be_attached(timeout=slow)
            first = page.locator(ANSWERS).first.locator(".tok")
            word = first.evaluate_all(  # a word's alternatives, not a newline's
                "els => els.findIndex((e, i) => i >= 3 && /[a-z]{3}/i.test(e.textContent))"
            )
            first.nth(max(word, 0)).hover()
            expect(page.locator("#popup")).to_be_visible()
            expect(page.locator("#chat-stop")).to_be_enabled()  # still answering
            page.screenshot(path=str(out))
            page.click("#chat-stop")
    assert out.stat().st_size > 10_000
