"""The plain chat template (`ChatTemplate`: the "Role: content" default or a checkpoint's
chat_template.txt) as a Jinja template that renders the same prompt, for files that can only
carry Jinja (a GGUF file's `tokenizer.chat_template`).

The same prompt: each message's template with {role}, {Role}, {name} and {content} filled as
`ChatTemplate.render` fills them (a message's `name`, else its role's display name; one space
dropped before a content that starts with white space), then the generation prefix when
`add_generation_prompt` is set. What Jinja cannot carry is the plain template's stop strings
("\\nUser:" by default): a client that wants them sends them as `stop`.

The output uses only what both transformers' Jinja and llama.cpp's template engine know: loops,
`if`, `set`, string literals, `+`, slices, `get`, `title` and `endswith`.
"""

from __future__ import annotations

import re

from gptserve.server.chat.templates import ROLE_NAMES, ChatTemplate

_PLACEHOLDER = re.compile(r"\{(role|Role|name|content)\}")
_VALUES = {"role": "message['role']", "Role": "shown", "name": "named", "content": "content"}
_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def literal(text: str) -> str:
    """`text` as a Jinja string literal."""
    return "'" + "".join(_ESCAPES.get(c, c) for c in text) + "'"


def plain_to_jinja(template: ChatTemplate) -> str:
    """Jinja source rendering what `template.render_messages` renders (module docstring)."""
    pieces: list[str] = []  # Jinja expressions, in order, for one message
    end = 0
    head: list[str] | None = None  # the expressions before the first {content}
    for match in _PLACEHOLDER.finditer(template.message):
        if template.message[end : match.start()]:
            pieces.append(literal(template.message[end : match.start()]))
        if match.group(1) == "content" and head is None:
            head, pieces = pieces, []
        else:
            pieces.append(_VALUES[match.group(1)])
        end = match.end()
    if template.message[end:]:
        pieces.append(literal(template.message[end:]))
    names = ", ".join(f"{literal(k)}: {literal(v)}" for k, v in ROLE_NAMES.items())
    out = [
        "{% set names = {" + names + "} %}",
        "{% for message in messages %}",
        "{% set role = message['role'] %}",
        "{% set shown = names[role] if role in names else role.title() %}",
        "{% set named = message.get('name') or shown %}",
        "{% set content = message.get('content') or '' %}",
    ]
    if head is None:  # no {content}: ChatTemplate.parse refuses such a template
        raise ValueError("the message template has no {content} placeholder")
    out += [
        "{% set head = " + (" + ".join(head) or "''") + " %}",
        "{% if head.endswith(' ') and content[:1] in [' ', '\\t', '\\n'] %}"
        "{% set head = head[:-1] %}{% endif %}",
        "{{ head + content" + "".join(f" + {p}" for p in pieces) + " }}",
        "{% endfor %}",
    ]
    if template.prefix:
        out.append(
            "{% if add_generation_prompt %}{{ " + literal(template.prefix) + " }}{% endif %}"
        )
    return "".join(out)
