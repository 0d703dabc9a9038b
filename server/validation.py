"""The request boundary: a parsed request body in, engine inputs out, or a 400 naming the field.

pydantic (server.protocol) checks the shape and types of a body. Here the HTTP fields become
the engine's inputs (prompts as token ids, `SamplingParams`), with the OpenAI rules between
fields and the structured-output fields (`server.structured_request`); every limit (the server's
caps from `Settings`, the engine's context, vocabulary and KV pool, the sampler's ranges) is then
checked in one call, `RequestLimits.admit` (engine.limits), whose `RequestError` becomes a 400
naming the field. What leaves `Validator.completion` or `Validator.chat` is admitted: the engine
takes it unchecked.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gptserve.engine.errors import RequestError
from gptserve.engine.grammar import AfterToken
from gptserve.engine.limits import AdmittedRequest, EngineLimits, FieldNames, RequestLimits
from gptserve.engine.pooling import EmbeddingSpec, PoolingParams
from gptserve.engine.sampler import LLAMA_CPP_SAMPLER_FIELDS, DryBreakerIndex, SamplingParams
from gptserve.model.tokenizers import Tokenizer
from gptserve.server.chat.reasoning import (
    FORMATS,
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningFormat,
    default_format,
)
from gptserve.server.chat.templates import ChatFormat, environment_names
from gptserve.server.chat.tools.formats import ToolCallFormat, format_for_template
from gptserve.server.chat.tools.prompt import chat_messages
from gptserve.server.chat.tools.request import ToolRequest, read_tools
from gptserve.server.errors import APIError, bad_request
from gptserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    SamplingFields,
    StructuredFields,
    TokenizeRequest,
)
from gptserve.server.request_fields import check_extra_fields
from gptserve.server.settings import Settings
from gptserve.server.structured_request import constraint_from_fields

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# what a chat template is given by the server, which chat_template_kwargs may not replace
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


@dataclass
class EngineInputs:
    """One accepted generation request, ready for the engine."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # the stream ends with a usage chunk
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    tool_format: ToolCallFormat | None = None  # chat with tools: how the answer's calls read
    constraint_param: str | None = None  # the field whose grammar constrains the output
    calls_only: bool = False  # chat: the answer is tool calls, never text (content null)
    reasoning: ReasoningFormat | None = None  # chat: the answer's reasoning, split apart


@dataclass
class EmbeddingInputs:
    """One accepted embeddings request: its inputs as token ids, pooled with params.pooling."""

    prompts: list[list[int]]
    params: SamplingParams
    base64: bool = False  # encoding_format "base64"


def check_model(
    requested: str | None, served: str, adapters: Mapping[str, str] | None = None
) -> str | None:
    """The LoRA adapter a request's `model` names (None: the served model); a 404 for a name
    that is neither."""
    if requested is None or requested == served:
        return None
    if adapters and requested in adapters:
        return requested
    # fine-tuned models (ft:...) belong to API keys: no other key learns their names here
    listed = [n for n in (adapters or {}) if not n.startswith("ft:")]
    names = ", ".join(repr(n) for n in [served, *listed])
    raise APIError(
        404,
        f"the model {requested!r} does not exist; this server serves {names}",
        param="model",
        code="model_not_found",
    )


@contextmanager
def limit_as_400() -> Iterator[None]:
    """A RequestError (engine.limits, engine.sampler, server.structured_request) as a 400
    naming the field."""
    try:
        yield
    except RequestError as exc:
        raise bad_request(exc.message, exc.param, code=exc.code) from None


