"""The playground page (GET /) driven in headless Chromium against a real `gptserve serve`:
the page itself and its completion tab (the chat tab: test_playground_chat.py).
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.server.playground_browser import (
    KEY,
    TIMEOUT_MS,
    metric,
    needs_chromium,
    open_page,
    post_json,
    serve_with_key,
)

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_with_key(tiny_checkpoint, tmp_path_factory) as url:
        yield url


@pytest.fixture()
def page(browser: Browser, server_url: str) -> Iterator[Page]:
    """The completion tab."""
    with open_page(browser, server_url, tab="completion") as page:
        yield page


def fill_form(page: Page, key: str = KEY, **fields: str) -> None:
    page.fill("#api_key", key)
    for name, value in fields.items():
        page.fill(f"#{name}", value)


def token_spans(page: Page) -> list[str]:
    return page.locator("#output-tokens .tok").all_inner_texts()


def test_page_is_served_offline(server_url: str) -> None:
    with urllib.request.urlopen(f"{server_url}/", timeout=5) as resp:
        html = resp.read().decode()
        assert resp.headers["content-type"].startswith("text/html")
    assert "/static/playground.js" in html and "/static/playground.css" in html
    # everything the page loads is local: no CDN, nothing remote
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)


def test_greedy_completion_streams_as_shaded_tokens(page: Page, server_url: str) -> None:
    prompt = "The quick brown fox"
    fill_form(page, prompt=prompt, temperature="0", max_tokens="12")
    page.click("#run")
    expect(page.locator("#status")).to_contain_text("done", timeout=TIMEOUT_MS)

    spans = token_spans(page)
    assert len(spans) == 12
    expected = post_json(
        f"{server_url}/v1/completions",
        {"prompt": prompt, "temperature": 0, "max_tokens": 12, "logprobs": 1},
    )["choices"][0]
    assert "".join(spans) == expected["text"]
    assert page.inner_text("#output-prompt") == prompt
    assert page.input_value("#model-select") == "tiny-gpt"
    shades = page.eval_on_selector_all(
        "#output-tokens .tok", "els => els.map(e => Number(e.style.getPropertyValue('--p')))"
    )
    probs = [math.exp(lp) for lp in expected["logprobs"]["token_logprobs"]]
    assert shades == pytest.approx(probs, rel=1e-6)  # each token is shaded by its probability
    expect(page.locator("#run")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def test_hover_click_and_focus_show_alternatives(page: Page) -> None:
    fill_form(page, temperature="0", max_tokens="6")
    page.click("#run")
    expect(page.locator("#status")).to_contain_text("done")
    popup = page.locator("#popup")
    token = page.locator("#output-tokens .tok").nth(2)

    token.hover()
    expect(popup).to_be_visible()
    rows = popup.locator("li.alt")
    expect(rows).to_have_count(5)  # logprobs: 5; greedy, so the chosen token is among them
    assert "is-chosen" in (rows.first.get_attribute("class") or "")  # greedy picks the top one
    for pct in popup.locator(".alt-pct").all_inner_texts():
        assert re.fullmatch(r"(<0\.01|\d+\.\d+)%", pct), pct
    widths = popup.locator(".bar").evaluate_all("bars => bars.map(b => b.style.width)")
    assert len(widths) == 5 and all(w.endswith("%") for w in widths), widths
    assert popup.locator(".chosen").inner_text().strip()
    page.mouse.move(5, 5)
    expect(popup).to_be_hidden()

    token.click()  # a click (or tap) pins the popup until the next click or Escape
    page.mouse.move(5, 5)
    expect(popup).to_be_visible()
    page.keyboard.press("Escape")
    expect(popup).to_be_hidden()

    page.focus("#run")  # keyboard users: Tab reaches the tokens, arrows move between them
    page.keyboard.press("Tab")
    expect(page.locator("#output-tokens .tok").first).to_be_focused()
    expect(popup).to_be_visible()
    page.keyboard.press("ArrowRight")
    expect(page.locator("#output-tokens .tok").nth(1)).to_be_focused()
    expect(popup).to_be_visible()
    page.keyboard.press("Tab")  # leaving the text closes it
    expect(popup).to_be_hidden()


def test_tap_opens_alternatives(browser: Browser, server_url: str) -> None:
    with open_page(browser, server_url, "completion", has_touch=True, is_mobile=True) as page:
        fill_form(page, temperature="0", max_tokens="4")
        page.tap("#run")
        expect(page.locator("#status")).to_contain_text("done")
        page.locator("#output-tokens .tok").first.tap()
        expect(page.locator("#popup li.alt")).to_have_count(5)


def test_stop_aborts_and_server_frees_the_sequence(page: Page, server_url: str) -> None:
    disconnected = metric(server_url, "gptserve_requests_total", status="disconnected")
    fill_form(page, max_tokens="200")
    page.click("#run")
    expect(page.locator("#output-tokens .tok").nth(2)).to_be_attached()
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("stopped")
    count = len(token_spans(page))
    assert 3 <= count < 200
    page.wait_for_timeout(700)  # several decode steps: nothing more may arrive
    assert len(token_spans(page)) == count
    expect(page.locator("#run")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#err-general")).to_be_hidden()

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = metric(server_url, "gptserve_num_requests_running")
        gone = metric(server_url, "gptserve_requests_total", status="disconnected")
        if running == 0 and gone > disconnected:
            break
        time.sleep(0.1)
    assert running == 0 and gone == disconnected + 1

    fill_form(page, max_tokens="3")  # the server is fine: the next run completes
    page.click("#run")
    expect(page.locator("#status")).to_contain_text("done (length)")
    assert len(token_spans(page)) == 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", "-1", "temperature"),
        ("top_p", "5", "top_p"),
        ("max_tokens", "-3", "max_tokens"),
        ("prompt", "word " * 400, "context length"),
    ],
)
def test_invalid_parameter_is_shown_next_to_its_field(
    page: Page, field: str, value: str, message: str
) -> None:
    fill_form(page, **{field: value})
    page.click("#run")
    error = page.locator(f"#err-{field}")
    expect(error).to_be_visible()
    expect(error).to_contain_text(message)
    expect(page.locator(f"#{field}")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#err-general")).to_be_hidden()
    assert token_spans(page) == []
    expect(page.locator("#run")).to_be_enabled()
    page.fill(f"#{field}", "1")  # editing the field clears its error
    expect(error).to_be_hidden()


def test_wrong_api_key_shows_auth_error(page: Page) -> None:
    fill_form(page, key="not-the-key", max_tokens="3")
    page.click("#run")
    error = page.locator("#err-api_key")
    expect(error).to_be_visible()
    expect(error).to_contain_text("API key")
    assert token_spans(page) == []

    fill_form(page, max_tokens="3")
    page.click("#run")
    expect(page.locator("#status")).to_contain_text("done")
    expect(error).to_be_hidden()
    stored = page.evaluate("[localStorage.length, sessionStorage.length, document.cookie]")
    assert stored == [0, 0, ""]  # the key stays in memory


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_box_constrains_the_output(page: Page) -> None:
    fill_form(page, prompt="A person:", max_tokens="60", json_schema=json.dumps(PERSON))
    page.click("#run")
    expect(page.locator("#status")).to_contain_text("done (stop)")
    expect(page.locator("#status")).to_contain_text("valid JSON")
    jsonschema.validate(json.loads("".join(token_spans(page))), PERSON)

    # the next-token view shows the masked distribution: an object starts with `{`, so every
    # alternative of the first token does, and their shares are those of the allowed tokens only
    page.locator("#output-tokens .tok").first.hover()
    popup = page.locator("#popup")
    expect(popup.locator(".masked")).to_be_visible()
    alternatives = popup.locator(".alt-token").all_inner_texts()
    assert alternatives and all(t.startswith("{") for t in alternatives), alternatives
    shares = [
        float(p.rstrip("%")) for p in popup.locator(".alt-pct").all_inner_texts() if p[0] != "<"
    ]
    assert sum(shares) <= 100.5

    page.fill("#json_schema", "")  # an empty box: free text again, no note in the popup
    fill_form(page, max_tokens="3")
    page.click("#run")
    expect(page.locator("#status")).to_contain_text("done (length)")
    expect(page.locator("#status")).not_to_contain_text("JSON")
    page.locator("#output-tokens .tok").first.hover()
    expect(popup.locator(".masked")).to_have_count(0)


@pytest.mark.parametrize(
    ("schema", "message"),
    [("{not json", "Not valid JSON"), ("[1]", "is an object"),
     ('{"type": "array", "uniqueItems": true}', "uniqueItems")],
)  # fmt: skip
def test_bad_json_schema_is_shown_next_to_the_box(page: Page, schema: str, message: str) -> None:
    fill_form(page, max_tokens="3", json_schema=schema)
    page.click("#run")
    error = page.locator("#err-json_schema")
    expect(error).to_be_visible()
    expect(error).to_contain_text(message)
    expect(page.locator("#json_schema")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#err-general")).to_be_hidden()
    assert token_spans(page) == []


def test_the_model_select_lists_lora_adapters_and_runs_the_chosen_one(
    browser: Browser, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from gptserve.model import load_checkpoint
    from gptserve.model.lora.peft_format import write_peft

    from tests.lora_testing import random_adapter
    from tests.server.playground_browser import run_server

    root = tmp_path_factory.mktemp("lora-playground")
    config = load_checkpoint(tiny_checkpoint).config
    write_peft(random_adapter(config, "tuned"), root / "tuned", config, "tiny-gpt")
    lora = ("--lora", f"tuned={root / 'tuned'}")
    with run_server(tiny_checkpoint, root / "server.log", *lora) as url:  # no key: listed at once
        with open_page(browser, url, tab="completion") as page:
            options = page.locator("#model-select option")
            expect(options).to_have_text(["tiny-gpt", "tuned (LoRA adapter of tiny-gpt)"])
            page.select_option("#model-select", "tuned")
            page.fill("#prompt", "The quick brown fox")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "8")
            page.click("#run")
            expect(page.locator("#status")).to_contain_text("done", timeout=TIMEOUT_MS)
            body = {"prompt": "The quick brown fox", "temperature": 0, "max_tokens": 8}
            tuned = post_json(f"{url}/v1/completions", {**body, "model": "tuned"})
            base = post_json(f"{url}/v1/completions", body)
            assert tuned["choices"][0]["text"] != base["choices"][0]["text"]
            assert "".join(token_spans(page)) == tuned["choices"][0]["text"]
