"""Jinja chat templates rendered as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gptserve.server.chat.templates import ChatTemplateError, JinjaChatTemplate
from tokenizers import Tokenizer, models

# ChatML as Qwen, SmolLM2 and Hermes write it, with a default system turn and tools in <tools>
CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call functions. Signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools %}{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>\n{{ call['function'] | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Llama 3 style: BOS, headers, a dated system turn, and an error for roles it does not know
LLAMA3 = (
    "{{ bos_token }}{% set date = strftime_now('%d %b %Y') %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date }}\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}"
    "{% set messages = messages[1:] %}{% endif %}<|eot_id|>"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Be brief. Ünïcödé stays: 日本"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "  And of Italy?  "},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def _reference(template: str):
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), **SPECIALS)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("generation", [True, False])
def test_renders_as_transformers(template: str, generation: bool) -> None:
    ref = _reference(template)
    ours = JinjaChatTemplate(template, SPECIALS)
    for messages in (MESSAGES, MESSAGES[1:2]):
        expected = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        assert ours.render(messages, add_generation_prompt=generation) == expected


def test_tools_and_tool_calls_render_as_transformers() -> None:
    ref, ours = _reference(CHATML), JinjaChatTemplate(CHATML, SPECIALS)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 3}'},
    ]
    expected = ref.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours.render(messages, tools=TOOLS) == expected
    assert "get_weather" in expected and ours.knows_tools


def test_raise_exception_is_a_template_error_with_its_message() -> None:
    ours = JinjaChatTemplate(LLAMA3, SPECIALS)
    with pytest.raises(ChatTemplateError, match="unknown role: narrator"):
        ours.render([{"role": "narrator", "content": "x"}])


def test_a_template_that_does_not_parse_fails_at_load() -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        JinjaChatTemplate("{% for m in messages %}{{ m }")


def test_the_sandbox_refuses_unsafe_attribute_access() -> None:
    ours = JinjaChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ours.render(MESSAGES)


def test_sources_in_order_jinja_file_then_tokenizer_config(tmp_path: Path) -> None:
    assert JinjaChatTemplate.from_directory(tmp_path) is None
    config = {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = JinjaChatTemplate.from_directory(tmp_path)
    assert named.render(MESSAGES) == "D" and named.render(MESSAGES, tools=TOOLS) == "T1"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert JinjaChatTemplate.from_directory(tmp_path).render(MESSAGES) == "J4"
