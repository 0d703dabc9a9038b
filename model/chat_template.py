"""A checkpoint's Jinja chat template, rendered the way transformers' `apply_chat_template` does.

Where a template comes from: `chat_template.jinja` in the checkpoint directory, else the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates: "default",
and "tool_use" when the request has tools), else a GGUF file's `tokenizer.chat_template`.

The environment matches transformers': sandboxed and immutable, `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text,
`raise_exception(message)` and `strftime_now(format)`; a template sees `messages`, `tools`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and any
extra keyword the caller passes. A template that raises, or does not parse, is a
`ChatTemplateError` carrying its message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """A chat template that does not parse, or raised while rendering; the message says why."""


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
