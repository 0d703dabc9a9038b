"""Request bodies of the OpenAI-compatible API as pydantic models (they also make the OpenAPI schema).

Types are strict (no "1" -> 1, no true -> 1). Unknown fields are ignored as OpenAI does (those
of a completions or chat body are kept in `model_extra`, where `server.request_fields` refuses
vLLM's fields that this server does not honour and logs the rest). Every other check (ranges,
limits, rules between fields) is in `server.validation`, not here.
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
    continuous_usage_stats: bool | None = Field(
        None,
        description="not supported (vLLM's usage in every chunk); must be omitted, null or false",
    )


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`: the schema and its name."""

    name: str | None = Field(None, description="1-64 letters, digits, _ or -")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None,
        alias="schema",
        description="a JSON Schema (the output is compact JSON valid under it)",
    )
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: no constraint; json_object: one JSON object; json_schema: JSON valid "
        "under json_schema.schema"
    )
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (the form current vLLM clients send): exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid")  # an unknown key may be a constraint

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON Schema (an object, or the schema as JSON text)"
    )
    regex: str | None = Field(None, description="the whole output matches it (Rust regex syntax)")
    choice: list[str] | None = Field(None, description="the output is exactly one of these")
    json_object: bool | None = Field(None, description="true: the output is one JSON object")
    grammar: str | None = Field(
        None, description="a grammar the output follows: GBNF (llama.cpp's) or Lark (llguidance's)"
    )
    structural_tag: str | dict[str, Any] | None = Field(
        None, description="not supported; must be omitted or null"
    )
    whitespace_pattern: str | None = Field(
        None, description="not supported: JSON is always written without whitespace"
    )
    disable_any_whitespace: bool | None = Field(None, description="accepted; JSON is compact")
    disable_fallback: bool | None = Field(None, description="accepted; there is one backend")
    disable_additional_properties: bool | None = Field(
        None, description="only false: use additionalProperties: false in the schema"
    )


class StructuredFields(_Body):
    """Structured output: at most one of these constrains a request's output."""

    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": ...}'
    )
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(
        None, description="older vLLM: structured_outputs.json"
    )
    guided_regex: str | None = Field(None, description="older vLLM: structured_outputs.regex")
    guided_choice: list[str] | None = Field(
        None, description="older vLLM: structured_outputs.choice"
    )
    guided_grammar: str | None = Field(None, description="older vLLM: structured_outputs.grammar")
    grammar: str | None = Field(
        None, description="llama.cpp's server: a GBNF grammar the output follows (Lark too)"
    )

    @property
    def asks_for_structure(self) -> bool:
        """Whether a constraint field is set (its compile then runs off the event loop)."""
        fields = (self.structured_outputs, self.guided_json, self.guided_regex,
                  self.guided_choice, self.guided_grammar, self.grammar)  # fmt: skip
        rf = self.response_format
        return (rf is not None and rf.type != "text") or any(f is not None for f in fields)


class SamplingFields(StructuredFields):
    """Fields that completions and chat completions share (OpenAI's plus vLLM-style extensions)."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: see request_fields

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
    # llama.cpp's samplers (engine.sampler says how each works and in which order)
    typical_p: Finite | None = Field(None, description="locally typical sampling, (0, 1]; 1: off")
    xtc_probability: Finite | None = Field(
        None, description="XTC: the chance a step removes the top choices, [0, 1]; 0: off"
    )
    xtc_threshold: Finite | None = Field(
        None,
        description="XTC: tokens at least this probable but the least of them go, [0, 1]; "
        "default 0.1; above 0.5: off",
    )
    dry_multiplier: Finite | None = Field(
        None, description="DRY: the repetition penalty's scale, >= 0; 0 (default): off"
    )
    dry_base: Finite | None = Field(None, description="DRY: > 1; default 1.75")
    dry_allowed_length: int | None = Field(
        None, description="DRY: repetitions up to this long go free, >= 0; default 2"
    )
    dry_penalty_last_n: int | None = Field(
        None, description="DRY: the tokens it looks back over; -1 (default): all, 0: off"
    )
    dry_sequence_breakers: list[str] | None = Field(
        None,
        description="DRY: a repetition never spans these, up to 16 strings of 1-32 characters; "
        'default ["\\n", ":", "\\"", "*"]',
    )
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    cache_salt: str | None = Field(
        None,
        min_length=1,
        description="prompts share cached prefixes only with requests of the same salt (and, "
        "by default, of the same API key); use a long random value per tenant",
    )


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


class FunctionCall(_Body):
    name: str | None = None
    arguments: str | None = Field(None, description="the arguments as JSON text")


class ToolCall(_Body):
    """A call an earlier assistant message made (checked in `server.chat.tools.prompt`)."""

    id: str | None = None
    type: str | None = Field(None, description='"function"')
    function: FunctionCall | None = None


class _Message(_Body):
    """What every chat message may carry; each role's own model says what it must."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="the speaker: the chat template's {name}")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: str | list[TextPart]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantTurn(_Message):
    """An earlier answer: its content, its calls, or both (checked in server.chat.tools.prompt)."""

    role: Literal["assistant"]


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[TextPart]


