"""Ollama's request bodies, checked, as the requests the server already runs.

`/api/chat` becomes a chat completion (`to_chat`): its messages (`tool_calls` with `arguments`
objects, which get ids; `tool` messages with `tool_name`, which answer the earliest unanswered
call of that name), `tools`, `format` (`"json"`: `response_format` json_object; a JSON schema:
json_schema), `think` (false: the template's `enable_thinking: false`) and `options`.
`/api/generate` becomes a chat completion of one user turn (and `system` before it), or with
`raw: true` a completion of the prompt as it is (`to_generate`). `/api/embed` becomes an
embeddings request (`to_embedding`).

`options` map to the chat path's sampling fields (`OPTION_FIELDS`); the load-time options (the
server loaded its one model once) and a few runtime ones are accepted and ignored
(`IGNORED_OPTIONS`); `num_ctx` is accepted up to the model's context and a 400 above it; options
that ask for a sampler this server lacks are a 400 unless their value turns it off
(`UNHONOURED_OPTIONS`). Everything else the chat path checks, its errors naming Ollama's fields
(`rename_error`). `images` are a 400: the served models read text only.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from gptserve.server.errors import APIError, bad_request
from gptserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Finite,
)
from gptserve.server.request_fields import Unhonoured, refuse_or_log, sort_extras
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# an option -> the chat path's sampling field it sets
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# a chat field -> the Ollama field it came from (for the chat path's errors)
FIELD_NAMES = {
    **{chat: f"options.{option}" for option, chat in OPTION_FIELDS.items()},
    "response_format": "format",
    "chat_template_kwargs": "think",
    "prompt": "prompt",
    "input": "input",
}
# options that change nothing here: the load-time ones (one model, loaded once) and a few
# runtime ones this server's sampler has no use for
IGNORED_OPTIONS = (
    "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
    "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n",
    "penalize_newline", "mirostat_tau", "mirostat_eta",
)  # fmt: skip
UNHONOURED_OPTIONS = {
    "mirostat": Unhonoured("Mirostat sampling is not supported", (0,)),
    "tfs_z": Unhonoured("tail-free sampling is not supported", (1.0,)),
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Options(BaseModel):
    """Ollama's `options`: sampling, `num_predict`, `num_ctx`; others accepted (see the module)."""

    model_config = ConfigDict(strict=True, extra="allow")

    temperature: Finite | None = Field(None, description="0 is greedy")
    top_p: Finite | None = None
    top_k: int | None = Field(None, description="0: off")
    min_p: Finite | None = None
    typical_p: Finite | None = None
    seed: int | None = None
    stop: list[str] | str | None = Field(None, description="strings that end the answer")
    num_predict: int | None = Field(
        None, description="the answer's tokens at most; -1 or -2: up to the context"
    )
    num_ctx: int | None = Field(
        None, description="accepted up to the model's context length (a 400 above it)"
    )
    repeat_penalty: Finite | None = Field(None, description="repetition penalty; 1 is off")
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None


class FunctionCallIn(_Body):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(_Body):
    function: FunctionCallIn


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = Field(None, description="an earlier answer's; not shown again")
    images: list[str] | None = Field(None, description="not supported: a 400 unless empty")
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant message's calls")
    tool_name: str | None = Field(None, description="a tool message: the tool it answers for")


