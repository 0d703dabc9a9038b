"""Tools, calls and results in the prompt: through a template that knows tools, and described
in a system turn to one that does not; the call format each template gets by default."""

from __future__ import annotations

import json

import pytest
from gptserve.model.tokenizers import get_tokenizer
from gptserve.server.chat.templates import ChatTemplate, JinjaChat, JinjaChatTemplate
from gptserve.server.chat.tools.formats import HERMES, LLAMA3_JSON, format_for_template
from gptserve.server.chat.tools.prompt import chat_messages
from gptserve.server.chat.tools.request import read_tools
from gptserve.server.protocol import ChatCompletionRequest

# ChatML that renders tools, calls and results as Qwen's template does
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call as <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
CHATML_PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ARGS = '{"city": "Oslo"}'
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGS},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_1", "content": "3 C"},
]


def render(template: ChatTemplate | JinjaChat, choice: str = "auto") -> str:
    req = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [TOOL], "tool_choice": choice}
    )
    fmt = format_for_template(template)
    messages, tools = chat_messages(
        req.messages, read_tools(req, get_tokenizer()), fmt, template.knows_tools
    )
    return template.render_messages(messages, tools)


def test_the_call_format_follows_the_template_unless_a_parser_is_named() -> None:
    jinja = {name: JinjaChat(JinjaChatTemplate(source)) for name, source in
             [("tools", CHATML_TOOLS), ("llama3", LLAMA3), ("plain", CHATML_PLAIN)]}  # fmt: skip
    assert format_for_template(ChatTemplate()) is HERMES
    assert format_for_template(jinja["tools"]) is HERMES
    assert format_for_template(jinja["plain"]) is HERMES
    assert format_for_template(jinja["llama3"]) is LLAMA3_JSON
    assert format_for_template(jinja["tools"], "llama3_json") is LLAMA3_JSON
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        format_for_template(jinja["tools"], "mistral")


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them() -> None:
    text = render(JinjaChat(JinjaChatTemplate(CHATML_TOOLS)))
    shown = {**TOOL, "function": {**TOOL["function"]}}
    assert json.dumps(shown, ensure_ascii=False) in text  # the tool, as sent
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # arguments an object
    assert "<|im_start|>tool\n[call_1] 3 C<|im_end|>" in text
    assert "System" not in text and "<tools>" not in text  # no default block


@pytest.mark.parametrize(
    "template", [ChatTemplate(), JinjaChat(JinjaChatTemplate(CHATML_PLAIN))], ids=["plain", "jinja"]
)
def test_a_template_that_knows_nothing_of_tools_gets_the_default_block(template) -> None:
    text = render(template)
    block = HERMES.system_block([{"type": "function", "function": TOOL["function"]}])
    assert f"Be brief.\n\n{block}" in text  # the request's system message first, then the tools
    assert text.count("get_weather") == 2  # in the block, and in the earlier call
    assert HERMES.call_text("get_weather", ARGS) in text  # the call as the model writes calls
    assert "<tool_response>\n3 C\n</tool_response>" in text  # the result, as a user turn
    assert "<tools>" not in render(template, "none")  # tool_choice none: no tools shown


def test_the_block_describes_the_format_calls_are_constrained_to() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    hermes, llama = HERMES.system_block(tools), LLAMA3_JSON.system_block(tools)
    assert '{"type":"function","function":{"name":"f"' in hermes and "<tool_call>" in hermes
    assert '{"name":"function name","parameters":{"argument":"value"}}' in llama
