"""POST /v1/responses (whole, or streamed as typed server-sent events), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request runs as the chat completion `server.responses.request` makes of it, through the chat
path's admission, engine events and tool-call parser (`server.openai_api`); only the answer's
shape is this module's: output items (an assistant `message` with `output_text`, and a
`function_call` per call), `status` ("incomplete" when `max_output_tokens` cut it short) and
`usage` in the Responses API's names, the message's logprobs when asked for, and for a stream
the events that build them. A stored response keeps its input items (each given an id) for
`input_items` and `previous_response_id`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from gptserve.server.errors import APIError, bad_request
from gptserve.server.models.routing import request_model
from gptserve.server.openai_api import SSE_HEADERS, AcceptedRequest, accept, collect, stream_pieces
from gptserve.server.protocol import ERROR_RESPONSES
from gptserve.server.responses.request import ChatForm, ResponsesRequest, rename_error, to_chat
from gptserve.server.responses.store import ResponseStore
from gptserve.server.tenancy import TENANT_SCOPE_KEY
from gptserve.server.validation import EngineInputs, Validator
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

router = APIRouter()
INCOMPLETE = "length"  # the engine's finish reason that makes a response incomplete

_SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a response object, or with `stream: true` server-sent events "
        "(`event: TYPE` and `data: {...}`) ending with response.completed, response.incomplete "
        "or error",
        "content": {"text/event-stream": {"schema": {"type": "object"}}},
    },
    **ERROR_RESPONSES,
}


# ---- the answers' shapes (for the OpenAPI schema; the handlers build them as plain dicts) ----


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]  # empty unless include asks for them (or top_logprobs > 0)


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text, valid under the tool's parameters unless cut short
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    background: bool
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]  # message, function_call and function_call_output items
    first_id: str | None
    last_id: str | None
    has_more: bool


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _tenant(request: Request) -> str | None:
    return request.scope.get(TENANT_SCOPE_KEY)


class Shape:
    """The response object of one request, from its start to its end."""

    def __init__(self, req: ResponsesRequest, form: ChatForm, accepted: AcceptedRequest) -> None:
        self.req, self.form, self.accepted = req, form, accepted
        self.id = _new_id("resp")
        self.created_at = accepted.created
        if accepted.tracker.log is not None:  # its finished line names the response's own id
            accepted.tracker.log.response_id = self.id

    def body(self, status: str, output: list[dict[str, Any]], done: bool = True) -> dict[str, Any]:
        req = self.req
        usage = None
        if done:
            chat = self.accepted.usage()
            usage = {
                "input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0,
                },
                "output_tokens": chat["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat["total_tokens"],
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.accepted.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text_format,
            "tool_choice": req.tool_choice or "auto",
            "tools": self.form.tools,
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def finish(self, request: Request, status: str, output: list[dict[str, Any]]) -> dict:
        """The finished response object, stored when the request asks for it."""
        out = self.body(status, output)
        if out["store"]:
            inputs = [item if "id" in item else {**item, "id": _new_id(ITEM_IDS[item["type"]])}
                      for item in self.form.items]  # fmt: skip
            conversation = inputs + [_as_input(item) for item in output]
            _store(request).put(_tenant(request), out, conversation, len(inputs))
        return out


ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}  # id prefixes


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item a later request continues from (its id and status
    kept)."""
    kept = {"id": item["id"], "status": item["status"]}
    if item["type"] == "message":
        text = "".join(part["text"] for part in item["content"])
        return {"type": "message", "role": "assistant", "content": text, **kept}
    return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
            "arguments": item["arguments"], **kept}  # fmt: skip


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored (normalised) input item as `input_items` lists it."""
    status = item.get("status", "completed")  # an earlier answer's own; a client's: completed
    if item["type"] != "message":
        return {**item, "status": status}
    assistant = item["role"] == "assistant"
    part: dict[str, Any] = {"type": "output_text" if assistant else "input_text",
                            "text": item["content"]}  # fmt: skip
    if assistant:
        part["annotations"] = []
    return {"type": "message", "id": item["id"], "role": item["role"], "status": status,
            "content": [part]}  # fmt: skip


def message_logprobs(logprobs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The entries of the tokens that make a message's `text` out of all the answer's
    `logprobs` (with tool calls, those before the first call: the text is what comes before)."""
    kept, length = [], 0
    for entry in logprobs:
        length += len(entry["token"])
        if length > len(text) and kept:
            break
        kept.append(entry)
    return kept if text else []


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message(
    text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": _new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _call(call: dict[str, Any], status: str) -> dict[str, Any]:
    """A chat tool call (server.chat.tools.parser) as a function_call item."""
    return {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"].get("arguments", ""),
        "status": status,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == INCOMPLETE else "completed"


def _validate(form: ChatForm) -> Callable[[Validator], EngineInputs]:
    """Validator.chat of the request's chat form, its errors naming the Responses fields."""

    def validate(validator: Validator) -> EngineInputs:
        try:
            inputs = validator.chat(form.chat)
        except APIError as exc:
            raise rename_error(exc) from None
        if inputs.constraint_param == "response_format":  # a grammar's runtime error names it
            inputs.constraint_param = "text"
        return inputs

    return validate


@router.post("/v1/responses", response_model=ResponseObject, responses=_SSE_RESPONSE)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = await request_model(request, body.model)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = _store(request).get(_tenant(request), body.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"previous_response_id: no stored response {body.previous_response_id!r} (it "
                "was never stored, was dropped, or belongs to another API key)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        earlier = stored.conversation
    context = state.validator.limits.max_model_len if state.validator else None
    if context is not None and isinstance(body.input, list) and len(body.input) > context:
        raise APIError(  # each item renders to at least a token: refused before converting
            400, f"input: {len(body.input)} items are more than this model's context of "
            f"{context} tokens can hold", param="input", code="context_length_exceeded",
        )  # fmt: skip
    form = await run_in_threadpool(to_chat, body, earlier)  # off the event loop: items can be many
    accepted = await accept(state, "chat", _validate(form), request, "responses")
    shape = Shape(body, form, accepted)
    if body.stream:
        return StreamingResponse(
            _stream(shape, request), media_type="text/event-stream", headers=SSE_HEADERS
        )
    await collect(accepted, request)
    choice = accepted.tracker.choices[0]
    text, status = "".join(choice.text), _status(choice.finish_reason)
    parser = accepted.tool_parser(0)
    calls: list[dict[str, Any]] = []
    if parser is not None:
        message = parser.parse_all(text)
        text, calls = message["content"] or "", message.get("tool_calls", [])
        accepted.count_tool_calls(calls)
        # ended at a repeated call: completed, whether or not max_output_tokens came first
        status = _status(parser.finish_reason(choice.finish_reason))
    lps = accepted.logprobs(choice)  # every generated token's (None: not asked for)
    logprobs = lps["content"] if lps else None
    if logprobs and calls:  # the message's tokens only, not the calls'
        logprobs = message_logprobs(logprobs, text)
    output = [_message(text, "completed", logprobs)] if text or not calls else []
    output += [_call(call, "completed") for call in calls]
    output[-1]["status"] = status  # what was cut short is the last item (as a stream ends it)
    return JSONResponse(shape.finish(request, status, output))


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERROR_RESPONSES)
async def get_response(response_id: str, request: Request) -> dict:
    stored = _store(request).get(_tenant(request), response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.body


@router.delete(
    "/v1/responses/{response_id}", response_model=ResponseDeleted, responses=ERROR_RESPONSES
)
async def delete_response(response_id: str, request: Request) -> dict:
    if not _store(request).delete(_tenant(request), response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get(
    "/v1/responses/{response_id}/input_items", response_model=InputItemList,
    responses=ERROR_RESPONSES,
)  # fmt: skip
async def list_input_items(
    response_id: str, request: Request, limit: int = 20,
    order: Literal["asc", "desc"] = "desc", after: str | None = None,
) -> dict:  # fmt: skip
    """The items a stored response answered (those of `previous_response_id` first, then its
    own `input`), newest first unless `order` is asc, `limit` (1..100) a page, from after the
    item `after`."""
    stored = _store(request).get(_tenant(request), response_id)
    if stored is None:
        raise _not_found(response_id)
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    items = [_listed(item) for item in stored.conversation[: stored.inputs]]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in response {response_id!r}",
                              "after")  # fmt: skip
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"no stored response {response_id!r}", param="response_id", code="not_found"
    )


# ---- streaming ------------------------------------------------------------------------------


class _Events:
    """The typed events of one streamed response, numbered, and the output items they build."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being written
        self.logprobs: list[dict[str, Any]] = []  # the open message's tokens' logprobs
        self.pending: list[dict[str, Any]] = []  # tokens' logprobs not sent with a delta yet
        self.calling = False  # a call has begun: later tokens' logprobs are not the message's

    def event(self, kind: str, **fields: Any) -> bytes:  # noqa: ANN401
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    @property
    def index(self) -> int:
        return len(self.output)

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """More of the message's text, and the logprobs of the tokens that brought it (those
        of tokens that brought no text go with the next delta)."""
        out = []
        self.pending += logprobs or []
        if self.open is None or self.open["type"] != "message":
            out += self.close("completed")
            self.open = {**_message("", "in_progress"), "content": []}
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=self.open))  # fmt: skip
            out.append(self.event("response.content_part.added", item_id=self.open["id"],
                                  output_index=self.index, content_index=0,
                                  part=_text_part("")))  # fmt: skip
            self.open["text"] = ""
        self.open["text"] += delta
        if not delta:
            return out
        sent, self.pending = self.pending, []
        self.logprobs += sent
        out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                              output_index=self.index, content_index=0, delta=delta,
                              logprobs=sent))  # fmt: skip
        return out

    def call(self, piece: dict[str, Any]) -> list[bytes]:
        """One `tool_calls` entry of a chat delta: a call's start, or more of its arguments."""
        out = []
        arguments = (piece.get("function") or {}).get("arguments") or ""
        if "id" in piece:
            out += self.close("completed")
            self.open = _call({**piece, "function": {**piece["function"], "arguments": ""}},
                              "in_progress")  # fmt: skip
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=self.open))  # fmt: skip
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=self.open["id"], output_index=self.index,
                                  delta=arguments))  # fmt: skip
        return out

    def close(self, status: str) -> list[bytes]:
        """End the open item (if any) with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "message":
            text = item.pop("text")
            logprobs, self.logprobs, self.pending = self.logprobs + self.pending, [], []
            part = _text_part(text, logprobs)
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=self.index, content_index=0, text=text,
                                  logprobs=logprobs))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=self.index, content_index=0, part=part))  # fmt: skip
            item = {**item, "content": [part]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=self.index, arguments=item["arguments"]))  # fmt: skip
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.output.append(item)
        return out


async def _stream(shape: Shape, request: Request) -> AsyncIterator[bytes]:
    """response.created, in_progress, the items' events, then response.completed (or
    .incomplete); a failure after the start is one `error` event, and the stream ends."""
    accepted = shape.accepted
    events = _Events()
    status_code: int | str = 200
    try:
        started = shape.body("in_progress", [], done=False)
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        finish_reason = None
        async with aclosing(stream_pieces(accepted)) as pieces:
            async for piece in pieces:
                delta = piece["delta"]
                finish_reason = piece["finish_reason"] or finish_reason
                logprobs = (piece.get("logprobs") or {}).get("content")
                if delta.get("tool_calls"):  # from the first call on, no token is the message's
                    events.calling, events.pending = True, []
                if events.calling:
                    logprobs = None
                if delta.get("content"):
                    for chunk in events.text(delta["content"], logprobs):
                        yield chunk
                elif logprobs:  # tokens whose text is not out yet
                    events.pending += logprobs
                for call in delta.get("tool_calls", []):
                    for chunk in events.call(call):
                        yield chunk
        status = _status(finish_reason)
        if events.open is None and not events.output:  # nothing written: an empty message
            for chunk in events.text(""):
                yield chunk
        for chunk in events.close(status):
            yield chunk
        final = shape.finish(request, status, events.output)
        yield events.event(f"response.{status}", response=final)
    except APIError as exc:
        status_code = exc.status
        yield events.event("error", code=exc.code, message=exc.message, param=exc.param)
    except BaseException:  # cancelled: the client went away (the engine request is aborted)
        accepted.tracker.finish(accepted.endpoint, "disconnected")
        raise
    accepted.tracker.finish(accepted.endpoint, status_code)
