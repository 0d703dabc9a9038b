"""Reasoning models: `<think>...</think>` apart from the answer (`reasoning_content`), whole and
streamed, with Qwen3's published chat template; `chat_template_kwargs` reach the template; a
structured output or tool call is constrained only after the thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from gptserve.server.chat.reasoning import FORMATS, ReasoningSplitter, default_format, split
from gptserve.server.settings import Settings
from tokenizers import AddedToken

from tests.conftest import byte_level_bpe
from tests.server.conftest import LiveServer, live_server

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek_r1"]
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
         "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "text", "reasoning", "content"),
    [
        (QWEN3, "<think>\nweigh it\n</think>\n\nYes.", "\nweigh it\n", "Yes."),
        (QWEN3, "Yes, at once.", None, "Yes, at once."),  # thinking off: no block
        (QWEN3, "<think>still going", "still going", ""),  # cut short while thinking
        (QWEN3, "  <think>a</think>b", "a", "b"),
        (R1, "weigh it</think>\n\nYes.", "weigh it", "Yes."),  # the prompt opened the block
        (R1, "<think>a</think>b", "a", "b"),
        (R1, "no end yet", "no end yet", ""),
    ],
)
def test_a_whole_answer_and_every_chunking_of_it_split_alike(fmt, text, reasoning, content):
    assert split(fmt, text) == (reasoning, content)
    for size in (1, 2, 3, 5):  # the tags cut across chunks anywhere
        splitter, got = ReasoningSplitter(fmt), ["", ""]
        for i in range(0, len(text), size):
            r, c = splitter.feed(text[i : i + size])
            got = [got[0] + r, got[1] + c]
        r, c = splitter.finish()
        assert [got[0] + r, got[1] + c] == [reasoning or "", content], size


def test_the_format_comes_from_the_chat_template():
    assert default_format(QWEN3_TEMPLATE) is QWEN3
    assert default_format("{{ '<|Assistant|><think>\\n' }}") is R1
    assert default_format("{{ messages }}") is None and default_format(None) is None


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Path:
    """A small random Qwen3 saved by transformers, with a byte-level BPE tokenizer holding
    Qwen3's added tokens and Qwen3's published chat template."""
    transformers = pytest.importorskip("transformers")
    text = shakespeare_path.read_text(encoding="utf-8")[:60_000]
    rust = byte_level_bpe([text[i : i + 2000] for i in range(0, len(text), 2000)], 400,
                          ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # fmt: skip
    rust.add_tokens([AddedToken(t, special=False) for t in
                     ("<think>", "</think>", "<tool_call>", "</tool_call>")])  # fmt: skip
    config = transformers.Qwen3Config(
        vocab_size=rust.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3"
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    rust.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": QWEN3_TEMPLATE}))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def qwen3(qwen3_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(qwen3_checkpoint), max_num_seqs=8)) as live:
        yield live


def chat(live: LiveServer, **fields) -> httpx.Response:  # noqa: ANN003
    body = {"messages": [{"role": "user", "content": "Think, then answer."}], **fields}
    return httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)


def token(live: LiveServer, text: str) -> str:
    (tid,) = live.state.loaded.tokenizer.encode(text, allow_special=True)
    return str(tid)


def streamed(live: LiveServer, **fields) -> tuple[str, str, list[dict]]:  # noqa: ANN003
    body = {"messages": [{"role": "user", "content": "Think, then answer."}], "stream": True,
            **fields}  # fmt: skip
    reasoning, content, deltas = "", "", []
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                deltas.append(delta)
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content, deltas


def test_chat_template_kwargs_reach_the_template(qwen3: LiveServer) -> None:
    on = chat(qwen3, max_tokens=1).json()["usage"]["prompt_tokens"]
    off = chat(qwen3, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert off.status_code == 200 and off.json()["usage"]["prompt_tokens"] > on  # the empty block
    r = chat(qwen3, max_tokens=1, chat_template_kwargs={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_thinking_comes_apart_whole_and_streamed(qwen3: LiveServer) -> None:
    # a random model: the biases make it open a block at once and close it a few tokens later
    bias = {token(qwen3, "<think>"): 100}
    fields = dict(max_tokens=12, temperature=1.0, seed=5, logit_bias=bias)
    whole = chat(qwen3, **fields).json()["choices"][0]["message"]
    assert whole["reasoning_content"] is not None and "<think>" not in whole["content"]
    reasoning, content, deltas = streamed(qwen3, **fields)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert any("reasoning_content" in d for d in deltas)
    # thinking off: Qwen3's template closes the block in the prompt; the answer is all content
    off = chat(qwen3, max_tokens=8, chat_template_kwargs={"enable_thinking": False}, **{
        "logit_bias": bias, "temperature": 1.0, "seed": 5}).json()  # fmt: skip
    message = off["choices"][0]["message"]
    assert message.get("reasoning_content") is None and message["content"].startswith("<think>")


def test_a_schema_constrains_only_the_answer_after_the_thinking(qwen3: LiveServer) -> None:
    # Qwen3 opens its thinking with <think> (the constraint makes sure), and a bias on </think>
    # makes this random model close it a few tokens later; the schema holds what follows
    fields = dict(
        max_tokens=60, temperature=1.0, seed=2, logit_bias={token(qwen3, "</think>"): 6},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}},
    )  # fmt: skip
    for seed in range(3):
        message = chat(qwen3, **{**fields, "seed": seed}).json()["choices"][0]["message"]
        assert message["reasoning_content"] is not None  # thought freely first
        jsonschema.validate(json.loads(message["content"]), POINT)
    reasoning, content, _ = streamed(qwen3, **fields)
    jsonschema.validate(json.loads(content), POINT)


def test_a_tool_call_follows_the_thinking(qwen3: LiveServer) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": POINT}}
    fields = dict(max_tokens=80, temperature=1.0, seed=1, tools=[tool], tool_choice="required",
                  parallel_tool_calls=False,
                  logit_bias={token(qwen3, "</think>"): 6})  # fmt: skip
    choice = chat(qwen3, **fields).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), POINT)
    assert choice["message"]["reasoning_content"] is not None


def test_the_playground_shows_the_thinking_folded(browser, qwen3: LiveServer) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    from tests.server.playground_browser import TIMEOUT_MS, open_page

    bias = {token(qwen3, "<think>"): 100}

    def think(route) -> None:  # noqa: ANN001 - this random model thinks only when pushed to
        body = {**route.request.post_data_json, "logit_bias": bias, "max_tokens": 10}
        route.continue_(post_data=json.dumps(body))

    with open_page(browser, qwen3.url) as page:
        page.route("**/v1/chat/completions", think)
        page.fill("#message", "Think, then answer.")
        page.press("#message", "Enter")
        expect(page.locator("#chat-status")).to_contain_text("done", timeout=TIMEOUT_MS)
        section = page.locator("#messages .msg-assistant .msg-reasoning")
        expect(section).to_be_visible()
        assert section.get_attribute("open") is None  # folded until the reader opens it
        section.locator("summary").click()
        expect(section.locator(".msg-reasoning-body")).to_contain_text("<think>")  # its text
