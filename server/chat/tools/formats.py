"""How a model family writes tool calls: the text around a call, the key of its arguments, and
the system block that describes tools to a chat template that knows nothing of them.

Two formats, named as vLLM's `--tool-call-parser` names them:

- `hermes` (Hermes, Qwen, SmolLM and most ChatML models): each call is a JSON object between tags,
  after any text the model wrote first:

      <tool_call>
      {"name":"get_weather","arguments":{"city":"Oslo"}}
      </tool_call>

- `llama3_json` (Llama 3.1 and later): the whole answer is the call, a bare JSON object whose
  arguments are under "parameters"; several calls are separated by "; ".

The grammar (`server.chat.tools.grammar`) writes calls exactly as `call_head` + arguments +
`call_end`, compact, the name before the arguments; the parser (`server.chat.tools.parser`) reads
that text back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gptserve.server.chat.templates import ChatFormat, JinjaChat

# templates of the Llama 3 family: their headers, and the tag 3.1 opens built-in calls with
_LLAMA3_MARKERS = ("<|start_header_id|>", "<|python_tag|>")


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's way of writing tool calls."""

    name: str
    args_key: str  # the key the arguments come under ("arguments", "parameters")
    opening: str  # what opens a call in running text; "" when calls stand alone (no text)
    closing: str  # what closes a call after its JSON object
    separator: str  # between two calls
    response_opening: str  # a tool's result, as the user turn it is written in (templates
    response_closing: str  # that know nothing of tools)

    def call_head(self, function: str) -> str:
        """The compact JSON a call begins with, up to its arguments."""
        return "{" + f'"name":{json.dumps(function)},"{self.args_key}":'

    def call_text(self, function: str, arguments: str) -> str:
        """A whole call as the model writes it; `arguments` is JSON text."""
        return f"{self.opening}{self.call_head(function)}{arguments}}}{self.closing}"

    def system_block(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """What a template that knows nothing of tools is told about them, as a system turn."""
        lines = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
        example = self.call_text("function name", '{"argument":"value"}')
        if self.opening:
            return (
                "You may call functions. Their signatures, one JSON object a line:\n"
                f"<tools>\n{lines}\n</tools>\n"
                "To call one, write its name and arguments as a JSON object between "
                f"{self.opening.strip()} tags:\n{example}\n"
                f"Results come back between {self.response_opening.strip()} tags."
            )
        return (
            "You may call functions. Their signatures, one JSON object a line:\n"
            f"{lines}\n"
            f"To call one, answer with only a JSON object: {example}\n"
            f'Call several by separating the objects with "{self.separator}".'
        )

    def response_text(self, content: str) -> str:
        """A tool's result as the user turn that carries it back (no tool role in the template)."""
        return f"{self.response_opening}{content}{self.response_closing}"


HERMES = ToolCallFormat(
    name="hermes",
    args_key="arguments",
    opening="<tool_call>\n",
    closing="\n</tool_call>",
    separator="\n",
    response_opening="<tool_response>\n",
    response_closing="\n</tool_response>",
)
LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    args_key="parameters",
    opening="",
    closing="",
    separator="; ",
    response_opening="",
    response_closing="",
)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}
PARSER_NAMES: tuple[str, ...] = tuple(FORMATS)


def format_for_template(template: ChatFormat, parser: str | None = None) -> ToolCallFormat:
    """The format `--tool-call-parser` names, else the one the chat template writes: a template
    that mentions <tool_call> is hermes, a Llama 3 one llama3_json, and any other (the plain
    template included) hermes, which the default system block then describes."""
    if parser is not None:
        try:
            return FORMATS[parser]
        except KeyError:
            raise ValueError(
                f"unknown tool-call parser {parser!r} (one of {', '.join(PARSER_NAMES)})"
            ) from None
    if isinstance(template, JinjaChat):
        source = template.template.source + (template.template.tool_source or "")
        if "<tool_call>" not in source and any(m in source for m in _LLAMA3_MARKERS):
            return LLAMA3_JSON
    return HERMES
