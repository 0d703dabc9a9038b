"""Ollama's API over the served model and its LoRA adapters (each adapter a model name too):
GET /api/version, /api/tags, /api/ps; POST /api/show, /api/chat, /api/generate, /api/embed
(and the older /api/embeddings).

A chat or generate request runs as the chat completion (or, with `raw`, the completion) that
`server.ollama.request` makes of it, through the chat path's admission, engine events, reasoning
splitter and tool-call parser (`server.openai_api`); only the answer's shape is this module's:
NDJSON by default (`application/x-ndjson`, one object a line; a failure after the start is one
`{"error": ...}` line), one object with `stream: false`, and in the last object `done: true`,
`done_reason` and the counts and durations (nanoseconds) Ollama reports. A tool call comes whole
in one object, its `arguments` an object. An empty chat or prompt answers `done_reason: "load"`
at once, as Ollama does when it only loads the model.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from gptserve.server.admin import is_admin
from gptserve.server.chat.reasoning import split as split_reasoning
from gptserve.server.embeddings_api import create_embeddings
from gptserve.server.error_shapes import with_param
from gptserve.server.errors import APIError
from gptserve.server.models.routing import request_model
from gptserve.server.ollama.errors import ollama_error
from gptserve.server.ollama.request import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ShowRequest,
    keep_alive_seconds,
    rename_error,
    served_name,
    to_chat,
    to_embedding,
    to_generate,
)
from gptserve.server.openai_api import (
    SSE_HEADERS,
    AcceptedRequest,
    accept,
    collect,
    stream_pieces,
)
from gptserve.server.protocol import ChatCompletionRequest, CompletionRequest
from gptserve.server.runtime import LoadedModel, ServerState
from gptserve.server.tenancy import TENANT_SCOPE_KEY
from gptserve.server.validation import EngineInputs, Validator
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gptserve import __version__

router = APIRouter(tags=["ollama"])
NDJSON = "application/x-ndjson"
KEEP_ALIVE = timedelta(minutes=5)  # what /api/ps reports on a server of one model (no unload)


# ---- the answers' shapes (for the OpenAPI schema; the handlers build plain dicts) -----------


class OllamaErrorBody(BaseModel):
    """Every error on these paths: Ollama's shape."""

    error: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": OllamaErrorBody, "description": "bad request, auth, unknown model, overload"},
    503: {"model": OllamaErrorBody, "description": "not ready, engine failed"},
}
_NDJSON_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "one object, or by default NDJSON: one object a line, the last with "
        '`done: true` (or `{"error": ...}`)',
        "content": {NDJSON: {"schema": {"type": "object"}}},
    },
    **_ERRORS,
}


