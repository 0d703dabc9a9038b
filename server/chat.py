"""Chat formats: messages -> one prompt string. A checkpoint's Jinja template (`JinjaChat`), or the
plain-text chat template with its default stop strings (`ChatTemplate`).

The default renders each message as "{name}: {content}" on its own line, the speaker being the
message's `name` or else its role's display name ("User: hi", "ROMEO: hi"), and ends with
"Assistant:", so the model continues the assistant's turn; generation stops at "\\nUser:".
A checkpoint may carry its own `chat_template.txt` (format in docs/API.md): sections separated by
a line holding only `---`: the per-message template, the generation prefix, and optionally stop
strings (one a line, `\\n` written as backslash-n).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.chat_template import ChatTemplateError as JinjaTemplateError
from model.chat_template import JinjaChatTemplate
from model.tokenizers import Tokenizer

TEMPLATE_FILE = "chat_template.txt"
ROLE_NAMES = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}


class ChatTemplateError(ValueError):
    """A chat_template.txt that cannot be used."""


@dataclass(frozen=True)
class ChatTemplate:
    message: str = "{name}: {content}\n"
    prefix: str = "Assistant:"
    stop: tuple[str, ...] = field(default=("\nUser:",))
    specials_in_prompt = False  # "<|endoftext|>" in a message is text
    knows_tools = False  # tools are described to it by server.tool_prompt

    def render_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The same as `render`, for messages as dicts (role, content, name)."""
        return self.render([(m["role"], m.get("content") or "", m.get("name")) for m in messages])

    def render(self, messages: Sequence[tuple[str, str] | tuple[str, str, str | None]]) -> str:
        """(role, content) or (role, content, name) messages -> the prompt. {role} is the raw
        role, {Role} its display name, {name} the message's name or else that display name."""
        parts = []
        for role, content, *rest in messages:
            shown = ROLE_NAMES.get(role, role.title())
            name = rest[0] if rest and rest[0] else shown
            values = {"role": role, "Role": shown, "name": name, "content": content}
            parts.append(_fill(self.message, values))
        return "".join(parts) + self.prefix

    @classmethod
    def parse(cls, text: str) -> ChatTemplate:
        sections = _split_sections(text)
        if len(sections) not in (2, 3):
            raise ChatTemplateError(
                "chat_template.txt needs 2 or 3 sections separated by '---' lines "
                "(message template, generation prefix, optional stop strings)"
            )
        message, prefix = sections[0], sections[1]
        if "{content}" not in message:
            raise ChatTemplateError("the message template has no {content} placeholder")
        stop: tuple[str, ...] = ()
        if len(sections) == 3:
            stop = tuple(
                line.replace("\\n", "\n") for line in sections[2].split("\n") if line.strip()
            )
        return cls(message=message, prefix=prefix, stop=stop)

    @classmethod
    def for_checkpoint(cls, directory: Path | None) -> ChatTemplate:
        """The checkpoint's chat_template.txt if it has one, else the default."""
        if directory is None or not (directory / TEMPLATE_FILE).is_file():
            return cls()
        path = directory / TEMPLATE_FILE
        try:
            return cls.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read {path}: {exc}") from None
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{path}: {exc}") from None


def _split_sections(text: str) -> list[str]:
    """Split at lines that are exactly '---'; each section loses the newline before the separator."""
    sections: list[list[str]] = [[]]
    for line in text.split("\n"):
        if line.rstrip("\r") == "---":
            sections.append([])
        else:
            sections[-1].append(line)
    out = ["\n".join(lines) for lines in sections]
    if out and out[-1].endswith("\n"):  # the file's final newline is not part of the template
        out[-1] = out[-1][:-1]
    return out


_PLACEHOLDER = re.compile(r"\{(role|Role|name|content)\}")


def _fill(template: str, values: dict[str, str]) -> str:
    """Replace {role}, {Role}, {name} and {content} in one pass, without str.format: a name or
    content holding braces, or a placeholder's text, is written as it is."""
    out: list[str] = []
    end, first_content = 0, True
    for match in _PLACEHOLDER.finditer(template):
        head = template[end : match.start()]
        key, value = match.group(1), values[match.group(1)]
        # An answer generated after "Assistant:" begins with its own space (" Hello"): sent
        # back, it renders as "Assistant: Hello", the very text the model saw, so a follow-up
        # turn's prompt starts with the tokens generated for it and reuses their cached blocks.
        if key == "content" and first_content:
            first_content = False
            before = "".join(out) + head
            if before.endswith(" ") and value.startswith((" ", "\t", "\n")):
                out, head = [before[:-1]], ""
        out.append(head + value)
        end = match.end()
    out.append(template[end:])
    return "".join(out)


class JinjaChat:
    """A checkpoint's Jinja chat template as the server's chat format. It has no stop strings
    (the model's end tokens end a turn) and the special tokens it writes (`<|im_start|>`, ...) are
    encoded as tokens."""

    stop: tuple[str, ...] = ()
    specials_in_prompt = True

    def __init__(self, template: JinjaChatTemplate) -> None:
        self.template = template

    @property
    def knows_tools(self) -> bool:
        """Whether the template renders `tools` itself (else server.tool_prompt describes them)."""
        return self.template.knows_tools

    def render_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        return self.template.render(messages, tools=tools)


ChatFormat = ChatTemplate | JinjaChat


def load_chat_format(path: Path, tokenizer: Tokenizer, override: Path | None = None) -> ChatFormat:
    """The chat format a checkpoint serves with: `--chat-template FILE` (Jinja), else the
    checkpoint's Jinja template (a Hugging Face directory's, a GGUF file's metadata), else its
    chat_template.txt, else the plain "Role: content" default. Raises a ChatTemplateError."""
    specials = {
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
    }
    try:
        if override is not None:
            return JinjaChat(JinjaChatTemplate.from_file(override, specials))
        if path.suffix == ".gguf" and path.is_file():
            from model.gguf.checkpoint import read_metadata

            source = read_metadata(path).get("tokenizer.chat_template")
            return JinjaChat(JinjaChatTemplate(source, specials)) if source else ChatTemplate()
        if path.is_dir():
            found = JinjaChatTemplate.from_directory(path, specials)
            if found is not None:
                return JinjaChat(found)
    except JinjaTemplateError as exc:
        raise ChatTemplateError(str(exc)) from None
    return ChatTemplate.for_checkpoint(path if path.is_dir() else None)