class Function(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: Function


Format = Literal["", "json"] | dict[str, Any]
Think = bool | Literal["high", "medium", "low"]
KeepAlive = int | float | str
KEEP_ALIVE_HELP = (
    'how long the model stays loaded once idle: seconds or a duration ("5m", "1h30m"); 0 '
    "unloads it after the answer, negative never; on a server of one model it always stays"
)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: KeepAlive | None) -> float | None:
    """A keep_alive in seconds (negative: never unload; None: the server's); a 400 naming
    keep_alive for what is neither a number nor a duration."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise bad_request(
            f'keep_alive: {value!r} is not a duration (seconds, or e.g. "5m", "1h30m")',
            "keep_alive",
        )
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


class _Generating(_Body):
    model: str | None = Field(
        None, description="the served model or a LoRA adapter (`NAME:latest` too); omitted means "
        "the served one (Ollama requires it)",
    )  # fmt: skip
    stream: bool | None = Field(None, description="default true: NDJSON, one object a line")
    format: Format | None = Field(None, description='"json" or a JSON schema of the answer')
    options: Options | None = None
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_HELP)
    think: Think | None = Field(None, description="false: a reasoning model answers unthinking")
    logprobs: bool | None = Field(None, description="not supported: a 400 when true")
    top_logprobs: int | None = Field(None, description="not supported: a 400 above 0")


class ChatRequest(_Generating):
    """`POST /api/chat`."""

    messages: list[Message] | None = Field(
        None, description="the conversation; omitted or empty: the model is (already) loaded"
    )
    tools: list[Tool] | None = Field(None, description="functions the model may call")


class GenerateRequest(_Generating):
    """`POST /api/generate`."""

    prompt: str | None = Field(None, description="omitted or empty: the model is loaded")
    system: str | None = Field(None, description="a system prompt before it")
    raw: bool | None = Field(None, description="true: the prompt as it is, no chat template")
    suffix: str | None = Field(None, description="not supported: a 400 unless empty")
    template: str | None = Field(None, description="not supported: a 400 unless empty")
    context: list[int] | None = Field(None, description="accepted and ignored")
    images: list[str] | None = Field(None, description="not supported: a 400 unless empty")


class EmbedRequest(_Body):
    """`POST /api/embed`."""

    model: str | None = Field(None, description="omitted means the served one")
    input: str | list[str] = Field(description="a text or a list of texts")
    truncate: bool | None = Field(
        None, description="default true: an input cut to the model's context; false: a 400"
    )
    dimensions: int | None = Field(None, description="the vectors' dimensions (Matryoshka)")
    options: Options | None = Field(None, description="accepted and ignored")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_HELP)


class EmbeddingsRequest(_Body):
    """`POST /api/embeddings` (Ollama's older embeddings endpoint: one prompt, one vector)."""

    model: str | None = Field(None, description="omitted means the served one")
    prompt: str = Field(description="the text to embed (cut to the model's context)")
    options: Options | None = Field(None, description="accepted and ignored")
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_HELP)


class ShowRequest(_Body):
    """`POST /api/show`."""

    model: str | None = Field(None, description="omitted means the served one")
    name: str | None = Field(None, description="older clients' `model`")
    verbose: bool | None = Field(None, description="accepted; the answer is always whole")


# ---- the model's name -----------------------------------------------------------------------


def not_found(name: str) -> APIError:
    return APIError(404, f'model "{name}" not found, try pulling it first', "model",
                    "model_not_found")  # fmt: skip


def served_name(requested: str | None, names: list[str]) -> str | None:
    """The served name `requested` means (`NAME:latest` is NAME), or a 404 in Ollama's words.
    None: omitted, the base model."""
    if requested is None:
        return None
    for candidate in (requested, requested.removesuffix(":latest")):
        if candidate in names:
            return candidate
    raise not_found(requested)


# ---- options --------------------------------------------------------------------------------


def sampling(options: Options | None, context: int) -> dict[str, Any]:
    """The chat path's sampling fields of `options`; 400s for an option it cannot honour."""
    if options is None:
        return {}
    refuse_or_log(
        *sort_extras(options.model_extra, UNHONOURED_OPTIONS, IGNORED_OPTIONS, prefix="options.")
    )
    if options.num_ctx is not None and not 1 <= options.num_ctx <= context:
        raise bad_request(
            f"options.num_ctx must be between 1 and the model's context length ({context})",
            "options.num_ctx",
        )
    out = {field: getattr(options, option) for option, field in OPTION_FIELDS.items()}
    if out["max_tokens"] is not None and out["max_tokens"] in (-1, -2):
        out["max_tokens"] = None  # Ollama's "no limit" and "fill the context": up to the context
    return {k: v for k, v in out.items() if v is not None}


def _refuse_unsupported(req: _Generating) -> None:
    if req.logprobs:
        raise bad_request("logprobs are not supported on the Ollama API", "logprobs")
    if req.top_logprobs:
        raise bad_request("top_logprobs are not supported on the Ollama API", "top_logprobs")