def encode_text(
    tokenizer: Tokenizer, text: str, param: str, allow_special: bool | None = None,
    add_special_tokens: bool = False,
) -> list[int]:  # fmt: skip
    """Text -> ids; the empty string becomes [BOS] or, with no BOS (GPT-2), [end-of-text].
    add_special_tokens prepends BOS where the tokenizer does (a Llama prompt)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the text contains invalid Unicode (lone surrogates)", param) from None
    if not text:
        bos = tokenizer.bos_token_id
        return [bos if bos is not None else tokenizer.eot_token]
    return tokenizer.encode(text, allow_special, add_special_tokens)


def _items(value: str | list, param: str) -> list:
    """A prompt field's items: a string or a list of token ids is one; else the list's items."""
    if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
        return [value]
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    return list(value)


@dataclass(frozen=True)
class Validator:
    """Checks requests for one served model against the server's and the engine's limits."""

    settings: Settings
    limits: EngineLimits
    name: str  # the served model's name
    tokenizer: Tokenizer
    template: ChatFormat
    embedding_spec: EmbeddingSpec = EmbeddingSpec()  # the served model's pooling and widths
    # the LoRA adapters loaded, name -> source (the server's, kept up to date as they change)
    adapters: Mapping[str, str] = field(default_factory=dict)

    def model_of(self, requested: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model), or a 404."""
        return check_model(requested, self.name, self.adapters)

    @functools.cached_property
    def tool_format(self) -> ToolCallFormat:
        """How this model writes tool calls (--tool-call-parser, else its chat template's way)."""
        return format_for_template(self.template, self.settings.tool_call_parser)

    @functools.cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """How this model writes its reasoning (--reasoning-parser, else its chat template's)."""
        if self.settings.reasoning_parser is not None:
            return FORMATS[self.settings.reasoning_parser]
        return default_format(self.template.source)

    @functools.cached_property
    def reasoning_tokens(self) -> tuple[int | None, int] | None:
        """The tokens a constraint waits for: the opening one the format writes first (None
        where the prompt opened the block) and the closing one; None where one of them is no
        single token of this tokenizer (or the model does not reason)."""
        fmt = self.reasoning_format
        if fmt is None:
            return None

        def single(text: str) -> int | None:
            ids = self.tokenizer.encode(text, allow_special=True)
            return ids[0] if len(ids) == 1 else None

        opening, end = single(THINK_OPEN) if fmt.opens_in_output else None, single(THINK_CLOSE)
        if end is None or (fmt.opens_in_output and opening is None):
            return None
        return opening, end

    @functools.cached_property
    def request_limits(self) -> RequestLimits:
        """The engine's limits with this server's caps on one request."""
        settings = self.settings
        return RequestLimits(
            self.limits, max_n=settings.max_n, max_tokens=settings.max_tokens_limit,
            max_prompt_tokens=settings.max_prompt_tokens, max_logprobs=settings.max_logprobs,
            max_prompts=settings.max_prompts, max_stop=settings.max_stop,
            max_stop_length=settings.max_stop_length, max_logit_bias=settings.max_logit_bias,
        )  # fmt: skip

    @functools.cached_property
    def dry_breaker_index(self) -> DryBreakerIndex:
        """DRY's sequence breakers as this tokenizer's tokens (built at the first DRY request)."""
        return DryBreakerIndex(self.tokenizer)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Characters past which a text can never fit the context, found before any rendering or
        tokenizing: no token spells more bytes than the vocabulary's longest, and a character is
        at least a byte, so a text of more characters than this is more tokens than the context
        holds."""
        tok = self.tokenizer
        longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
        return self.limits.max_model_len * max(longest, 1)

    def _bound_chars(self, texts: Iterable[str], param: str) -> None:
        """A 400 naming `param` when `texts` together are more characters than any prompt that
        fits (`max_prompt_chars`): before the template renders them or the tokenizer runs."""
        total, bound = 0, self.max_prompt_chars
        for text in texts:
            total += len(text)
            if total > bound:
                raise bad_request(
                    f"more than {bound} characters, more than this model's context of "
                    f"{self.limits.max_model_len} tokens can hold", param, "context_length_exceeded",
                )  # fmt: skip

    def _bound_messages(self, messages: Sequence[Any]) -> None:
        """Cheap bounds on a chat's messages before its template renders them: how many (each
        renders to at least a token) and how many characters."""
        context = self.limits.max_model_len
        if len(messages) > context:
            raise bad_request(
                f"{len(messages)} messages are more than this model's context of {context} tokens "
                "can hold", "messages", "context_length_exceeded",
            )  # fmt: skip
        texts = (
            part.text if hasattr(part, "text") else part
            for m in messages
            for part in ([m.content] if isinstance(m.content, str) else m.content or [])
        )
        self._bound_chars(texts, "messages")

    def _admit(
        self, prompts: list[list[int]], params: SamplingParams, names: FieldNames,
        constrained: bool,
    ) -> AdmittedRequest:  # fmt: skip
        """Every limit, in one call (engine.limits); a violation is a 400 naming the field."""
        with limit_as_400():
            return self.request_limits.admit(prompts, params, names, constrained)

    # ---- endpoints ------------------------------------------------------------------------

    def completion(self, req: CompletionRequest) -> EngineInputs:
        lora = self.model_of(req.model)
        check_extra_fields(req, "completion", self.tokenizer)
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != 1:
            raise bad_request("best_of is not supported (only 1)", "best_of")
        include_usage = self._stream_options(req)
        logprobs = req.logprobs
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = self.request_limits.default_max_tokens(DEFAULT_COMPLETION_MAX_TOKENS)
        params = self._sampling_params(
            req, max_tokens, logprobs,
            prompt_logprobs=logprobs if req.echo and logprobs is not None else None,
        )  # fmt: skip
        params.lora = lora
        prompts, texts = self._completion_prompts(req)
        self._admit(prompts, params, FieldNames(), req.asks_for_structure)
        structured = self._constrain(req, params)  # last: a new grammar costs milliseconds
        echo = None
        if req.echo:
            echo = [
                t if t is not None else self.tokenizer.decode(p) for p, t in zip(prompts, texts)
            ]
        return EngineInputs(
            prompts, params, bool(req.stream), include_usage, echo, constraint_param=structured
        )

    def chat(self, req: ChatCompletionRequest) -> EngineInputs:
        lora = self.model_of(req.model)
        check_extra_fields(req, "chat", self.tokenizer)
        self._bound_messages(req.messages)
        tools = read_tools(req, self.tokenizer, self.limits.vocab_size)
        include_usage = self._stream_options(req)
        top = req.top_logprobs
        if top and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        variables = self._template_variables(req.chat_template_kwargs)
        ids = self._chat_prompt(req, tools, variables)
        reasoning = self.reasoning_format
        thinks = reasoning is not None and variables.get("enable_thinking", True) is not False
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        value = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if value is not None and value < 1:
            raise bad_request(f"{param} must be at least 1", param)
        if value is None:
            # by default the completion may fill the context, but no more than the KV pool holds
            # (a pool smaller than one context would otherwise refuse every chat without it)
            room = min(self.limits.max_model_len, self.limits.kv_cache_tokens) - len(ids)
            value = self.request_limits.default_max_tokens(max(1, room))
        params = self._sampling_params(req, value, (top or 0) if req.logprobs else None)
        params.lora = lora
        calls = tools is not None and tools.calls
        names = FieldNames("messages", param, "top_logprobs")
        self._admit([ids], params, names, calls or req.asks_for_structure)
        params.stop += [x for x in self.template.stop if x]  # the template's own, not counted
        structured = self._constrain(req, params)  # last: a new grammar costs milliseconds
        if not calls:
            self._after_reasoning(params, thinks, structured)
            return EngineInputs(
                [ids], params, bool(req.stream), include_usage, constraint_param=structured,
                reasoning=reasoning if thinks else None,
            )  # fmt: skip
        if structured is not None:
            raise bad_request(
                f'{structured} cannot be combined with tools unless tool_choice is "none"',
                structured,
            )
        params.constraint = tools.constraint(
            self.tool_format, self.tokenizer, self.limits.vocab_size
        )
        self._after_reasoning(params, thinks, "tool_choice")
        return EngineInputs(
            [ids], params, bool(req.stream), include_usage, tool_format=self.tool_format,
            constraint_param="tool_choice", calls_only=tools.calls_only,
            reasoning=reasoning if thinks else None,
        )  # fmt: skip

    def embedding(self, req: EmbeddingRequest) -> EmbeddingInputs:
        """An embeddings request: its inputs, admitted like prompts that generate nothing."""
        lora = self.model_of(req.model)
        spec = self.embedding_spec
        dims = req.dimensions
        if dims is not None and not spec.allows(dims):
            widths = (
                f"one of {', '.join(map(str, spec.matryoshka))}"
                if isinstance(spec.matryoshka, tuple)
                else f"at most {spec.hidden_size}"
                if spec.matryoshka
                else f"{spec.hidden_size} (the model is not Matryoshka-trained)"
            )
            raise bad_request(f"dimensions must be {widths}", "dimensions")
        keep = None if dims is None or dims == spec.hidden_size else dims
        params = SamplingParams(max_tokens=0, pooling=PoolingParams(spec.pooling, keep), lora=lora)
        prompts = self._embedding_inputs(req.input)
        self._admit(prompts, params, FieldNames(prompt="input"), False)
        return EmbeddingInputs(prompts, params, req.encoding_format == "base64")

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        self.model_of(req.model)  # an adapter has its base's tokenizer
        return encode_text(self.tokenizer, req.prompt, "prompt") if req.prompt else []

    def detokenize(self, req: DetokenizeRequest) -> list[int]:
        self.model_of(req.model)
        self._check_token_ids(req.tokens, "tokens")
        return req.tokens

    # ---- prompts --------------------------------------------------------------------------

    def _completion_prompts(
        self, req: CompletionRequest
    ) -> tuple[list[list[int]], list[str | None]]:
        """The request's prompts as token ids, and their original text when given as text."""
        items = _items(req.prompt, "prompt")
        ids: list[list[int]] = []
        texts: list[str | None] = []
        for item in items:
            if isinstance(item, str):
                self._bound_chars([item], "prompt")
                ids.append(encode_text(self.tokenizer, item, "prompt", add_special_tokens=True))
                texts.append(item)
            else:
                if not item:
                    raise bad_request("a token-id prompt must not be empty", "prompt")
                self._check_token_ids(item, "prompt")
                ids.append(list(item))
                texts.append(None)
        return ids, texts

    def _template_variables(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """A request's `chat_template_kwargs`, which may not replace what the server passes."""
        kwargs = kwargs or {}
        taken = sorted(set(kwargs) & (RESERVED_TEMPLATE_VARIABLES | environment_names()))
        if taken:
            raise bad_request(
                f"chat_template_kwargs cannot set {', '.join(taken)} (the server or the template "
                "engine defines it)",
                "chat_template_kwargs",
            )
        return kwargs

    def _after_reasoning(self, params: SamplingParams, thinks: bool, param: str | None) -> None:
        """A reasoning model's constraint starts after its thinking (`</think>`)."""
        if not thinks or params.constraint is None:
            return
        if self.reasoning_tokens is None:
            raise bad_request(
                f"{param}: this tokenizer has no single {THINK_OPEN} and {THINK_CLOSE} token, "
                "so the constraint cannot start after the reasoning; send chat_template_kwargs "
                '{"enable_thinking": false}',
                param,
            )
        opening, end = self.reasoning_tokens
        params.constraint = AfterToken(
            params.constraint, end, self.tokenizer.vocab_size, opening=opening
        )

    def _embedding_inputs(self, inputs: str | list) -> list[list[int]]:
        """An embeddings request's inputs as token ids (text tokenized as a prompt is)."""
        items = _items(inputs, "input")
        limit = self.settings.max_prompts
        if len(items) > limit:  # before tokenizing them all
            raise bad_request(f"at most {limit} inputs per request", "input")
        ids: list[list[int]] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise bad_request("input strings must not be empty", "input")
                self._bound_chars([item], "input")
                ids.append(encode_text(self.tokenizer, item, "input", add_special_tokens=True))
            else:
                if not item:
                    raise bad_request("a token-id input must not be empty", "input")
                self._check_token_ids(item, "input")
                ids.append(list(item))
        return ids

    def _chat_prompt(
        self, req: ChatCompletionRequest, tools: ToolRequest | None, variables: dict[str, Any]
    ) -> list[int]:
        messages, shown_tools = chat_messages(
            req.messages, tools, self.tool_format, self.template.knows_tools
        )
        try:
            text = self.template.render_messages(messages, shown_tools, **variables)
        except ValueError as exc:  # a Jinja template raised (raise_exception) or failed
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        allow = True if self.template.specials_in_prompt else None  # the template's own tokens
        return encode_text(self.tokenizer, text, "messages", allow_special=allow)

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        if any(not self.tokenizer.is_valid(t) for t in ids):
            raise bad_request(f"token ids must be in [0, {self.tokenizer.vocab_size})", param)

    def _stream_options(self, req: SamplingFields) -> bool:
        """Whether a stream ends with a usage chunk; stream_options needs stream: true."""
        if req.stream_options is None:
            return False
        if not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        return req.stream_options.include_usage

    def _sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The fields both endpoints share -> SamplingParams (checked by admission)."""
        top_k = 0 if req.top_k is None else req.top_k
        if top_k >= self.limits.vocab_size:
            top_k = 0  # keeping the whole vocabulary is no truncation
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        # llama.cpp's samplers: those given, the others at SamplingParams' defaults
        llama_cpp = {f: v for f in LLAMA_CPP_SAMPLER_FIELDS if (v := getattr(req, f)) is not None}
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(req.logit_bias),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=1 if req.n is None else req.n,
            cache_salt=req.cache_salt,  # joined with the API key's tenant by the caller
            **llama_cpp,
        )
        if params.uses_dry:  # DRY's breakers as tokens (the list is checked first)
            with limit_as_400():
                params.dry_breakers = self.dry_breaker_index.resolve(params.dry_sequence_breakers)
        return params

    # ---- structured output ----------------------------------------------------------------

    def _constrain(self, req: StructuredFields, params: SamplingParams) -> str | None:
        """Compile the request's structured-output constraint (if any) onto params; returns the
        field that asked for it."""
        with limit_as_400():
            asked = constraint_from_fields(req, self.tokenizer, self.limits.vocab_size)
        params.constraint = None if asked is None else asked.constraint
        return None if asked is None else asked.param

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """JSON's string keys as token ids (their count and range are admission's)."""
        out = {}
        for key, value in (bias or {}).items():
            try:
                out[int(key)] = value
            except ValueError:
                raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
        return out