# a message's role says which fields it needs, as OpenAI's API has it: content for every role but
# the assistant's (whose turn may be calls only)
ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantTurn | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(_Body):
    name: str | None = Field(None, description="1-64 letters, digits, _ or -")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments object; omitted: no arguments"
    )
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class Tool(_Body):
    """OpenAI's tool object (checked in `server.chat.tools.request`)."""

    type: str | None = Field(None, description='"function"')
    function: FunctionDefinition | None = None


class NamedFunction(_Body):
    name: str | None = None


class NamedToolChoice(_Body):
    type: str | None = Field(None, description='"function"')
    function: NamedFunction | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"none", "auto" (the default with tools), "required", or '
        '{"type": "function", "function": {"name": ...}}',
    )
    parallel_tool_calls: bool | None = Field(None, description="more than one call (default)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='variables for the chat template, e.g. {"enable_thinking": false}'
    )

    @property
    def asks_for_structure(self) -> bool:
        """A constraint field, or tools (their schemas are compiled too)."""
        return bool(self.tools) or super().asks_for_structure


class EmbeddingRequest(_Body):
    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists "
        "(up to --max-prompts inputs)"
    )
    model: str | None = Field(None, description="served model name; omitted means the served one")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes"
    )
    dimensions: int | None = Field(
        None,
        description="the model's hidden size, or for a Matryoshka-trained model a width it "
        "was trained for",
    )
    user: str | None = None


class TokenizeRequest(_Body):
    prompt: str
    model: str | None = None


class DetokenizeRequest(_Body):
    tokens: list[int]
    model: str | None = None


# ---- responses (for the OpenAPI schema; the handlers build these shapes as plain dicts) -------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorInfo


_ERROR = {"model": ErrorBody}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    # "4XX" also keeps FastAPI from documenting a 422 that this server never sends
    "4XX": {**_ERROR, "description": "bad request, auth, unknown model, body too large, overload"},
    503: {**_ERROR, "description": "not ready, engine failed"},
}
# the same for a route whose success is plain text: its errors are still JSON (FastAPI would
# document them under the route's text/plain)
_JSON_ERROR = {
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
}
PLAIN_TEXT_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {**_JSON_ERROR, "description": response["description"]}
    for status, response in ERROR_RESPONSES.items()
}
COMPLETION_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
}
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a JSON body, or with `stream: true` server-sent events ending in `[DONE]`",
        "content": {
            "text/event-stream": {  # OpenAPI 3.1: `schema` describes one event
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {
                            "type": "string",
                            "description": 'a JSON chunk, an {"error": ...} object or [DONE]',
                        }
                    },
                }
            }
        },
    }
}


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose keys and values came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, valid under the tool's parameters


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the message is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (--reasoning-parser)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None  # None: not loaded (a server of several models)
    root: str | None = None  # where it was read from for an admin (server.admin), else its id
    parent: str | None = None  # a LoRA adapter's base model (its id), as vLLM lists it
    loaded: bool = True  # whether it is loaded now (server.models loads on demand)
    error: str | None = None  # why it cannot be served (a bad file of --models-dir)


class LoadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    # the model the adapter is for, on a server of several models (default: the default model)
    base_model: str | None = Field(None, min_length=1, max_length=256)


class UnloadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1, max_length=256)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "failed", "dead", "unhealthy"]
    model: str | None = None
    failed_steps: int | None = None
    running: int | None = None
    waiting: int | None = None
    # why it cannot serve: a message ("failed", "dead"), or the error of every request
    # ("unhealthy": code engine_unhealthy)
    error: str | ErrorInfo | None = None
