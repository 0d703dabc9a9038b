"""POST /v1/messages (whole, or streamed as Anthropic's named server-sent events) and
POST /v1/messages/count_tokens.

A request runs as the chat completion `server.messages.request` makes of it, through the chat
path's admission, engine events, reasoning splitter and tool-call parser (`server.openai_api`);
only the answer's shape is this module's: content blocks (`thinking` for a reasoning model's
thought, `text`, a `tool_use` per call with its input parsed), `stop_reason` (`end_turn`,
`max_tokens`, `stop_sequence` with the `stop_sequence` that matched, `tool_use`) and `usage`,
and for a stream the events that build them: message_start, ping, then per block
content_block_start, its deltas (text_delta, thinking_delta, input_json_delta) and
content_block_stop, then message_delta and message_stop; a failure after the start is one
`error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from gptserve.server.chat.reasoning import split as split_reasoning
from gptserve.server.errors import APIError
from gptserve.server.messages.errors import anthropic_error
from gptserve.server.messages.request import (
    CountTokensRequest,
    MessagesRequest,
    rename_error,
    to_chat,
)
from gptserve.server.models.routing import request_model
from gptserve.server.openai_api import SSE_HEADERS, AcceptedRequest, accept, collect, stream_pieces
from gptserve.server.protocol import ChatCompletionRequest
from gptserve.server.streams import Choice
from gptserve.server.validation import EngineInputs, Validator
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

router = APIRouter()
ENDPOINT = "messages"  # the metrics' label


# ---- the answers' shapes (for the OpenAPI schema; the handlers build them as plain dicts) ----


class ErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Every error on these paths: Anthropic's shape."""

    type: Literal["error"]
    error: ErrorDetail


_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {
        "model": AnthropicErrorBody,
        "description": "bad request, auth, unknown model, body too large, overload",
    },
    503: {"model": AnthropicErrorBody, "description": "not ready, engine failed"},
}
_SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a message object, or with `stream: true` server-sent events "
        "(`event: NAME` and `data: {...}`) from message_start to message_stop, or error",
        "content": {"text/event-stream": {"schema": {"type": "object"}}},
    },
    **_ERRORS,
}


