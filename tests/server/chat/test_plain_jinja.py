"""The plain chat template as Jinja: the same prompt as `ChatTemplate` renders."""

from __future__ import annotations

import pytest
from gptserve.server.chat.plain_jinja import literal, plain_to_jinja
from gptserve.server.chat.templates import ChatTemplate, JinjaChatTemplate

MESSAGES = [
    {"role": "system", "content": "Be {brief} and 'polite'."},
    {"role": "user", "content": "hi \\ there\n"},
    {"role": "assistant", "content": " Hello"},  # generated after "Assistant:": its own space
    {"role": "user", "name": "ROMEO", "content": "\tTab first"},
    {"role": "tool", "content": None},
    {"role": "developer", "content": "caf\u00e9 \U0001f600 {{ not jinja }} {% raw %}"},
]
TEMPLATES = {
    "default": ChatTemplate(),
    "custom": ChatTemplate.parse(
        "<|{role}|> {name} ({Role}) says: {content} [{role}]\n---\n<|assistant|>\n---\n</s>\n"
    ),
    "content first": ChatTemplate.parse("{content}\n--{name}\n---\n>>"),
    "no prefix": ChatTemplate(prefix=""),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_jinja_renders_what_the_plain_template_renders(name: str) -> None:
    plain = TEMPLATES[name]
    jinja = JinjaChatTemplate(plain_to_jinja(plain))
    for n in range(1, len(MESSAGES) + 1):
        assert jinja.render(MESSAGES[:n]) == plain.render_messages(MESSAGES[:n])


def test_without_a_generation_prompt_the_prefix_is_left_out() -> None:
    plain = ChatTemplate()
    text = JinjaChatTemplate(plain_to_jinja(plain)).render(
        MESSAGES[:2], add_generation_prompt=False
    )
    assert text == plain.render_messages(MESSAGES[:2]).removesuffix(plain.prefix)


def test_literals_keep_quotes_backslashes_and_newlines() -> None:
    text = "it's a \\ back\nslash\r\t"
    assert JinjaChatTemplate("{{ " + literal(text) + " }}").render([]) == text
