"""A Messages request, checked, as the chat request the server runs.

`system` (a string or text blocks) becomes a system message first; each message's content (a
string, or `text`, `tool_use`, `tool_result` and `thinking` blocks) becomes chat messages: an
assistant's `tool_use` blocks its `tool_calls` (the input as JSON text), a user's `tool_result`
blocks `tool` messages (in order, before the text after them), an earlier answer's `thinking`
blocks are dropped (chat templates drop earlier reasoning too). `tools` (`name`, `description`,
`input_schema`) become function tools, `tool_choice` `auto` / `any` / `tool` / `none` the chat's
`auto` / `required` / a named function / `none` (`disable_parallel_tool_use` its
`parallel_tool_calls: false`), `stop_sequences` its `stop`, `metadata.user_id` its `user`,
`thinking: {"type": "disabled"}` the template's `enable_thinking: false`. Everything else the chat
path checks (`Validator.chat`); its errors come back naming the Messages fields (`rename_error`).
An `image` or `document` block is a 400: the served models read text only.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from gptserve.server.errors import APIError, bad_request
from gptserve.server.protocol import ChatCompletionRequest, Finite
from gptserve.server.request_fields import Unhonoured, refuse_or_log, sort_extras
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# a chat field -> the Messages field it came from (for the errors of the chat path)
FIELD_NAMES = {
    "stop": "stop_sequences",
    "user": "metadata",
    "parallel_tool_calls": "tool_choice",
    "chat_template_kwargs": "thinking",
}
# Anthropic's fields this server does not implement, and the values it honours anyway
UNHONOURED = {
    "mcp_servers": Unhonoured("there is no MCP connector", ([],)),
    "container": Unhonoured("there are no code-execution containers"),
    "context_management": Unhonoured("a conversation is never edited by the server"),
    "service_tier": Unhonoured("there is one tier", ("auto", "standard_only")),
    "speed": Unhonoured("there is one speed", ("standard",)),
    "output_config": Unhonoured("use a tool with an input_schema for JSON output", ({},)),
}
ACCEPTED_EXTRAS = ("cache_control",)  # prompt prefixes are cached anyway (prefix caching)
TOOL_TYPES = (None, "custom")  # client tools; server tools (web_search_..., bash_...) are not


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---- content blocks -------------------------------------------------------------------------


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted; changes nothing")


class ImageBlock(_Body):
    type: Literal["image"]
    source: dict[str, Any] | None = Field(None, description="not supported: a 400")


class DocumentBlock(_Body):
    type: Literal["document"]
    source: dict[str, Any] | None = Field(None, description="not supported: a 400")


class ToolUseBlock(_Body):
    """An earlier answer's call (an assistant message's)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Body):
    """A call's result (a user message's)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = Field(None, description='true: the model reads "Error: " first')
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Body):
    """An earlier answer's thinking: accepted and not shown to the model again."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


UserBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolResultBlock, Field(discriminator="type")
]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class UserMessageParam(_Body):
    role: Literal["user"]
    content: list[UserBlock] | str = Field(
        description="text, or text and tool_result blocks (image and document blocks: a 400)"
    )


class AssistantMessageParam(_Body):
    """An earlier answer (the last message may not be one: no prefill)."""

    role: Literal["assistant"]
    content: list[AssistantBlock] | str = Field(
        description="text, or text, tool_use and thinking blocks"
    )


MessageParam = Annotated[UserMessageParam | AssistantMessageParam, Field(discriminator="role")]


# ---- tools ----------------------------------------------------------------------------------


class ToolParam(_Body):
    name: str = Field(description="1-64 letters, digits, _ or -")
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the input object (required for client tools)"
    )
    type: str | None = Field(None, description='"custom" or omitted: server tools are a 400')
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Body):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Body):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(_Body):
    type: Literal["enabled"]
    budget_tokens: int | None = Field(None, description="accepted; not enforced")


class ThinkingDisabled(_Body):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class Metadata(_Body):
    user_id: str | None = Field(None, max_length=256)


