"""Request bodies of the OpenAI-compatible API as pydantic models (they also make the OpenAPI schema).

Types are strict (no "1" -> 1, no true -> 1); unknown fields are ignored as OpenAI does. Range
checks that depend on the server's limits live in `server.requests`, not here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenIds = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields that completions and chat completions share (OpenAI's plus vLLM-style extensions)."""

    model: str | None = Field(None, description="served model name; omitted means the served one")
    temperature: Finite | None = Field(None, description="0 is greedy; default 1")
    top_p: Finite | None = None
    n: int | None = Field(None, description="completions per prompt (default 1)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    logit_bias: dict[str, Finite] | None = Field(None, description="token id (as a string) -> bias")
    seed: int | None = None
    user: str | None = None
    # extensions
    top_k: int | None = Field(None, description="0 or -1: off")
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists"
    )
    logprobs: int | None = Field(None, description="top alternatives per token, 0..max_logprobs")
    echo: bool | None = False
    suffix: str | None = Field(None, description="not supported; must be omitted or null")
    best_of: int | None = Field(None, description="not supported; must be omitted, null or 1")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="not supported; must be empty")
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')


class TokenizeRequest(_Body):
    prompt: str
    model: str | None = None


class DetokenizeRequest(_Body):
    tokens: list[int]
    model: str | None = None
