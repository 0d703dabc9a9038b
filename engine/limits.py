"""Admission: what one request may ask of the engine, checked in one call.

`RequestLimits.admit(prompts, params, names)` takes a request's prompts (token ids) and its
`SamplingParams` and returns an `AdmittedRequest`, or raises one `RequestError` whose `param`
names the field at fault and whose `code` says the kind. Two callers make that call, once each:
the server (`server.validation`, which first turns HTTP fields into params and names its own
fields through `FieldNames`: `messages`, `max_completion_tokens`, `top_logprobs`) and the engine
for the offline path and library users (`Engine.add_request`). A request the server admitted
goes into the engine unchecked (`add_request(..., admitted=True)`).

`EngineLimits` is what an engine can hold, fixed once it is built (context length, vocabulary, KV
pool; `Engine.limits`). `RequestLimits` adds the caps an operator puts on one request (the
server's --max-n, --max-tokens-limit, --max-prompt-tokens, --max-logprobs, --max-prompts,
--max-stop, --max-stop-length, --max-logit-bias); with none it is the engine's own view.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptserve.engine.errors import RequestError
from gptserve.engine.sampler import MAX_LOGPROBS, SamplingParams

__all__ = [
    "AdmittedRequest",
    "EngineLimits",
    "FieldNames",
    "MIN_TEMPERATURE",
    "RequestError",
    "RequestLimits",
]

# A temperature this small is greedy (as in vLLM): logits / 1e-300 overflow float32 to inf/nan.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can take, fixed once it is built."""

    max_model_len: int  # context length: prompt + generated tokens
    vocab_size: int  # the model's (token ids, logit_bias keys, stop_token_ids below it)
    kv_block_size: int  # tokens per KV cache block
    kv_cache_blocks: int  # blocks in the whole pool

    @property
    def kv_cache_tokens(self) -> int:
        return self.kv_cache_blocks * self.kv_block_size


@dataclass(frozen=True)
class FieldNames:
    """The names a caller's errors give the fields a limit is about."""

    prompt: str = "prompt"  # chat: "messages"
    max_tokens: str = "max_tokens"  # chat: "max_completion_tokens" when that was sent
    logprobs: str = "logprobs"  # chat: "top_logprobs"


