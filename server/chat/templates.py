"""Chat formats: messages -> one prompt string. A checkpoint's Jinja template (`JinjaChat`, rendered
by `JinjaChatTemplate`), or the plain-text chat template with its default stop strings
(`ChatTemplate`). A template that cannot be used is a `ChatTemplateError`, whichever kind it is.

The default renders each message as "{name}: {content}" on its own line, the speaker being the
message's `name` or else its role's display name ("User: hi", "ROMEO: hi"), and ends with
"Assistant:", so the model continues the assistant's turn; generation stops at "\\nUser:".
A checkpoint may carry its own `chat_template.txt` (format in docs/API.md): sections separated by
a line holding only `---`: the per-message template, the generation prefix, and optionally stop
strings (one a line, `\\n` written as backslash-n).

A Jinja template is rendered the way transformers' `apply_chat_template` does. Where it comes
from: `chat_template.jinja` in the checkpoint directory, else the `chat_template` of
`tokenizer_config.json` (a string, or a list of named templates: "default", and "tool_use" when
the request has tools), else a GGUF file's `tokenizer.chat_template`. The environment matches
transformers': sandboxed and immutable, `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `tojson` filter that keeps non-ASCII text, `raise_exception(message)` and
`strftime_now(format)`; a template sees `messages`, `tools`, `add_generation_prompt`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and any extra keyword the caller
passes. A template that raises, or does not parse, is a `ChatTemplateError` carrying its message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from gptserve.model.tokenizers import Tokenizer
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.txt"
JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ROLE_NAMES = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}


class ChatTemplateError(ValueError):
    """A chat template that cannot be used: a Jinja template that does not parse or raised while
    rendering, a chat_template.txt that is malformed, a file that cannot be read; the message says
    why."""


@dataclass(frozen=True)
class ChatTemplate:
    message: str = "{name}: {content}\n"
    prefix: str = "Assistant:"
    stop: tuple[str, ...] = field(default=("\nUser:",))
    specials_in_prompt = False  # "<|endoftext|>" in a message is text
    knows_tools = False  # tools are described to it by server.chat.tools.prompt
    source = None  # no Jinja source (a Jinja chat format's is its template's)

    def render_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        **variables: Any,
    ) -> str:  # fmt: skip
        """The same as `render`, for messages as dicts (role, content, name); a plain template
        has no variables to set."""
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


# --- Jinja templates


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None


# what Jinja itself gives a template besides its environment's globals
_JINJA_NAMES = frozenset({"loop", "self", "super", "caller", "varargs", "kwargs", "true", "false",
                          "none", "True", "False", "None"})  # fmt: skip


def environment_names() -> frozenset[str]:
    """Every name a template finds without being passed it: the environment's globals (Jinja's
    `range`, `dict`, `namespace`, `cycler`, `joiner`, `lipsum`, and our `raise_exception` and
    `strftime_now`) and Jinja's own (`loop`, `self`, `caller`, ...). A request's variables may
    not shadow them."""
    return frozenset(_compile("").environment.globals) | _JINJA_NAMES


class JinjaChatTemplate:
    """Messages -> the prompt text a checkpoint's template makes of them."""

    def __init__(
        self, source: str, special_tokens: Mapping[str, str | None] | None = None,
        tool_source: str | None = None,
    ) -> None:  # fmt: skip
        self.source = source
        self.tool_source = tool_source
        self.special_tokens = dict(special_tokens or {})
        _compile(source)  # a template that does not parse fails at load, not at the first request
        if tool_source is not None:
            _compile(tool_source)

    @property
    def knows_tools(self) -> bool:
        """Whether the template reads `tools` (else the caller describes tools itself)."""
        return "tools" in (self.tool_source or self.source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        source = self.tool_source if tools and self.tool_source else self.source
        values = {k: v for k, v in self.special_tokens.items() if v is not None}
        values.update(extra)
        try:
            return _compile(source).render(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **values,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # undefined names, sandbox refusals, ...
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc!r}") from None

    @classmethod
    def from_directory(
        cls, directory: Path, special_tokens: Mapping[str, str | None] | None = None
    ) -> JinjaChatTemplate | None:
        """The template of a Hugging Face checkpoint directory, or None when it has none."""
        jinja = directory / JINJA_FILE
        if jinja.is_file():
            return cls(_read(jinja), special_tokens)
        config_path = directory / TOKENIZER_CONFIG_FILE
        if not config_path.is_file():
            return None
        try:
            config = json.loads(_read(config_path))
        except ValueError as exc:
            raise ChatTemplateError(f"{config_path}: {exc}") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, str):
            return cls(template, special_tokens)
        if isinstance(template, list):  # named templates
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            default = named.get("default") or next(iter(named.values()), None)
            if isinstance(default, str):
                return cls(default, special_tokens, tool_source=named.get("tool_use"))
        return None

    @classmethod
    def from_file(
        cls, path: Path, special_tokens: Mapping[str, str | None] | None = None
    ) -> JinjaChatTemplate:
        """`--chat-template FILE`: a Jinja template file."""
        return cls(_read(path), special_tokens)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from None


class JinjaChat:
    """A checkpoint's Jinja chat template as the server's chat format. It has no stop strings
    (the model's end tokens end a turn) and the special tokens it writes (`<|im_start|>`, ...) are
    encoded as tokens."""

    stop: tuple[str, ...] = ()
    specials_in_prompt = True

    def __init__(self, template: JinjaChatTemplate) -> None:
        self.template = template

    @property
    def source(self) -> str:
        """The template's Jinja source (what `server.chat.reasoning` reads its format from)."""
        return self.template.source

    @property
    def knows_tools(self) -> bool:
        """Whether the template renders `tools` itself (else server.chat.tools.prompt describes
        them)."""
        return self.template.knows_tools

    def render_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        **variables: Any,
    ) -> str:  # fmt: skip
        """The messages rendered, with a request's `chat_template_kwargs` as `variables`."""
        return self.template.render(messages, tools=tools, **variables)


ChatFormat = ChatTemplate | JinjaChat


def load_chat_format(path: Path, tokenizer: Tokenizer, override: Path | None = None) -> ChatFormat:
    """The chat format a checkpoint serves with: `--chat-template FILE` (Jinja), else the
    checkpoint's Jinja template (a Hugging Face directory's, a GGUF file's metadata), else its
    chat_template.txt, else the plain "Role: content" default. Raises a ChatTemplateError."""
    specials = {
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
    }
    if override is not None:
        return JinjaChat(JinjaChatTemplate.from_file(override, specials))
    if path.suffix == ".gguf" and path.is_file():
        from gptserve.model.gguf.checkpoint import read_metadata

        source = read_metadata(path).get("tokenizer.chat_template")
        return JinjaChat(JinjaChatTemplate(source, specials)) if source else ChatTemplate()
    if path.is_dir():
        found = JinjaChatTemplate.from_directory(path, specials)
        if found is not None:
            return JinjaChat(found)
    return ChatTemplate.for_checkpoint(path if path.is_dir() else None)