def _format(fmt: Format | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if not isinstance(fmt, dict):
        raise bad_request('format must be "json" or a JSON schema', "format")
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def _thinking(think: Think | None, thinks: bool, model: str) -> dict[str, Any] | None:
    """The chat_template_kwargs of `think`: a 400 when it asks a model that cannot think."""
    if think is None or think is False:
        return {"enable_thinking": False} if think is False and thinks else None
    if not thinks:
        raise bad_request(f'"{model}" does not support thinking', "think")
    return None


# ---- to the chat path -----------------------------------------------------------------------


def to_chat(
    req: ChatRequest, model: str | None, display: str, thinks: bool, context: int
) -> ChatCompletionRequest:
    """The chat completion of an /api/chat request (`messages` not empty)."""
    _refuse_unsupported(req)
    messages = _chat_messages(req.messages or [])
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": req.stream is not False}
    body.update(sampling(req.options, context))
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": tool.function.model_dump(exclude_none=True)}
            for tool in req.tools
        ]
    return _build(body, req, thinks, display)


def to_generate(
    req: GenerateRequest, model: str | None, display: str, thinks: bool, context: int
) -> ChatCompletionRequest | CompletionRequest:
    """The request an /api/generate request (`prompt` not empty) runs as: a chat completion of
    one user turn, or with `raw` a completion of the prompt as it is."""
    _refuse_unsupported(req)
    for name in ("suffix", "template"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported", name)
    if req.images:
        raise bad_request("images are not supported (the served model reads text only)", "images")
    options = sampling(req.options, context)
    if req.raw:
        if req.think:
            raise bad_request("think cannot be used with raw", "think")
        prompt = (req.system + "\n" if req.system else "") + (req.prompt or "")
        body = {"model": model, "prompt": prompt, "stream": req.stream is not False, **options}
        fmt = _format(req.format)
        if fmt is not None:
            body["response_format"] = fmt
        try:
            return CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise _invalid(exc) from None
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": req.prompt or ""})
    body = {"model": model, "messages": messages, "stream": req.stream is not False, **options}
    return _build(body, req, thinks, display)


def _build(
    body: dict[str, Any], req: _Generating, thinks: bool, display: str
) -> ChatCompletionRequest:
    fmt = _format(req.format)
    if fmt is not None:
        body["response_format"] = fmt
    kwargs = _thinking(req.think, thinks, display)
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = FIELD_NAMES.get(loc[0], loc[0]) if loc else "messages"
    return bad_request(f"invalid {param}: {first.get('msg')}", param)


def _chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as chat messages: calls get ids, each tool message the id of the
    earliest unanswered call of its tool_name (else the earliest unanswered call)."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    count = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.images:
            raise bad_request(
                f"{where}.images: images are not supported (the served model reads text only)",
                "messages",
            )
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(f"{where}.tool_calls: only an assistant message makes calls",
                                  "messages")  # fmt: skip
            calls = []
            for call in message.tool_calls:
                call_id = f"call_{count}"
                count += 1
                open_calls.append((call_id, call.function.name))
                arguments = json.dumps(call.function.arguments, ensure_ascii=False)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})  # fmt: skip
            item["tool_calls"] = calls
        elif message.role == "assistant" and item["content"] is None:
            item["content"] = ""
        if message.role == "tool":
            match = next((c for c in open_calls if c[1] == message.tool_name), None)
            match = match or (open_calls[0] if open_calls else None)
            if match is not None:
                open_calls.remove(match)
            item["tool_call_id"] = match[0] if match else f"call_{message.tool_name or i}"
            item["content"] = item["content"] or ""
        elif message.role in ("system", "user") and item["content"] is None:
            item["content"] = ""
        out.append(item)
    return out


def to_embedding(req: EmbedRequest, model: str | None, inputs: list[Any]) -> EmbeddingRequest:
    body: dict[str, Any] = {"model": model, "input": inputs}
    if req.dimensions is not None:
        body["dimensions"] = req.dimensions
    try:
        return EmbeddingRequest.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def rename_error(exc: APIError) -> APIError:
    """An error of the chat path, naming Ollama's fields instead of the chat ones."""
    param = FIELD_NAMES.get(exc.param or "", exc.param)
    message = exc.message
    if param != exc.param and exc.param:
        message = re.sub(rf"\b{re.escape(exc.param)}\b", param, message)
    return APIError(exc.status, message, param, exc.code, exc.type, exc.headers)
