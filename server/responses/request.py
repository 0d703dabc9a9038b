"""A Responses request, checked, as the chat request the server runs.

`input` (a string, or message, `function_call` and `function_call_output` items), `instructions`
(a system message first), the flat function `tools`, `tool_choice`, `text.format` and
`max_output_tokens` become `messages`, `tools`, `tool_choice`, `response_format` and
`max_completion_tokens`, and `include: ["message.output_text.logprobs"]` or `top_logprobs` the
chat's `logprobs` and `top_logprobs`; everything else the chat path checks (`Validator.chat`). Its errors
come back naming the Responses field (`rename_error`). Fields OpenAI defines that this server
cannot honour (built-in tools, `background`, `reasoning`, ...) are a 400 naming the field unless
their value asks for what happens anyway; unknown fields are ignored with one log line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from gptserve.server.errors import APIError, bad_request
from gptserve.server.protocol import ChatCompletionRequest, Finite
from gptserve.server.request_fields import Unhonoured, refuse_or_log, sort_extras
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_METADATA_PAIRS = 16  # OpenAI's bounds
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
# a chat field -> the Responses field it came from (for the errors of the chat path)
FIELD_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
# OpenAI's Responses fields this server does not implement, and the values it honours anyway
UNHONOURED = {
    "background": Unhonoured("responses are answered in the request", (False,)),
    "conversation": Unhonoured("there are no conversation objects; use previous_response_id"),
    "reasoning": Unhonoured("the model does not reason in a separate channel", ({},)),
    "prompt": Unhonoured("there are no stored prompt templates"),
    "truncation": Unhonoured(
        "a conversation is never truncated; a long one is a 400", ("disabled",)
    ),  # fmt: skip
    "max_tool_calls": Unhonoured("use parallel_tool_calls: false for one call"),
    "service_tier": Unhonoured("there is one tier", ("auto", "default")),
    "context_management": Unhonoured("a conversation is never compacted"),
}
LOGPROBS = "message.output_text.logprobs"  # the one `include` value: the answer's logprobs
ACCEPTED_EXTRAS = ("prompt_cache_key", "safety_identifier", "stream_options", "prompt_cache_retention")  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: no constraint; json_object: one JSON object; json_schema: JSON valid "
        "under schema"
    )
    name: str | None = Field(None, description="json_schema: 1-64 letters, digits, _ or -")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="only medium (or null): the model has one verbosity"
    )


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (items and tools are checked in `to_chat`, naming their place)."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: see UNHONOURED

    model: str | None = Field(None, description="served model name; omitted means the served one")
    input: str | list[dict[str, Any]] = Field(
        description="a user message's text, or a list of message, function_call and "
        "function_call_output items"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = None
    temperature: Finite | None = Field(None, description="0 is greedy; default 1")
    top_p: Finite | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, description='function tools: {"type": "function", "name", "description", '
        '"parameters", "strict"}',
    )  # fmt: skip
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "name": ...}'
    )
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = Field(
        None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}'
    )
    stream: bool | None = False
    store: bool | None = Field(True, description="keep the response for previous_response_id")
    previous_response_id: str | None = Field(
        None, description="continue a stored response: its input and output come first"
    )
    metadata: dict[str, str] | None = Field(None, description="up to 16 string pairs, echoed")
    user: str | None = None
    include: list[str] | None = Field(
        None, description=f"[\"{LOGPROBS}\"]: the message's tokens' logprobs"
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="0..--max-logprobs: alternatives for each token (logprobs included)",
    )  # fmt: skip

    @property
    def wants_logprobs(self) -> bool:
        """Whether the answer's text comes with its tokens' logprobs."""
        return LOGPROBS in (self.include or []) or (self.top_logprobs or 0) > 0

    @property
    def text_format(self) -> dict[str, Any]:
        """The text configuration as the response echoes it."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        out: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            out.update(name=fmt.name, schema=fmt.schema_, description=fmt.description,
                       strict=fmt.strict)  # fmt: skip
        return {"format": out}


@dataclass(frozen=True)
class ChatForm:
    """A Responses request as a chat: the request to run, and the input items it was made of
    (this request's own, after those of `previous_response_id`) as they are stored."""

    chat: ChatCompletionRequest
    items: list[dict[str, Any]]  # the stored responses' and this request's, normalised
    tools: list[dict[str, Any]]  # the flat tools as the response echoes them


def check_fields(req: ResponsesRequest) -> None:
    """A 400 naming the first field this server cannot honour; a log line for unknown ones."""
    refused, ignored = sort_extras(req.model_extra, UNHONOURED, ACCEPTED_EXTRAS)
    for value in req.include or []:
        if value != LOGPROBS:
            refused.append(("include", Unhonoured(f"{value!r}: only {LOGPROBS!r} can be included")))
            break
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        refused.append(("text", Unhonoured("text.verbosity: the model has one verbosity")))
    refuse_or_log(refused, ignored)
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}",
                "metadata",
            )


