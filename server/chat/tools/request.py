"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and the grammar
its calls are generated under.

Every error is a 400 whose `param` is the request field (`tools`, `tool_choice`) and whose
message names the place in it (`tools[1].function.parameters: ...`). A tool's `parameters` must
be a JSON schema of an object that the grammar engine builds; omitted, the function takes no
arguments (`{}`). `strict` is accepted and changes nothing: the schema is always enforced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from gptserve.engine.grammar import Constraint, GrammarError, compile_constraint
from gptserve.model.tokenizers import Tokenizer
from gptserve.server.chat.tools.bounds import bounded_schema
from gptserve.server.chat.tools.formats import ToolCallFormat
from gptserve.server.chat.tools.grammar import FunctionGrammar, tool_call_grammar
from gptserve.server.errors import bad_request
from gptserve.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule
MAX_TOOLS = 128
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
Choice = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request, checked: what the template is shown and what may be called."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, as a chat template takes them
    functions: list[FunctionGrammar]  # each tool's name and the schema its arguments follow
    choice: Choice
    named: str | None  # tool_choice named this function
    parallel: bool

    @property
    def calls(self) -> bool:
        """Whether the answer may hold calls (it is then constrained and parsed)."""
        return self.choice != "none"

    @property
    def calls_only(self) -> bool:
        """Whether the answer is calls and no text ("required" or a named function)."""
        return self.calls and self.choice != "auto"

    def constraint(
        self, fmt: ToolCallFormat, tokenizer: Tokenizer, vocab_size: int | None = None
    ) -> Constraint:
        """The grammar of the answer's calls (see server.chat.tools.grammar), compiled."""
        functions = self.functions
        if self.named is not None:
            functions = [f for f in functions if f.name == self.named]
        mode = "auto" if self.choice == "auto" else "required"
        # a named function is called exactly once (OpenAI's contract, and vLLM's)
        grammar = tool_call_grammar(fmt, functions, mode, self.parallel and self.named is None)
        try:
            return compile_constraint("lark", grammar, tokenizer, vocab_size=vocab_size)
        except GrammarError as exc:
            raise bad_request(f"the tools cannot be built into a grammar: {exc.message}",
                              "tools", exc.code) from None  # fmt: skip


def read_tools(
    req: ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int | None = None
) -> ToolRequest | None:
    """The request's tools, checked (None without tools); raises a 400 naming the field."""
    if not req.tools:
        _no_tools_to_choose(req.tool_choice)
        return None
    if len(req.tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools per request", "tools")
    tools, functions, seen = [], [], set()
    for i, tool in enumerate(req.tools):
        shown, function = _read_tool(tool, f"tools[{i}]", tokenizer, vocab_size)
        if function.name in seen:
            raise bad_request(f"tools[{i}].function.name: {function.name!r} is given twice",
                              "tools")  # fmt: skip
        seen.add(function.name)
        tools.append(shown)
        functions.append(function)
    choice, named = _read_choice(req.tool_choice, seen)
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolRequest(tools, functions, choice, named, parallel)


def _no_tools_to_choose(choice: str | NamedToolChoice | None) -> None:
    """Without tools, tool_choice may only say what happens anyway (none, auto)."""
    if isinstance(choice, NamedToolChoice) or choice == "required":
        raise bad_request("tool_choice needs tools: the request has none", "tool_choice")


def _read_choice(
    choice: str | NamedToolChoice | None, names: set[str]
) -> tuple[Choice, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        return choice, None  # pydantic allowed only none, auto and required
    if choice.type != "function":
        raise bad_request('tool_choice.type must be "function"', "tool_choice")
    name = choice.function.name if choice.function is not None else None
    if not name:
        raise bad_request("tool_choice.function.name is required", "tool_choice")
    if name not in names:
        raise bad_request(
            f"tool_choice.function.name: {name!r} is not one of the tools "
            f"({', '.join(sorted(names))})",
            "tool_choice",
        )
    return "required", name


def _read_tool(
    tool: Tool, where: str, tokenizer: Tokenizer, vocab_size: int | None
) -> tuple[dict[str, Any], FunctionGrammar]:
    """One tool -> the object the template is shown and the grammar of its calls."""
    if tool.type != "function":
        raise bad_request(f'{where}.type must be "function"', "tools")
    function = tool.function
    if function is None:
        raise bad_request(f"{where}.function is required", "tools")
    name = function.name
    if not name:
        raise bad_request(f"{where}.function.name is required", "tools")
    if not FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
    where = f"{where}.function.parameters"
    schema = NO_ARGUMENTS if function.parameters is None else function.parameters
    kind = schema.get("type", "object")
    if kind != "object":
        raise bad_request(f'{where} must be the schema of an object ("type": "object")', "tools")
    schema = {"type": "object", **schema}
    generated = _buildable(schema, where, tokenizer, vocab_size)
    shown: dict[str, Any] = {"name": name}
    if function.description is not None:
        shown["description"] = function.description
    shown["parameters"] = schema
    return {"type": "function", "function": shown}, FunctionGrammar(name, generated)


def _buildable(
    schema: dict[str, Any], where: str, tokenizer: Tokenizer, vocab_size: int | None
) -> dict[str, Any]:
    """The schema the arguments are generated under: the bounded copy (server.chat.tools.bounds)
    when the grammar engine builds it, else the schema as sent; a 400 when neither builds."""
    bounded = bounded_schema(schema)
    for candidate in (bounded, schema):
        try:
            compile_constraint("json", candidate, tokenizer, vocab_size=vocab_size)
            return candidate
        except GrammarError as exc:
            error = exc
    raise bad_request(f"{where}: {error.message}", "tools", error.code)
