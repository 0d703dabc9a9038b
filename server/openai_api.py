"""POST /v1/completions and /v1/chat/completions, answered whole or streamed as server-sent events."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from gptserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineUnhealthyError
from gptserve.engine.sequence import GRAMMAR_ERROR, SEQUENCE_ERROR, TokenEvent, TokenLogprob
from gptserve.server.chat.reasoning import ReasoningSplitter
from gptserve.server.chat.reasoning import split as split_reasoning
from gptserve.server.chat.tools.parser import ToolCallParser
from gptserve.server.errors import APIError, error_body
from gptserve.server.models.routing import request_model
from gptserve.server.protocol import (
    COMPLETION_ERRORS,
    SSE_RESPONSE,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from gptserve.server.request_ids import current_request_id
from gptserve.server.request_log import RequestLog
from gptserve.server.runtime import ServerState
from gptserve.server.streams import (
    Choice,
    ChoiceTracker,
    ClientGone,
    RequestTimeout,
    engine_id,
    merged_events,
)
from gptserve.server.tenancy import TENANT_SCOPE_KEY, request_cache_salt
from gptserve.server.validation import EngineInputs, Validator
from starlette.concurrency import run_in_threadpool

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_RESPONSES = {**SSE_RESPONSE, **COMPLETION_ERRORS}


def sse(obj: object, ascii_only: bool = False) -> bytes:
    return (
        b"data: "
        + json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only).encode()
        + b"\n\n"
    )


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class AcceptedRequest:
    """One accepted request: everything the answer is built from."""

    kind: str  # "completion" or "chat"
    id: str
    created: int
    model: str
    async_engine: AsyncEngine
    inputs: EngineInputs
    tracker: ChoiceTracker
    timeout: float
    stream_interval: int = 1  # a choice's tokens per chunk after its first (--stream-interval)
    tool_parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # by choice
    endpoint: str = ""  # the metrics' label (default: kind)
    splitters: dict[int, ReasoningSplitter] = field(default_factory=dict)  # by choice
    # a whole answer's calls read as they come (`watch_calls`), by choice
    call_watchers: dict[int, ToolCallParser] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)  # choices ended at a repeated call

    def __post_init__(self) -> None:
        self.endpoint = self.endpoint or self.kind

    def split_reasoning(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """Choice `index`'s new text as (reasoning, content) for a stream, where the model's
        reasoning is split apart (else all of it is content)."""
        fmt = self.inputs.reasoning
        if fmt is None:
            return "", text
        splitter = self.splitters.setdefault(index, ReasoningSplitter(fmt))
        reasoning, content = splitter.feed(text)
        if finished:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def tool_parser(self, index: int) -> ToolCallParser | None:
        """The parser of choice `index`'s tool calls, when the request has tools to call."""
        fmt = self.inputs.tool_format
        if fmt is None:
            return None
        if index not in self.tool_parsers:
            self.tool_parsers[index] = ToolCallParser(fmt)
        return self.tool_parsers[index]

    def end_choice(self, index: int) -> None:
        """Choice `index`'s answer is over before the engine ended it: it repeated a tool call
        (`ToolCallParser.repeated`). Its sequence is stopped so that no more tokens are spent on
        it, and what the engine still sends of it is not read."""
        if index not in self.ended:
            self.ended.add(index)
            n = self.inputs.params.n
            self.async_engine.finish(engine_id(self.id, index // n), index % n)

    def watch_calls(self, choice: Choice, text_start: int, finished: bool) -> None:
        """A whole chat answer's calls, read as its text comes (the answer itself is parsed from
        the whole text at the end, to the same calls): one that repeats an earlier call ends
        the choice (`end_choice`), as a stream's parser does."""
        fmt = self.inputs.tool_format
        if self.kind != "chat" or fmt is None:
            return
        watcher = self.call_watchers.setdefault(choice.index, ToolCallParser(fmt))
        _, text = self.split_reasoning(choice.index, "".join(choice.text[text_start:]), finished)
        watcher.feed(text, last=finished)
        if watcher.repeated:
            self.end_choice(choice.index)

    def count_tool_calls(self, calls: list[dict]) -> None:
        """Calls handed to the client (a streamed call counts at its first chunk)."""
        started = sum(1 for call in calls if "id" in call)
        if started:
            self.tracker.metrics.tool_calls.inc(started)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.inputs.prompts)

    def usage(self) -> dict:
        done = self.tracker.completion_tokens
        n = self.inputs.params.n  # choices p*n .. p*n + n-1 share prompt p
        cached = sum(c.num_cached_tokens for c in self.tracker.choices[::n])
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def apply(self, index: int, event: TokenEvent, prompt_lps: dict) -> tuple[Choice, int, int]:
        """Record an event; returns the choice and where its new text and logprobs begin."""
        choice = self.tracker.choices[index]
        text_start, lp_start = len(choice.text), len(choice.lp_tokens)
        prompt_index = index // self.inputs.params.n
        if event.prompt_logprobs is not None:
            prompt_lps[prompt_index] = event.prompt_logprobs
        echo = self.inputs.echo_texts
        if echo is not None and text_start == 0:
            lps = (
                prompt_lps.get(prompt_index)
                if self.inputs.params.prompt_logprobs is not None
                else None
            )
            self.tracker.add_prompt(
                choice, self.inputs.prompts[prompt_index], echo[prompt_index], lps
            )
        if event.logprobs and self.inputs.params.constraint is not None:
            event.logprobs = [_without_masked_alternatives(lp) for lp in event.logprobs]
        self.tracker.update(choice, event)
        return choice, text_start, lp_start

    def chunk(self, choices: list[dict]) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.inputs.include_usage:
            out["usage"] = None
        return out

    def logprobs(self, choice: Choice, start: int = 0) -> dict | None:
        if self.inputs.params.logprobs is None:
            return None
        if self.kind == "completion":
            return self.tracker.completion_logprobs(choice, start)
        return self.tracker.chat_logprobs(choice, start)


def _without_masked_alternatives(lp: TokenLogprob) -> TokenLogprob:
    """Without the alternatives a structured-output mask ruled out: their logprob is -inf (not
    JSON), and they were never possible. Fewer than `logprobs` may remain."""
    top = [(t, v) for t, v in lp.top if v > -math.inf]
    return lp if len(top) == len(lp.top) else TokenLogprob(lp.token, lp.logprob, top)


def _failed(accepted: AcceptedRequest, choice: Choice) -> APIError:
    """The error a failed choice ends its request with: its grammar's (400 naming the field),
    its own (503 with its message) or the engine's (503, a generic message: the cause may speak
    of other requests and is in the log)."""
    if choice.error_code == GRAMMAR_ERROR:
        param = accepted.inputs.constraint_param
        message = f"{param}: {choice.error}" if param else choice.error
        return APIError(400, message, param=param, code=GRAMMAR_ERROR)
    if choice.error_code == SEQUENCE_ERROR:
        return APIError(503, f"this request failed: {choice.error}", code=SEQUENCE_ERROR)
    return APIError(503, f"the engine failed this request: {choice.error}", code="engine_error")


def engine_stopped(exc: EngineDeadError) -> APIError:
    """The engine died, or gave up after too many failed steps (EngineUnhealthyError)."""
    what = "is unhealthy" if isinstance(exc, EngineUnhealthyError) else "has stopped"
    return APIError(503, f"the engine {what}: {exc}", code=exc.code)


# a request cut short by --request-timeout ends as one cut short by max_tokens: with what it
# generated and this finish reason, never with nothing after minutes
TIMEOUT_FINISH = "length"


def check_queue(state: ServerState, async_engine: AsyncEngine, tenant: str | None) -> None:
    """429 when the queue is full: with API keys, each key's own queue (one key's backlog
    never turns another key away), else the server's."""
    waiting = (
        async_engine.num_waiting if tenant is None else async_engine.engine.num_waiting_of(tenant)
    )
    if waiting >= state.settings.max_queue:
        raise APIError(
            429, "the server is overloaded: too many requests are waiting; retry later",
            code="queue_full", headers={"Retry-After": "1"},
        )  # fmt: skip


async def accept(
    state: ServerState,
    kind: str,
    validate: Callable[[Validator], EngineInputs],
    request: Request,
    endpoint: str | None = None,
) -> AcceptedRequest:
    """Check a request and take it in: its engine inputs, its tenant's cache salt, its tracker.

    The check renders the chat template, tokenizes and may compile a grammar (up to a few hundred
    milliseconds for a huge request): always off the event loop, which every stream shares.
    endpoint: the metrics' label when it is not `kind` (the Responses API runs as a chat).
    """
    async_engine = state.require_ready()
    inputs = await run_in_threadpool(validate, state.validator)
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    state.check_owner(inputs.params.lora, tenant)  # another key's fine-tuned model: 404
    check_queue(state, async_engine, tenant)
    loaded, prompts, params = state.loaded, inputs.prompts, inputs.params
    # the request's own cache_salt (validated) joins its API key's tenant (server.tenancy)
    params.tenant = tenant  # admitted in turn with other keys' requests (engine.scheduler)
    params.cache_salt = request_cache_salt(
        state.settings.prefix_cache_scope, tenant, params.cache_salt
    )
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    tracker = ChoiceTracker(
        len(prompts) * params.n, loaded.tokenizer, state.metrics, time.perf_counter()
    )
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    model = params.lora or loaded.name  # the name the request asked for
    # the body's id carries the request's X-Request-Id, and a part of its own: a client may send
    # one id twice at once, and the engine's ids must stay apart
    request_id = current_request_id.get()
    body_id = f"{prefix}-{request_id}-{uuid.uuid4().hex[:8]}" if request_id else None
    accepted = AcceptedRequest(
        kind, body_id or f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, async_engine,
        inputs,
        tracker, state.settings.request_timeout, state.settings.stream_interval,
        endpoint=endpoint or kind,
    )  # fmt: skip
    tracker.log = RequestLog.begin(  # its finished line and span, where the tracker finishes
        request, accepted.endpoint, accepted.id, model, accepted.prompt_tokens, tracker.started,
        params,
    )  # fmt: skip
    return accepted


async def _answer(
    state: ServerState,
    kind: str,
    validate: Callable[[Validator], EngineInputs],
    request: Request,
) -> Response:
    """Check a request, queue it and answer it: a stream, or the whole completion."""
    accepted = await accept(state, kind, validate, request)
    if accepted.inputs.stream:
        return StreamingResponse(
            _stream(accepted), media_type="text/event-stream", headers=SSE_HEADERS
        )
    await collect(accepted, request)
    choices = [_whole_choice(accepted, c) for c in accepted.tracker.choices]
    obj = "text_completion" if kind == "completion" else "chat.completion"
    out = {
        "id": accepted.id,
        "object": obj,
        "created": accepted.created,
        "model": accepted.model,
        "choices": choices,
        "usage": accepted.usage(),
    }
    return JSONResponse(out)


def _whole_choice(accepted: AcceptedRequest, c: Choice) -> dict:
    text, finish_reason = "".join(c.text), c.finish_reason
    parser = accepted.tool_parser(c.index) if accepted.kind == "chat" else None
    reasoning = None
    if accepted.kind == "chat" and accepted.inputs.reasoning is not None:
        reasoning, text = split_reasoning(accepted.inputs.reasoning, text)
    if accepted.kind == "completion":
        body = {"index": c.index, "text": text}
    elif parser is None:
        body = {"index": c.index, "message": {"role": "assistant", "content": text}}
    else:
        message = parser.parse_all(text)
        accepted.count_tool_calls(message.get("tool_calls", []))
        body = {"index": c.index, "message": message}
        finish_reason = parser.finish_reason(finish_reason)
    if reasoning is not None:
        body["message"]["reasoning_content"] = reasoning
    return {**body, "logprobs": accepted.logprobs(c), "finish_reason": finish_reason}


@router.post("/v1/completions", response_model=CompletionResponse, responses=_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = await request_model(request, body.model)
    return await _answer(state, "completion", lambda v: v.completion(body), request)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = await request_model(request, body.model)
    return await _answer(state, "chat", lambda v: v.chat(body), request)


def _events(accepted: AcceptedRequest, watch: Request | None = None):  # noqa: ANN202
    """The request's engine events, all its choices merged, closed when the caller leaves."""
    return aclosing(
        merged_events(
            accepted.async_engine,
            accepted.id,
            accepted.inputs.prompts,
            accepted.inputs.params,
            accepted.timeout,
            watch=watch,
        )  # fmt: skip
    )


async def collect(accepted: AcceptedRequest, request: Request) -> None:
    """Run a non-streaming request to the end; a client that hangs up aborts it."""
    prompt_lps: dict = {}
    endpoint = accepted.endpoint
    try:
        async with _events(accepted, watch=request) as events:
            async for index, event in events:
                choice, text_start, _ = accepted.apply(index, event, prompt_lps)
                if index in accepted.ended:
                    continue  # its answer ended at a repeated tool call: the rest is not read
                if choice.error is not None:
                    raise _failed(accepted, choice)
                accepted.watch_calls(choice, text_start, event.finish_reason is not None)
    except RequestTimeout:  # what it generated, cut short (--request-timeout)
        for choice in accepted.tracker.choices:
            if choice.finish_reason is None and choice.error is None:
                if choice.index not in accepted.ended:
                    choice.finish_reason = TIMEOUT_FINISH
    except EngineDeadError as exc:
        accepted.tracker.finish(endpoint, 503)
        raise engine_stopped(exc) from None
    except ClientGone:
        accepted.tracker.finish(endpoint, "disconnected")
        raise
    except APIError as exc:
        accepted.tracker.finish(endpoint, exc.status)
        raise
    accepted.tracker.finish(endpoint, 200)


def _delta(
    accepted: AcceptedRequest, choice: Choice, event: TokenEvent, text_start: int, lp_start: int
) -> dict | None:
    """A stream chunk's choice with what the event released; None when it released nothing
    yet (a held-back stop-string prefix or partial character)."""
    text = "".join(choice.text[text_start:])
    reasoning = ""
    if accepted.kind == "chat":
        reasoning, text = accepted.split_reasoning(
            choice.index, text, event.finish_reason is not None
        )
    lps = accepted.logprobs(choice, lp_start)
    new_lps = lps and lps["tokens" if accepted.kind == "completion" else "content"]
    if not text and not reasoning and event.finish_reason is None and not new_lps:
        return None
    finish_reason = event.finish_reason
    parser = accepted.tool_parser(choice.index) if accepted.kind == "chat" else None
    if accepted.kind == "completion":
        body: dict = {"index": choice.index, "text": text}
    elif parser is None:
        delta = {"content": text} if text or (event.finish_reason is None and not reasoning) else {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        body = {"index": choice.index, "delta": delta}
    else:  # tool calls: the text is read into content and calls, some of it held back
        delta, finish_reason = parser.stream_delta(text, event.finish_reason)
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        if not delta and finish_reason is None and not new_lps:
            return None
        accepted.count_tool_calls(delta.get("tool_calls", []))
        body = {"index": choice.index, "delta": delta}
    return {**body, "logprobs": lps, "finish_reason": finish_reason}


async def stream_pieces(accepted: AcceptedRequest) -> AsyncIterator[dict]:
    """A stream's choice pieces (what `_delta` builds), in order, honouring --stream-interval and
    ending each choice cut short by --request-timeout; a failure is an APIError."""
    prompt_lps: dict = {}
    held: dict[int, tuple[int, int]] = {}  # choice -> where its held text starts
    sent: dict[int, int] = {}  # choice -> its tokens when it last sent a chunk
    try:
        async with _events(accepted) as events:
            async for index, event in events:
                choice, text_start, lp_start = accepted.apply(index, event, prompt_lps)
                if index in accepted.ended:
                    continue  # its answer ended at a repeated tool call: nothing more is sent
                if choice.error is not None:
                    raise _failed(accepted, choice)
                text_start, lp_start = held.pop(index, (text_start, lp_start))
                if (
                    event.finish_reason is None
                    and index in sent
                    and choice.num_generated - sent[index] < accepted.stream_interval
                ):
                    held[index] = (text_start, lp_start)  # --stream-interval: not yet
                    continue
                piece = _delta(accepted, choice, event, text_start, lp_start)
                parser = accepted.tool_parsers.get(index)
                if parser is not None and parser.repeated:  # the piece ends it: "tool_calls"
                    accepted.end_choice(index)
                if piece is not None:
                    sent[index] = choice.num_generated
                    yield piece
    except RequestTimeout:  # each unfinished choice ends here, with what it generated
        for choice in accepted.tracker.choices:
            if choice.finish_reason is not None or choice.error is not None:
                continue
            if choice.index in accepted.ended:
                continue
            choice.finish_reason = TIMEOUT_FINISH
            text_start, lp_start = held.pop(choice.index, (len(choice.text), len(choice.lp_tokens)))  # fmt: skip
            cut = TokenEvent(accepted.id, choice.index, [], "", [], TIMEOUT_FINISH)
            piece = _delta(accepted, choice, cut, text_start, lp_start)
            if piece is not None:
                yield piece
    except EngineDeadError as exc:
        raise engine_stopped(exc) from None


async def _stream(accepted: AcceptedRequest) -> AsyncIterator[bytes]:
    """SSE chunks; errors after the start are one error event, then [DONE]."""
    status: int | str = 200
    try:
        if accepted.kind == "chat":
            calls_only = accepted.inputs.calls_only
            opening = [
                {
                    "index": c.index,
                    # null, as in the whole answer, when the answer can only be tool calls
                    "delta": {"role": "assistant", "content": None if calls_only else ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in accepted.tracker.choices
            ]
            yield sse(accepted.chunk(opening))
        async with aclosing(stream_pieces(accepted)) as pieces:
            async for piece in pieces:
                yield sse(accepted.chunk([piece]))
        if accepted.inputs.include_usage:
            final = accepted.chunk([])
            final["usage"] = accepted.usage()
            yield sse(final)
    except APIError as exc:
        status = exc.status
        yield sse(error_body(exc.message, exc.type, exc.param, exc.code), ascii_only=True)
    except BaseException:  # cancelled: the client went away (the engine request is aborted)
        status = "disconnected"
        accepted.tracker.finish(accepted.endpoint, status)
        raise
    yield SSE_DONE
    accepted.tracker.finish(accepted.endpoint, status)