def to_chat(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> ChatForm:
    """The chat request of `req` after the conversation `earlier` (a stored response's)."""
    check_fields(req)
    items = read_items(req.input)
    if not items and not earlier:
        raise bad_request("input must not be empty", "input")
    conversation = earlier + items
    check_unique_ids(conversation)
    messages = chat_messages(conversation)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    tools = [read_tool(tool, f"tools[{i}]") for i, tool in enumerate(req.tools or [])]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": bool(req.stream),
        "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in tools
        ]
    if req.tool_choice is not None:
        body["tool_choice"] = read_tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise bad_request("text.format.schema is required for json_schema", "text")
            rf["json_schema"] = {"name": fmt.name, "description": fmt.description,
                                 "schema": fmt.schema_, "strict": fmt.strict}  # fmt: skip
        body["response_format"] = rf
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a value of the wrong kind inside an item or a tool
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        param = FIELD_NAMES.get(loc[0], loc[0]) if loc else "input"
        raise bad_request(f"invalid {param}: {first.get('msg')}", param) from None
    shown = [{**t, "strict": True} for t in tools]  # the schema is always enforced
    return ChatForm(chat, conversation, shown)


def rename_error(exc: APIError) -> APIError:
    """An error of the chat path, naming the Responses fields instead of the chat ones."""
    param = FIELD_NAMES.get(exc.param or "", exc.param)
    message = exc.message
    for chat_name, name in FIELD_NAMES.items():
        message = re.sub(rf"\b{chat_name}\b", name, message)
    if param in ("tools", "tool_choice"):
        message = message.replace(".function.", ".")
    return APIError(exc.status, message, param, exc.code, exc.type, exc.headers)


# ---- input items ----------------------------------------------------------------------------


def read_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as normalised items: messages with text content, calls and their outputs."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return [_read_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _read_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", "input")
        return _with_id(item, {"type": "message", "role": role,
                               "content": _text(item.get("content"), f"{where}.content")},
                        where)  # fmt: skip
    if kind == "function_call":
        out = {"type": "function_call"}
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                raise bad_request(f"{where}.{key} must be a non-empty string", "input")
            out[key] = item[key]
        return _with_id(item, out, where)
    if kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.call_id must be a non-empty string", "input")
        return _with_id(item, {"type": "function_call_output", "call_id": call_id,
                               "output": _text(item.get("output"), f"{where}.output")},
                        where)  # fmt: skip
    if kind is None:
        raise bad_request(f"{where}: an item needs a type (or a role: a message)", "input")
    raise bad_request(
        f"{where}.type {kind!r} is not supported (message, function_call and "
        "function_call_output are)",
        "input",
    )


def _with_id(item: dict[str, Any], out: dict[str, Any], where: str) -> dict[str, Any]:
    """`out` with the `id` the client gave the item (an output item sent back keeps its id)."""
    given = item.get("id")
    if given is not None:
        if not isinstance(given, str) or not given:
            raise bad_request(f"{where}.id must be a non-empty string", "input")
        out["id"] = given
    return out


def check_unique_ids(items: list[dict[str, Any]]) -> None:
    """A 400 for an item id that comes twice in a conversation (the same item sent again, or
    sent back while `previous_response_id` already holds it)."""
    seen: set[str] = set()
    for item in items:
        if "id" in item:
            if item["id"] in seen:
                raise bad_request(
                    f"input: duplicate item id {item['id']!r} (an item comes once in a "
                    "conversation: do not send back the items previous_response_id holds)",
                    "input",
                )
            seen.add(item["id"])


def _text(content: object, where: str) -> str:
    """A string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(
                f"{where}[{j}]: only text parts (input_text, output_text) are supported", "input"
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string", "input")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised items -> chat messages: calls join the assistant message before them (or make
    one), each output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


# ---- tools ----------------------------------------------------------------------------------


def read_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A flat function tool, as given (its name and schema are the chat path's to check)."""
    kind = tool.get("type")
    if kind != "function":
        raise bad_request(
            f"{where}.type {kind!r} is not supported: only function tools (no built-in tools "
            "such as web_search or file_search)",
            "tools",
        )
    out = {"type": "function", "name": tool.get("name")}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            out[key] = tool[key]
    return out


def read_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise bad_request(
            f"tool_choice.type {choice.get('type')!r} is not supported (only a function)",
            "tool_choice",
        )
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice.name is required", "tool_choice")
    return {"type": "function", "function": {"name": name}}
