"""Turning validated request bodies into prompts and SamplingParams, within the server's limits.

Every failure here is a 400 that names the field (`param`); nothing a client sends gets further
than this module without having been checked against the limits in `Settings`.
"""

from __future__ import annotations

from model.sampling import SamplingError, SamplingParams
from model.tokenizer import Tokenizer
from server.chat import ChatTemplate
from server.engine import Engine, RequestError
from server.errors import APIError, bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.settings import Settings

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def encode_text(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """Text -> ids; the empty string becomes [end-of-text] (GPT-2 has no BOS token)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the text contains invalid Unicode (lone surrogates)", param) from None
    if not text:
        return [tokenizer.eot_token]
    return tokenizer.encode(text)


def completion_prompts(
    req: CompletionRequest, tokenizer: Tokenizer, settings: Settings
) -> tuple[list[list[int]], list[str | None]]:
    """The request's prompts as token ids, and their original text when given as text."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) > settings.max_prompts:
        raise bad_request(f"at most {settings.max_prompts} prompts per request", "prompt")
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            ids.append(encode_text(tokenizer, item, "prompt"))
            texts.append(item)
        else:
            if not item:
                raise bad_request("a token-id prompt must not be empty", "prompt")
            if any(not tokenizer.is_valid(t) for t in item):
                raise bad_request(
                    f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt"
                )
            ids.append(list(item))
            texts.append(None)
    return ids, texts


def chat_prompt(
    req: ChatCompletionRequest, tokenizer: Tokenizer, template: ChatTemplate
) -> list[int]:
    messages = []
    for msg in req.messages:
        if msg.content is None:
            content = ""
        elif isinstance(msg.content, str):
            content = msg.content
        else:
            content = "".join(part.text for part in msg.content)
        messages.append((msg.role, content))
    return encode_text(tokenizer, template.render(messages), "messages")


def _stop_strings(stop: str | list[str] | None, settings: Settings) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > settings.max_stop:
        raise bad_request(f"at most {settings.max_stop} stop strings", "stop")
    for s in stops:
        if not s:
            raise bad_request("stop strings must not be empty", "stop")
        if len(s) > settings.max_stop_length:
            raise bad_request(
                f"stop strings are limited to {settings.max_stop_length} characters", "stop"
            )
    return stops


def _logit_bias(bias: dict[str, float] | None, settings: Settings) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > settings.max_logit_bias:
        raise bad_request(f"at most {settings.max_logit_bias} logit_bias entries", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
    return out


def _max_tokens(value: int | None, default: int, param: str, settings: Settings) -> int:
    if value is None:
        value = default
        if settings.max_tokens_limit is not None:
            value = min(value, settings.max_tokens_limit)
    if value < 0:
        raise bad_request(f"{param} must be >= 0", param)
    if settings.max_tokens_limit is not None and value > settings.max_tokens_limit:
        raise bad_request(f"{param} is limited to {settings.max_tokens_limit}", param)
    return value


def sampling_params(
    req: SamplingFields,
    settings: Settings,
    vocab_size: int,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop: tuple[str, ...] = (),
) -> SamplingParams:
    """Shared fields -> SamplingParams, checked against the limits and the sampler's ranges."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= settings.max_n:
        raise bad_request(f"n must be between 1 and {settings.max_n}", "n")
    top_k = 0 if req.top_k is None else req.top_k
    if top_k >= vocab_size:
        top_k = 0  # keeping the whole vocabulary is no truncation
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias, settings),
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        stop=_stop_strings(req.stop, settings) + [s for s in extra_stop if s],
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=n,
    )
    try:
        return params.validate(vocab_size)
    except SamplingError as exc:
        raise bad_request(f"{exc.param} {exc.message}", exc.param) from None


def completion_params(
    req: CompletionRequest, settings: Settings, vocab_size: int
) -> SamplingParams:
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise bad_request("best_of is not supported (only 1)", "best_of")
    logprobs = req.logprobs
    if logprobs is not None and not 0 <= logprobs <= settings.max_logprobs:
        raise bad_request(f"logprobs must be between 0 and {settings.max_logprobs}", "logprobs")
    max_tokens = _max_tokens(req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", settings)
    return sampling_params(
        req, settings, vocab_size,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=logprobs if req.echo and logprobs is not None else None,
    )  # fmt: skip


def chat_params(
    req: ChatCompletionRequest,
    settings: Settings,
    vocab_size: int,
    room: int,
    template: ChatTemplate,
) -> SamplingParams:
    """room: context left after the prompt, the default max_tokens."""
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= settings.max_logprobs:
        raise bad_request(
            f"top_logprobs must be between 0 and {settings.max_logprobs}", "top_logprobs"
        )
    if top and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(value, max(room, 0), param, settings)
    return sampling_params(
        req, settings, vocab_size,
        max_tokens=max_tokens,
        logprobs=(top or 0) if req.logprobs else None,
        extra_stop=template.stop,
    )  # fmt: skip


def check_prompts(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, settings: Settings, param: str
) -> None:
    """Limits on prompt length, then the engine's own check (context length, KV pool)."""
    for ids in prompts:
        if settings.max_prompt_tokens is not None and len(ids) > settings.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; this server accepts at most "
                f"{settings.max_prompt_tokens}",
                param,
                code="prompt_too_long",
            )
        try:
            engine.check_request(ids, params)
        except RequestError as exc:
            bad = param if exc.param == "prompt" else exc.param
            raise bad_request(str(exc), bad, exc.code) from None
        except SamplingError as exc:
            raise bad_request(f"{exc.param} {exc.message}", exc.param) from None
