"""A chat's messages as its template takes them, with tools, calls and results.

A template that knows tools (it reads `tools`, as Qwen's, Hermes' and Llama 3.1's do) gets them as
transformers hands them over: `tools=[...]`, assistant messages with `tool_calls` whose
`function.arguments` is an object (OpenAI sends JSON text), and tool messages with their
`tool_call_id`. Any other template, the plain "Role: content" one included, gets the tools as a
system turn (`ToolCallFormat.system_block`; the request's own system message comes first in it),
each earlier call written into its assistant message as the model writes calls, and each tool
result as a user turn (`<tool_response>...</tool_response>` for hermes).

With `tool_choice: "none"` the tools are left out of the prompt (the model is not to call them);
earlier calls and results are still rendered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gptserve.server.chat.tools.formats import ToolCallFormat
from gptserve.server.chat.tools.request import ToolRequest
from gptserve.server.errors import bad_request
from gptserve.server.protocol import ChatMessage, ToolCall


@dataclass(frozen=True)
class EarlierCall:
    """A call an assistant message made: its arguments as sent (JSON text) and parsed."""

    id: str
    name: str
    text: str
    arguments: Any

    def for_template(self) -> dict[str, Any]:
        """transformers' shape: OpenAI's, with the arguments an object rather than text."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(
    messages: list[ChatMessage], tools: ToolRequest | None, fmt: ToolCallFormat, knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as dicts for the template, and the `tools` it is passed (or None)."""
    out = []
    for i, message in enumerate(messages):
        calls = _read_calls(message, f"messages[{i}]")
        if message.content is None and not calls:  # as OpenAI checks it
            needs = "content or tool_calls" if message.role == "assistant" else "content"
            raise bad_request(f"messages[{i}]: a {message.role} message needs {needs}", "messages")
        item: dict[str, Any] = {"role": message.role, "content": message_text(message)}
        if message.name:
            item["name"] = message.name
        if knows_tools:
            if calls:
                item["tool_calls"] = [call.for_template() for call in calls]
            if message.role == "tool":
                item["tool_call_id"] = message.tool_call_id
        elif calls:
            written = fmt.separator.join(fmt.call_text(call.name, call.text) for call in calls)
            item["content"] = "\n".join(t for t in (item["content"], written) if t)
        elif message.role == "tool":
            item = {"role": "user", "content": fmt.response_text(item["content"])}
        out.append(item)
    shown = tools.tools if tools is not None and tools.calls else None
    if shown is None or knows_tools:
        return out, shown
    block = fmt.system_block(shown)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _read_calls(message: ChatMessage, where: str) -> list[EarlierCall]:
    """A message's tool_calls, checked (and tool_call_id where it belongs)."""
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(f"{where}: a tool message needs tool_call_id", "messages")
    elif message.tool_call_id is not None:
        raise bad_request(f"{where}.tool_call_id: only a tool message answers a call", "messages")
    if not message.tool_calls:
        return []
    if message.role != "assistant":
        raise bad_request(f"{where}.tool_calls: only an assistant message makes calls", "messages")
    return [
        _read_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls)
    ]


def _read_call(call: ToolCall, where: str) -> EarlierCall:
    if not call.id:
        raise bad_request(f"{where}.id is required", "messages")
    if call.type not in (None, "function"):
        raise bad_request(f'{where}.type must be "function"', "messages")
    function = call.function
    if function is None or not function.name:
        raise bad_request(f"{where}.function.name is required", "messages")
    if function.arguments is None:
        raise bad_request(f"{where}.function.arguments is required", "messages")
    try:
        arguments = json.loads(function.arguments)
    except ValueError:
        raise bad_request(f"{where}.function.arguments is not JSON", "messages") from None
    return EarlierCall(call.id, function.name, function.arguments, arguments)