class TextOut(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str  # always "": nothing signs a local model's thought


class ToolUseOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]  # valid under the tool's input_schema unless cut short by max_tokens


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageObject(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


# ---- building blocks ------------------------------------------------------------------------


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """A chat tool call (server.chat.tools.parser) as a tool_use block; its input parsed from
    `arguments` (the whole call's), {} where they are not a whole JSON object (cut short)."""
    args = call["function"].get("arguments", "") if arguments is None else arguments
    try:
        value = json.loads(args) if args else {}
    except ValueError:
        value = {}
    return {
        "type": "tool_use",
        "id": tool_use_id(call["id"]),
        "name": call["function"]["name"],
        "input": value if isinstance(value, dict) else {},
    }


def tool_use_id(call_id: str) -> str:
    """Anthropic's id shape (toolu_...) of a chat call's id (call_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(
    finish_reason: str | None, choice: Choice, stop_sequences: list[str] | None
) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a chat finish reason: a stop string the
    request gave is a stop_sequence; one of the chat template's (its turn end) an end_turn."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if choice.stop_reason is not None and choice.stop_reason in (stop_sequences or []):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


class Shape:
    """The message object of one request."""

    def __init__(self, req: MessagesRequest, accepted: AcceptedRequest) -> None:
        self.req, self.accepted = req, accepted
        self.id = f"msg_{uuid.uuid4().hex}"

    def body(
        self, content: list[dict[str, Any]], finish_reason: str | None, done: bool = True
    ) -> dict[str, Any]:
        accepted = self.accepted
        reason, sequence = None, None
        if done:
            choice = accepted.tracker.choices[0]
            reason, sequence = stop_reason(finish_reason, choice, self.req.stop_sequences)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": accepted.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": accepted.prompt_tokens,
                "output_tokens": accepted.tracker.completion_tokens if done else 0,
            },
        }


def _validate(chat: ChatCompletionRequest) -> Callable[[Validator], EngineInputs]:
    """Validator.chat of the request's chat form, its errors naming the Messages fields."""

    def validate(validator: Validator) -> EngineInputs:
        try:
            return validator.chat(chat)
        except APIError as exc:
            raise rename_error(exc) from None

    return validate


# ---- the routes -----------------------------------------------------------------------------


@router.post("/v1/messages", response_model=MessageObject, responses=_SSE_RESPONSE)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = await request_model(request, body.model)
    state.require_ready()
    chat = await run_in_threadpool(to_chat, body)
    accepted = await accept(state, "chat", _validate(chat), request, ENDPOINT)
    shape = Shape(body, accepted)
    if body.stream:
        return StreamingResponse(
            _stream(shape), media_type="text/event-stream", headers=SSE_HEADERS
        )
    await collect(accepted, request)
    choice = accepted.tracker.choices[0]
    text, finish_reason = "".join(choice.text), choice.finish_reason
    reasoning = ""
    if accepted.inputs.reasoning is not None:
        reasoning, text = split_reasoning(accepted.inputs.reasoning, text)
    calls: list[dict[str, Any]] = []
    parser = accepted.tool_parser(0)
    if parser is not None:
        message = parser.parse_all(text)
        text, calls = message["content"] or "", message.get("tool_calls", [])
        accepted.count_tool_calls(calls)
        finish_reason = parser.finish_reason(finish_reason)
    content = [_thinking(reasoning)] if reasoning else []
    if text or not (content or calls):
        content.append(_text(text))
    content += [_tool_use(call) for call in calls]
    return JSONResponse(shape.body(content, finish_reason))


@router.post(
    "/v1/messages/count_tokens", response_model=TokenCount, responses=_ERRORS
)  # fmt: skip
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """The tokens of the prompt a message with these fields would read (the chat template's
    rendering of system, messages and tools): its usage.input_tokens."""
    state = await request_model(request, body.model)
    state.require_ready()
    chat = await run_in_threadpool(to_chat, body, 1)
    inputs = await run_in_threadpool(_validate(chat), state.validator)
    return {"input_tokens": sum(len(p) for p in inputs.prompts)}


# ---- streaming ------------------------------------------------------------------------------


def event(name: str, **fields: Any) -> bytes:  # noqa: ANN401
    data = json.dumps({"type": name, **fields}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


class _Blocks:
    """The content blocks of one streamed message: which is open, and the events that write
    them."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: str | None = None  # the open block's type

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.open = block["type"]
        out.append(event("content_block_start", index=self.count, content_block=block))
        self.count += 1
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.count - 1)]

    def delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", index=self.count - 1, delta={"type": kind, **delta})

    def thinking(self, text: str) -> list[bytes]:
        out = [] if self.open == "thinking" else self.start(_thinking(""))
        return [*out, self.delta("thinking_delta", {"thinking": text})]

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self.start(_text(""))
        return [*out, self.delta("text_delta", {"text": text})]

    def call(self, piece: dict[str, Any]) -> list[bytes]:
        """One `tool_calls` entry of a chat delta: a call's start, or more of its input."""
        out = []
        arguments = (piece.get("function") or {}).get("arguments") or ""
        if "id" in piece:
            out += self.start({**_tool_use(piece, ""), "input": {}})
        if arguments and self.open == "tool_use":
            out.append(self.delta("input_json_delta", {"partial_json": arguments}))
        return out


async def _stream(shape: Shape) -> AsyncIterator[bytes]:
    accepted = shape.accepted
    blocks = _Blocks()
    status: int | str = 200
    try:
        yield event("message_start", message=shape.body([], None, done=False))
        yield event("ping")
        finish_reason = None
        async with aclosing(stream_pieces(accepted)) as pieces:
            async for piece in pieces:
                delta = piece["delta"]
                finish_reason = piece["finish_reason"] or finish_reason
                out: list[bytes] = []
                if delta.get("reasoning_content"):
                    out += blocks.thinking(delta["reasoning_content"])
                if delta.get("content"):
                    out += blocks.text(delta["content"])
                for call in delta.get("tool_calls", []):
                    out += blocks.call(call)
                for chunk in out:
                    yield chunk
        if blocks.count == 0:  # nothing written: an empty text block, as the whole answer has
            for chunk in blocks.start(_text("")):
                yield chunk
        for chunk in blocks.stop():
            yield chunk
        final = shape.body([], finish_reason)
        yield event(
            "message_delta",
            delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
            usage={"output_tokens": final["usage"]["output_tokens"]},
        )
        yield event("message_stop")
    except APIError as exc:
        status = exc.status
        body = anthropic_error(exc.status, exc.message, exc.code)
        yield event("error", error=body["error"])
    except BaseException:  # cancelled: the client went away (the engine request is aborted)
        accepted.tracker.finish(accepted.endpoint, "disconnected")
        raise
    accepted.tracker.finish(accepted.endpoint, status)