# ---- the bodies -----------------------------------------------------------------------------


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what a message's prompt is made of."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: see UNHONOURED

    model: str | None = Field(
        None, description="the served model's name (or a LoRA adapter's); omitted means the "
        "served one (Anthropic's API requires it)",
    )  # fmt: skip
    messages: list[MessageParam] = Field(
        min_length=1, description="user and assistant turns; content a string or blocks"
    )
    system: str | list[TextBlock] | None = Field(None, description="a system prompt first")
    tools: list[ToolParam] | None = Field(
        None, description='client tools: {"name", "description", "input_schema"}'
    )
    tool_choice: ToolChoice | None = Field(
        None, description='{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'
    )
    thinking: Thinking | None = Field(
        None, description='{"type": "disabled"}: a reasoning model answers without thinking'
    )


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` (blocks and tools are checked in `to_chat`, naming their place)."""

    max_tokens: int = Field(ge=1, description="the answer's tokens at most")
    stop_sequences: list[str] | None = Field(None, description="strings that end the answer")
    temperature: Finite | None = Field(None, description="0 is greedy; default 1")
    top_p: Finite | None = None
    top_k: int | None = Field(None, description="0 or -1: off")
    metadata: Metadata | None = Field(None, description='{"user_id": ...}')
    stream: bool | None = False


# ---- to a chat request ----------------------------------------------------------------------


def check_fields(req: CountTokensRequest) -> None:
    """A 400 naming the first field this server cannot honour; a log line for unknown ones."""
    refuse_or_log(*sort_extras(req.model_extra, UNHONOURED, ACCEPTED_EXTRAS))


def to_chat(req: CountTokensRequest, max_tokens: int | None = None) -> ChatCompletionRequest:
    """The chat request of `req` (a count_tokens request's with `max_tokens`, for its check)."""
    check_fields(req)
    messages = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _joined(req.system)
        messages.append({"role": "system", "content": system})
    last = len(req.messages) - 1
    for i, message in enumerate(req.messages):
        if message.role == "assistant" and i == last:
            raise bad_request(
                f"messages[{i}]: a last assistant message (a prefill the answer continues) is "
                "not supported: end with a user message",
                "messages",
            )
        messages += _chat_messages(message, f"messages[{i}]")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, stream=bool(req.stream),
            user=req.metadata.user_id if req.metadata is not None else None,
        )  # fmt: skip
    else:
        body["max_tokens"] = max_tokens
    if req.tools:
        body["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {
            "auto": "auto", "any": "required", "none": "none",
            "tool": {"type": "function", "function": {"name": getattr(choice, "name", None)}},
        }[choice.type]  # fmt: skip
        if getattr(choice, "disable_parallel_tool_use", None):
            body["parallel_tool_calls"] = False
    if req.thinking is not None and req.thinking.type == "disabled":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a value of the wrong kind inside a block or a tool
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        param = FIELD_NAMES.get(loc[0], loc[0]) if loc else "messages"
        raise bad_request(f"invalid {param}: {first.get('msg')}", param) from None


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _chat_messages(
    message: UserMessageParam | AssistantMessageParam, where: str
) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: an assistant's text and calls in one message; a
    user's tool results as tool messages and its text as user messages, in their order."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        here = f"{where}.content[{j}]"
        if block.type in ("image", "document"):
            raise bad_request(
                f"{here}: {block.type} blocks are not supported (the served model reads text only)",
                "messages",
            )
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
        elif isinstance(block, ToolResultBlock):
            if texts:  # the text before it is a user message of its own
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block, here)})  # fmt: skip
        # thinking and redacted_thinking: an earlier answer's, not shown again
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
        if calls:
            turn["tool_calls"] = calls
        elif turn["content"] is None:
            turn["content"] = ""  # only thinking (or nothing): an empty answer
        return [turn]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, TextBlock):
                raise bad_request(f"{where}.content[{k}]: {part.type} blocks are not supported "
                                  "(the served model reads text only)", "messages")  # fmt: skip
            parts.append(part.text)
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _tool(tool: ToolParam, where: str) -> dict[str, Any]:
    """A client tool as the chat's function tool (its name and schema are the chat path's to
    check)."""
    if tool.type not in TOOL_TYPES:
        raise bad_request(
            f"{where}.type {tool.type!r} is not supported: only client tools with an "
            "input_schema (no server tools such as web_search)",
            "tools",
        )
    if tool.input_schema is None:
        raise bad_request(f"{where}.input_schema is required", "tools")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def rename_error(exc: APIError) -> APIError:
    """An error of the chat path, naming the Messages fields instead of the chat ones."""
    param = FIELD_NAMES.get(exc.param or "", exc.param)
    message = exc.message
    if param != exc.param:
        message = re.sub(rf"\b{re.escape(exc.param or '')}\b", param, message)
    if param in ("tools", "tool_choice"):
        message = message.replace(".function.parameters", ".input_schema")
        message = message.replace(".function.", ".")
    return APIError(exc.status, message, param, exc.code, exc.type, exc.headers)