@dataclass(frozen=True)
class AdmittedRequest:
    """A request admission let through: its prompts and its parameters, within every limit."""

    prompts: list[list[int]]
    params: SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits and the operator's caps on one request (None: no cap)."""

    engine: EngineLimits
    max_n: int | None = None  # completions per prompt
    max_tokens: int | None = None  # tokens to generate
    max_prompt_tokens: int | None = None
    max_logprobs: int = MAX_LOGPROBS  # alternatives per token
    max_prompts: int | None = None  # prompts in one request
    max_stop: int | None = None  # stop strings
    max_stop_length: int | None = None  # characters per stop string
    max_logit_bias: int | None = None  # logit_bias entries

    def admit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        names: FieldNames = FieldNames(),
        constrained: bool = False,
    ) -> AdmittedRequest:
        """The one check of a request: every limit, then the sampler's ranges. Returns the
        admitted request (a temperature too small to divide by made greedy) or raises the
        RequestError of the first field at fault. constrained: a grammar will constrain the
        output (the server compiles it after admission, since it costs more than every check
        here); `params.constraint` set says so too."""
        if not prompts:
            raise RequestError(f"{names.prompt} must not be empty", names.prompt)
        if self.max_prompts is not None and len(prompts) > self.max_prompts:
            raise RequestError(f"at most {self.max_prompts} prompts per request", names.prompt)
        for ids in prompts:
            self._check_prompt_ids(ids, names.prompt)
        self._check_n(params.n)
        if params.logprobs is not None:
            self._check_logprobs(params.logprobs, names.logprobs)
        if params.prompt_logprobs is not None:
            self._check_logprobs(params.prompt_logprobs, "prompt_logprobs")
        self._check_stop(params.stop)
        if self.max_logit_bias is not None and len(params.logit_bias) > self.max_logit_bias:
            raise RequestError(f"at most {self.max_logit_bias} logit_bias entries", "logit_bias")
        self._check_max_tokens(params.max_tokens, names.max_tokens)
        params.validate(self.engine.vocab_size)
        constrained = constrained or params.constraint is not None
        if constrained and params.min_tokens and params.stop_token_ids:
            # min_tokens bans the stop tokens, and the grammar may allow nothing else
            raise RequestError(
                "stop_token_ids cannot be combined with min_tokens when the output is "
                "constrained (structured output or tools)",
                "stop_token_ids",
            )
        for ids in prompts:
            self._check_fits(len(ids), params.max_tokens, names)
        if 0 < params.temperature < MIN_TEMPERATURE:
            params.temperature = 0.0
        return AdmittedRequest(prompts, params)

    def default_max_tokens(self, default: int) -> int:
        """`default` within the cap: the tokens to generate when a request names none."""
        return default if self.max_tokens is None else min(default, self.max_tokens)

    # ---- the checks ------------------------------------------------------------------------

    def _check_prompt_ids(self, prompt_ids: list[int], param: str) -> None:
        """A prompt has at least one token, each an id of the model's vocabulary."""
        vocab = self.engine.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", param)
        if any(not (isinstance(t, int) and 0 <= t < vocab) for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param)

    def _check_n(self, n: int) -> None:
        """n within the cap (`SamplingParams.validate` asks for at least 1 without one)."""
        if self.max_n is not None and not 1 <= n <= self.max_n:
            raise RequestError(f"n must be between 1 and {self.max_n}", "n")

    def _check_logprobs(self, value: int, param: str) -> None:
        if not 0 <= value <= self.max_logprobs:
            raise RequestError(f"{param} must be between 0 and {self.max_logprobs}", param)

    def _check_stop(self, stop: list[str]) -> None:
        if self.max_stop is not None and len(stop) > self.max_stop:
            raise RequestError(f"at most {self.max_stop} stop strings", "stop")
        for text in stop:
            if not text:
                raise RequestError("stop strings must not be empty", "stop")
            if self.max_stop_length is not None and len(text) > self.max_stop_length:
                raise RequestError(
                    f"stop strings are limited to {self.max_stop_length} characters", "stop"
                )

    def _check_max_tokens(self, value: int, param: str) -> None:
        """The tokens to generate: not negative, within the cap."""
        if value < 0:
            raise RequestError(f"{param} must be >= 0", param)
        if self.max_tokens is not None and value > self.max_tokens:
            raise RequestError(f"{param} is limited to {self.max_tokens}", param)

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int, names: FieldNames) -> None:
        """The prompt within the prompt cap, and prompt + max_tokens within the context and within
        the whole KV pool; the error names the prompt's field when the prompt alone is too long,
        else the field of the tokens to generate."""
        n, limit = num_prompt_tokens, self.max_prompt_tokens
        if limit is not None and n > limit:
            raise RequestError(
                f"the prompt has {n} tokens; this server accepts at most {limit}",
                names.prompt,
                "prompt_too_long",
            )
        total, context = n + max_tokens, self.engine.max_model_len
        if total > context:
            raise RequestError(
                f"this model's maximum context length is {context} tokens; the request asks for "
                f"{n} prompt tokens plus {max_tokens} to generate",
                names.max_tokens if n < context else names.prompt,
                "context_length_exceeded",
            )
        pool, blocks = self.engine.kv_cache_tokens, self.engine.kv_cache_blocks
        if total > pool:
            need = -(-total // self.engine.kv_block_size)
            raise RequestError(
                f"the request needs {need} KV cache blocks ({total} tokens) but the pool has "
                f"{blocks} ({pool} tokens); ask for fewer tokens",
                names.max_tokens if n < pool else names.prompt,
                "kv_cache_exceeded",
            )
