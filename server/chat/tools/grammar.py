"""The grammar a tool-calling request is generated under, in llguidance's Lark syntax.

Each function is one rule: its call head written out (`{"name":"f","arguments":`), then its
arguments as `%json {schema}` (a document of its own, so the schema's `$ref`s resolve as sent),
then `}`. Around the calls, the format's delimiters (`server.chat.tools.formats`):

- "required" (or a named function): the output is one call, or with parallel calls one or more.
- "auto": the model may write text instead. For hermes the text is free until it writes
  `<tool_call>`: a lazy lexeme ends the text there, and from then on the call is constrained like
  a required one; after the calls nothing but more calls (parallel) or the end may follow. For
  llama3_json an answer that begins with `{` is a call, and any other answer is text.

JSON inside a call is compact (`JSON_OPTIONS`, as for structured output) and its properties come
in the schema's order, so the parser can read the head back as text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gptserve.engine.grammar import JSON_OPTIONS
from gptserve.server.chat.tools.formats import ToolCallFormat

Mode = Literal["auto", "required"]


@dataclass(frozen=True)
class FunctionGrammar:
    """One function the output may call: its name and the schema its arguments follow."""

    name: str
    schema: dict[str, Any]


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _function_rules(fmt: ToolCallFormat, functions: Sequence[FunctionGrammar]) -> list[str]:
    rules = ["call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        schema = {**function.schema, "x-guidance": JSON_OPTIONS}
        arguments = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        rules.append(f'fn_{i}: {_literal(fmt.call_head(function.name))} %json {arguments} "}}"')
    return rules


def tool_call_grammar(
    fmt: ToolCallFormat, functions: Sequence[FunctionGrammar], mode: Mode, parallel: bool
) -> str:
    """The Lark grammar for calls to `functions` written in `fmt` (see the module docstring)."""
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    closing = _literal(fmt.closing) if fmt.closing else ""
    separator = _literal(fmt.separator)
    more = f"({separator} one)*" if parallel else ""
    rules = ["%llguidance {}"]
    if fmt.opening:
        trigger = fmt.opening.rstrip()  # "<tool_call>": the text that begins a call
        after_trigger = _literal(fmt.opening[len(trigger) :]) if fmt.opening != trigger else ""
        rules.append(f"one: {_literal(trigger)} rest")
        rules.append(f"rest: {after_trigger} call {closing}")
        if mode == "required":
            rules.append(f"start: one {more}")
        else:
            rules.append(f"start: TEXT | lead rest {more}")
            rules.append(f"lead[lazy]: TEXT {_literal(trigger)}")
            rules.append("TEXT: /(.|\\n)*/")
    else:
        rules.append(f"one: call {closing}")
        if mode == "required":
            rules.append(f"start: one {more}")
        else:
            rules.append(f"start: TEXT | one {more}")
            rules.append("TEXT: /([^{](.|\\n)*)?/")  # an answer that begins with { is a call
    rules.extend(_function_rules(fmt, functions))
    return "\n".join(rules) + "\n"
