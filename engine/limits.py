"""What one request may ask of the engine: the limits, their checks and their messages.

Two callers share these rules. `Engine.check_request` guards every way into the engine (the
server, `python -m engine`, a library user); `server.validation` checks an HTTP request before it
gets there, naming its own fields (`max_completion_tokens`, `messages`) and answering a violation
with a 400. A violation is a `RequestError` whose `param` names the field and `code` the kind.

`EngineLimits` is what an engine can hold, fixed once it is built (context length, vocabulary,
KV pool). `RequestLimits` adds the caps an operator puts on one request (the server's --max-n,
--max-tokens-limit, --max-prompt-tokens, --max-logprobs); with none it is the engine's own view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampler import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine

# A temperature this small is greedy (as in vLLM): logits / 1e-300 overflow float32 to inf/nan.
MIN_TEMPERATURE = 1e-5


class RequestError(ValueError):
    """A request the engine cannot take; `param` names the field at fault, `code` the kind."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


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

    @classmethod
    def of(cls, engine: Engine) -> EngineLimits:
        return cls(
            max_model_len=engine.max_len,
            vocab_size=engine.model.config.vocab_size,
            kv_block_size=engine.config.kv_block_size,
            kv_cache_blocks=engine.cache.num_blocks,
        )


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits and the operator's caps on one request (None: no cap)."""

    engine: EngineLimits
    max_n: int | None = None  # completions per prompt
    max_tokens: int | None = None  # tokens to generate
    max_prompt_tokens: int | None = None
    max_logprobs: int = MAX_LOGPROBS  # alternatives per token

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (or SamplingError) if the request can never run; a temperature
        too small to divide by becomes greedy."""
        params.validate(self.engine.vocab_size)
        self.check_prompt_ids(prompt_ids)
        self.check_n(params.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None:
                self.check_logprobs(value, name)
        self.check_max_tokens(params.max_tokens)
        self.check_fits(len(prompt_ids), params.max_tokens)
        snap_tiny_temperature(params)

    def check_prompt_ids(self, prompt_ids: list[int], param: str = "prompt") -> None:
        """A prompt has at least one token, each an id of the model's vocabulary."""
        vocab = self.engine.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", param=param)
        if any(not (0 <= t < vocab) for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param=param)

    def check_n(self, n: int) -> None:
        """n within the cap (`SamplingParams.validate` asks for at least 1 without one)."""
        if self.max_n is not None and not 1 <= n <= self.max_n:
            raise RequestError(f"n must be between 1 and {self.max_n}", param="n")

    def check_logprobs(self, value: int, param: str) -> None:
        """`param` (logprobs, top_logprobs, prompt_logprobs) within the cap."""
        if not 0 <= value <= self.max_logprobs:
            raise RequestError(f"{param} must be between 0 and {self.max_logprobs}", param=param)

    def check_max_tokens(self, value: int, param: str = "max_tokens") -> None:
        """The tokens to generate: not negative, within the cap."""
        if value < 0:
            raise RequestError(f"{param} must be >= 0", param=param)
        if self.max_tokens is not None and value > self.max_tokens:
            raise RequestError(f"{param} is limited to {self.max_tokens}", param=param)

    def max_tokens_or_default(
        self, value: int | None, default: int, param: str = "max_tokens"
    ) -> int:
        """`value` once checked, or when None `default` within the cap."""
        if value is None:
            return default if self.max_tokens is None else min(default, self.max_tokens)
        self.check_max_tokens(value, param)
        return value

    def check_fits(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        prompt_param: str = "prompt",
        tokens_param: str = "max_tokens",
    ) -> None:
        """The prompt within the prompt cap, and prompt + max_tokens within the context and within
        the whole KV pool; the error names the prompt's field when the prompt alone is too long,
        else the field of the tokens to generate."""
        n, limit = num_prompt_tokens, self.max_prompt_tokens
        if limit is not None and n > limit:
            raise RequestError(
                f"the prompt has {n} tokens; this server accepts at most {limit}",
                param=prompt_param,
                code="prompt_too_long",
            )
        total, context = n + max_tokens, self.engine.max_model_len
        if total > context:
            raise RequestError(
                f"this model's maximum context length is {context} tokens; the request asks for "
                f"{n} prompt tokens plus {max_tokens} to generate",
                param=tokens_param if n < context else prompt_param,
                code="context_length_exceeded",
            )
        pool, blocks = self.engine.kv_cache_tokens, self.engine.kv_cache_blocks
        if total > pool:
            need = -(-total // self.engine.kv_block_size)
            raise RequestError(
                f"the request needs {need} KV cache blocks ({total} tokens) but the pool has "
                f"{blocks} ({pool} tokens); ask for fewer tokens",
                param=tokens_param if n < pool else prompt_param,
                code="kv_cache_exceeded",
            )


def snap_tiny_temperature(params: SamplingParams) -> SamplingParams:
    """A temperature in (0, MIN_TEMPERATURE) becomes 0 (greedy), in place; returns params."""
    if 0 < params.temperature < MIN_TEMPERATURE:
        params.temperature = 0.0
    return params