class Details(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class TagsResponse(BaseModel):
    models: list[ModelEntry]


class RunningModel(ModelEntry):
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(BaseModel):
    version: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(BaseModel):
    function: ToolCallFunction


class MessageOut(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class _Final(BaseModel):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatResponse(_Final):
    message: MessageOut


class GenerateResponse(_Final):
    response: str
    thinking: str | None = None


class EmbeddingsResponse(BaseModel):
    embedding: list[float]


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


# ---- the served models ----------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _names(state: ServerState, request: Request) -> list[str]:
    """The served model and the adapters the request's key may use (a fine-tuned model is its
    owner's only, where the state knows owners)."""
    return [state.loaded.name, *_adapters(state, request)]


def _adapters(state: ServerState, request: Request) -> list[str]:
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    may_use = getattr(state, "may_use", None)
    return [n for n in list(state.lora_names) if may_use is None or may_use(n, tenant)]


def _file_facts(source: str) -> dict[str, Any]:
    """What /api/tags tells of a model that is not loaded: its file's size and time."""
    path = Path(source)
    try:
        size = path.stat().st_size if path.is_file() else sum(
            f.stat().st_size for f in path.iterdir() if f.is_file()
        )  # fmt: skip
        modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except OSError:
        size, modified = 0, datetime.now(timezone.utc)
    kind = "gguf" if path.suffix == ".gguf" else "safetensors"
    return {
        "count": 0,
        "size": size,
        "modified_at": modified.isoformat().replace("+00:00", "Z"),
        "family": "",
        "details": {"parent_model": "", "format": kind, "family": "", "families": [],
                    "parameter_size": "", "quantization_level": ""},
    }  # fmt: skip


def _family(loaded: LoadedModel) -> str:
    path = loaded.path
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        try:
            kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (ValueError, OSError):
            kind = None
        if isinstance(kind, str) and kind:
            return kind
    return "llama" if loaded.model.config.pos_encoding == "rotary" else "gpt2"


def _size_text(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _quantization(state: ServerState, loaded: LoadedModel) -> str:
    if state.settings.quantize == "int8":
        return "Q8_0"
    param = next(loaded.model.parameters(), None)
    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    return names.get(str(param.dtype).removeprefix("torch."), "unknown") if param is not None else "unknown"  # fmt: skip


def _model_facts(state: ServerState, loaded: LoadedModel) -> dict[str, Any]:
    """Size, parameters, digest and details of the served model (adapters share them); `loaded`
    is the state's model as the caller saw it (an unload may clear `state.loaded` meanwhile)."""
    model = loaded.model
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    size = sum(p.numel() * p.element_size() for p in params)
    size += sum(b.numel() * b.element_size() for b in model.buffers())
    path = loaded.path
    try:
        modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except OSError:
        modified = datetime.now(timezone.utc)
    family = _family(loaded)
    return {
        "count": count,
        "size": size,
        "modified_at": modified.isoformat().replace("+00:00", "Z"),
        "family": family,
        "details": {
            "parent_model": "",
            "format": "gguf" if path.suffix == ".gguf" else "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": _size_text(count),
            "quantization_level": _quantization(state, loaded),
        },
    }


def _entry(name: str, facts: dict[str, Any], base: str) -> dict[str, Any]:
    digest = hashlib.sha256(f"{name}\0{facts['modified_at']}".encode()).hexdigest()
    details = dict(facts["details"])
    if name != base:
        details["parent_model"] = base
    return {"name": name, "model": name, "modified_at": facts["modified_at"],
            "size": facts["size"], "digest": digest, "details": details}  # fmt: skip


@router.get("/api/version", response_model=VersionResponse, responses=_ERRORS)
async def version() -> dict:
    return {"version": __version__}


@router.get("/api/tags", response_model=TagsResponse, responses=_ERRORS)
async def tags(request: Request) -> dict:
    """The served models and their LoRA adapters (a model of several not loaded now: what its
    file tells)."""
    models = request.app.state.models
    if not models.many:
        models.state(None).require_ready()
    listed = []
    for spec in models.specs():
        if spec.error is not None:
            continue
        state = models.state(spec.name or None)
        loaded = state.loaded  # once: an unload may clear it meanwhile
        if loaded is not None:
            facts = await run_in_threadpool(_model_facts, state, loaded)
        else:
            facts = await run_in_threadpool(_file_facts, spec.source)
        base = spec.name or loaded.name
        names = [base, *_adapters(state, request)]
        listed += [_entry(name, facts, base) for name in names]
    return {"models": listed}


@router.get("/api/ps", response_model=PsResponse, responses=_ERRORS)
async def ps(request: Request) -> dict:
    """The loaded models, each with when it unloads if it stays idle (`expires_at`; a server
    of one model never unloads: five minutes on, as Ollama's default keep_alive)."""
    models = request.app.state.models
    if not models.many:
        models.state(None).require_ready()
    listed = []
    for name, state in models.loaded():
        async_engine, loaded = state.async_engine, state.loaded
        if async_engine is None or loaded is None:  # unloaded meanwhile
            continue
        facts = await run_in_threadpool(_model_facts, state, loaded)
        base, context = loaded.name, async_engine.limits.max_model_len
        unloads = models.expires_at(name)
        expires = (
            datetime.now(timezone.utc) + KEEP_ALIVE
            if unloads is None
            else datetime.fromtimestamp(unloads, timezone.utc)
        )
        listed += [
            {
                **_entry(served, facts, base),
                "expires_at": expires.isoformat().replace("+00:00", "Z"),
                "size_vram": 0,
                "context_length": context,
            }  # fmt: skip
            for served in [base, *_adapters(state, request)]
        ]
    return {"models": listed}


@router.post("/api/show", response_model=ShowResponse, responses=_ERRORS)
async def show(body: ShowRequest, request: Request) -> dict:
    state = await request_model(request, body.model or body.name)
    async_engine = state.require_ready()
    loaded = state.loaded  # the request's lease keeps it loaded
    base = loaded.name
    name = served_name(body.model or body.name, _names(state, request)) or base
    facts = await run_in_threadpool(_model_facts, state, loaded)
    config = loaded.model.config
    family, context = facts["family"], async_engine.limits.max_model_len
    template = loaded.template
    capabilities = ["completion"]
    if template.knows_tools:
        capabilities.append("tools")
    if state.validator.reasoning_format is not None:
        capabilities.append("thinking")
    stops = [s for s in getattr(template, "stop", []) if s]
    return {
        "modelfile": "",
        "parameters": "\n".join(f"stop {json.dumps(s, ensure_ascii=False)}" for s in stops),
        "template": getattr(template, "source", "") or "",
        "details": _entry(name, facts, base)["details"],
        "model_info": {
            "general.architecture": family,
            "general.parameter_count": facts["count"],
            f"{family}.context_length": context,
            f"{family}.embedding_length": config.n_embd,
            f"{family}.block_count": config.n_layer,
            f"{family}.attention.head_count": config.n_head,
        },
        "capabilities": capabilities,
        "modified_at": facts["modified_at"],
    }


# ---- chat and generate ----------------------------------------------------------------------


def _validate(
    build: Callable[[int], ChatCompletionRequest | CompletionRequest],
) -> Callable[[Validator], EngineInputs]:
    """The check of the request `build` makes (given the context length), its errors naming
    Ollama's fields."""

    def validate(validator: Validator) -> EngineInputs:
        try:
            req = build(validator.limits.max_model_len)
            if isinstance(req, CompletionRequest):
                return validator.completion(req)
            return validator.chat(req)
        except APIError as exc:
            raise rename_error(exc) from None

    return validate


class _Answer:
    """One chat or generate answer: its shape, whole or a line at a time."""

    def __init__(self, accepted: AcceptedRequest, model: str, chat: bool) -> None:
        self.accepted, self.model, self.chat = accepted, model, chat

    def line(self, content: str = "", thinking: str = "", calls: list | None = None) -> dict:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(self, finish_reason: str | None, **message: Any) -> dict:  # noqa: ANN401
        accepted = self.accepted
        tracker = accepted.tracker
        now = time.perf_counter()
        started = tracker.started
        scheduled = tracker.scheduled_at or started
        first = tracker.first_token_at or now

        def ns(seconds: float) -> int:
            return max(0, int(seconds * 1e9))

        out = self.line(**message)
        out.update(
            done=True,
            done_reason="length" if finish_reason == "length" else "stop",
            total_duration=ns(now - started),
            load_duration=0,
            prompt_eval_count=accepted.prompt_tokens,
            prompt_eval_duration=ns(first - scheduled),
            eval_count=tracker.completion_tokens,
            eval_duration=ns(now - first),
        )
        return out


def _call(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """A chat tool call as Ollama's: `{"function": {"name", "arguments": {...}}}`."""
    text = call["function"].get("arguments") or "" if arguments is None else arguments
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        value = {}
    return {"function": {"name": call["function"]["name"],
                         "arguments": value if isinstance(value, dict) else {}}}  # fmt: skip


def _loaded(model: str, chat: bool, unload: bool = False) -> dict[str, Any]:
    """The answer to an empty chat or prompt: the model is loaded (or, with `unload`, unloads
    once this answer is sent)."""
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return {**out, "done": True, "done_reason": "unload" if unload else "load"}


def _allowed_keep_alive(request: Request, seconds: float | None) -> float | None:
    """A request's keep_alive as this key may set it: unloading a model sooner than the server's
    --keep-alive (0: at once) is an operator's action, so a key without the admin scope may keep
    a model longer, not shorter (its shorter value becomes the server's)."""
    default = request.app.state.models.settings.keep_alive
    if seconds is None or seconds < 0 or is_admin(request):
        return seconds
    return None if default < 0 else max(seconds, default)


async def _run(
    request: Request,
    body: ChatRequest | GenerateRequest,
    build: Callable[[str | None, str, bool, int], ChatCompletionRequest | CompletionRequest],
    chat: bool,
) -> Response:
    keep_alive = _allowed_keep_alive(request, keep_alive_seconds(body.keep_alive))
    models = request.app.state.models
    state = await request_model(request, body.model)
    state.require_ready()
    adapter = served_name(body.model, _names(state, request))
    display = body.model or state.loaded.name
    models.set_keep_alive(body.model, keep_alive)  # 0: it unloads once this answer is sent
    empty = not body.messages if isinstance(body, ChatRequest) else not body.prompt
    if empty:  # Ollama's way to load a model, or with keep_alive 0 to unload it
        return JSONResponse(_loaded(display, chat, unload=models.many and keep_alive == 0))
    thinks = state.validator.reasoning_format is not None
    kind = "chat"
    if isinstance(body, GenerateRequest) and body.raw:
        kind = "completion"
    validate = _validate(lambda context: build(adapter, display, thinks, context))
    accepted = await accept(state, kind, validate, request, "ollama")
    answer = _Answer(accepted, display, chat)
    if body.stream is not False:
        return StreamingResponse(_stream(answer), media_type=NDJSON, headers=SSE_HEADERS)
    await collect(accepted, request)
    choice = accepted.tracker.choices[0]
    text, finish_reason = "".join(choice.text), choice.finish_reason
    reasoning = ""
    if kind == "chat" and accepted.inputs.reasoning is not None:
        reasoning, text = split_reasoning(accepted.inputs.reasoning, text)
    calls: list[dict[str, Any]] = []
    parser = accepted.tool_parser(0) if kind == "chat" else None
    if parser is not None:
        message = parser.parse_all(text)
        text, chat_calls = message["content"] or "", message.get("tool_calls", [])
        accepted.count_tool_calls(chat_calls)
        calls = [_call(c) for c in chat_calls]
    final = answer.final(finish_reason, content=text, thinking=reasoning, calls=calls)
    return JSONResponse(final)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


async def _stream(answer: _Answer) -> AsyncIterator[bytes]:
    accepted = answer.accepted
    status: int | str = 200
    calls: dict[int, dict[str, Any]] = {}  # a call's index -> its chat call, arguments joined
    try:
        finish_reason = None
        async with aclosing(stream_pieces(accepted)) as pieces:
            async for piece in pieces:
                finish_reason = piece["finish_reason"] or finish_reason
                if not answer.chat or accepted.kind == "completion":
                    text = piece.get("text") or (piece.get("delta") or {}).get("content") or ""
                    thinking = (piece.get("delta") or {}).get("reasoning_content") or ""
                    if text or thinking:
                        yield _line(answer.line(text, thinking))
                    continue
                delta = piece["delta"]
                for call in delta.get("tool_calls", []):
                    index = call.get("index", len(calls))
                    known = calls.setdefault(index, {"function": {"name": "", "arguments": ""}})
                    function = call.get("function") or {}
                    if function.get("name"):
                        known["function"]["name"] = function["name"]
                    known["function"]["arguments"] += function.get("arguments") or ""
                content, thinking = delta.get("content") or "", delta.get("reasoning_content") or ""
                if content or thinking:
                    yield _line(answer.line(content, thinking))
        if calls:  # each call whole, as Ollama sends them
            yield _line(answer.line(calls=[_call(calls[i]) for i in sorted(calls)]))
        yield _line(answer.final(finish_reason))
    except APIError as exc:
        status = exc.status
        yield _line(ollama_error(with_param(exc.message, exc.param)))
    except BaseException:  # cancelled: the client went away (the engine request is aborted)
        accepted.tracker.finish(accepted.endpoint, "disconnected")
        raise
    accepted.tracker.finish(accepted.endpoint, status)


@router.post("/api/chat", response_model=ChatResponse, responses=_NDJSON_RESPONSE)
async def chat(body: ChatRequest, request: Request) -> Response:
    return await _run(
        request, body, lambda m, d, t, c: to_chat(body, m, d, t, c), chat=True
    )  # fmt: skip


@router.post("/api/generate", response_model=GenerateResponse, responses=_NDJSON_RESPONSE)
async def generate(body: GenerateRequest, request: Request) -> Response:
    return await _run(
        request, body, lambda m, d, t, c: to_generate(body, m, d, t, c), chat=False
    )  # fmt: skip


# ---- embed ----------------------------------------------------------------------------------


def _inputs(state: ServerState, body: EmbedRequest, limit: int) -> list[Any]:
    """The inputs, each cut to `limit` tokens unless `truncate` is false (then a long one is
    the embeddings path's 400)."""
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if body.truncate is False:
        return texts
    tokenizer = state.loaded.tokenizer
    try:
        ids = [tokenizer.encode(text) for text in texts]
    except (ValueError, UnicodeError):
        return texts  # the embeddings path names what is wrong with it
    if all(len(i) <= limit for i in ids) or any(not i for i in ids):
        return texts
    return [i[:limit] for i in ids]


@router.post("/api/embed", response_model=EmbedResponse, responses=_ERRORS)
async def embed(body: EmbedRequest, request: Request) -> Response:
    return JSONResponse(await _embed(body, request))


@router.post("/api/embeddings", response_model=EmbeddingsResponse, responses=_ERRORS)
async def embeddings(body: EmbeddingsRequest, request: Request) -> dict:
    """Ollama's older endpoint: `{"model", "prompt"}` -> `{"embedding": [...]}`."""
    if not body.prompt:  # as Ollama: no text, no vector
        state = await request_model(request, body.model)
        state.require_ready()
        served_name(body.model, _names(state, request))
        return {"embedding": []}
    req = EmbedRequest(model=body.model, input=body.prompt)
    try:
        return {"embedding": (await _embed(req, request))["embeddings"][0]}
    except APIError as exc:
        if exc.param != "input":
            raise
        message = re.sub(r"\binput\b", "prompt", exc.message)
        raise APIError(exc.status, message, "prompt", exc.code, exc.type, exc.headers) from None


async def _embed(body: EmbedRequest, request: Request) -> dict[str, Any]:
    keep_alive = _allowed_keep_alive(request, keep_alive_seconds(body.keep_alive))
    state = await request_model(request, body.model)
    async_engine = state.require_ready()
    request.app.state.models.set_keep_alive(body.model, keep_alive)
    started = time.perf_counter()
    adapter = served_name(body.model, _names(state, request))
    limit = async_engine.limits.max_model_len
    if state.settings.max_prompt_tokens is not None:
        limit = min(limit, state.settings.max_prompt_tokens)
    inputs = await run_in_threadpool(_inputs, state, body, limit)
    try:
        answer = await create_embeddings(to_embedding(body, adapter, inputs), request)
    except APIError as exc:
        raise rename_error(exc) from None
    data = json.loads(answer.body)
    return {
        "model": body.model or state.loaded.name,
        "embeddings": [item["embedding"] for item in data["data"]],
        "total_duration": max(0, int((time.perf_counter() - started) * 1e9)),
        "load_duration": 0,
        "prompt_eval_count": data["usage"]["prompt_tokens"],
    }
