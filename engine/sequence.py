"""One completion being generated: its tokens, its text, and when it stops.

Each completion's tokens are decoded once, here, by one incremental detokenizer; the events carry
the released text and where each token's text begins, which is all the HTTP layer needs. Text that
might still turn out to be the start of a stop string is held back, so a stop string split across
tokens never leaks into the stream. Stop strings, like the end-of-text token, cannot end a
completion before `min_tokens` tokens were generated, except that a structured output (a grammar
constraint) ends when its grammar is complete.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from gptserve.engine.prefix_index import Salt
from gptserve.engine.sampler import SamplingParams
from gptserve.model.lora.batched import BASE_SLOT
from gptserve.model.tokenizers import Tokenizer


@dataclass
class TokenLogprob:
    """A token with its logprob and the top alternatives as (token, logprob) pairs."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


GRAMMAR_ERROR = "grammar_too_costly"
SEQUENCE_ERROR = "request_failed"


@dataclass
class TokenEvent:
    """What one completion produced in one engine step.

    text is the newly released text (it may lag the tokens while a stop string could be forming);
    text_offsets is, for each of token_ids, where its text begins in the completion's text.
    finish_reason is "stop", "length" or "abort" on the last event of a completion; error is set
    when the request failed (the completion is then over too). error_code says whose failure it
    was: GRAMMAR_ERROR (its constraint cannot go on: a budget ran out), SEQUENCE_ERROR (something
    else failed on this request alone: its message is its own) or None (the engine's step failed:
    the message is generic, the details are in the log).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt tokens, those read from the prefix cache
    num_generated: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text_offsets: list[int] = field(default_factory=list)
    # an embedding request's one event: its vector (pooled, L2-normalized; engine.pooling)
    embedding: list[float] | None = None
    # time.perf_counter() when a step first ran the request (its wait in the queue ends)
    scheduled_at: float | None = None
    stop_reason: str | None = None  # on the last event: the stop string that ended it, if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Sequence:
    """Prompt plus generated tokens of one of a request's n completions."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.num_cached = 0  # tokens whose keys/values are in the KV cache
        self.num_prefix_hit = 0  # prompt tokens found in the prefix cache at first admission
        self.constraint = None if params.constraint is None else params.constraint.fork()
        self.generator: torch.Generator | None = params.make_generator(index)
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None  # the stop string that ended it (vLLM's stop_reason)
        self._tokenizer = tokenizer
        self._detok = tokenizer.detokenizer()
        self._text = ""  # all text decoded so far
        self._released = 0  # characters of _text already handed out
        self._hold = max((len(s) for s in params.stop), default=0)
        self._stop_from = 0  # a stop string must end past this many characters (min_tokens)
        self.text_offsets: list[int] = []  # where each generated token's text begins in _text
        self.lora_slot = BASE_SLOT  # the LoRA slot its rows use (none: the base), set by the engine
        self.prefix_salt: Salt = params.cache_salt  # its prefix-cache blocks' salt (and adapter)
        self.passed_over = 0  # admissions made past it while it waited for room (engine.scheduler)
        self.scheduled_at: float | None = None  # perf_counter() at its first admission

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (the whole prompt at first, then the last sampled token)."""
        return len(self.token_ids) - self.num_cached

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, end_tokens: int | Collection[int], max_len: int) -> str:
        """Add a sampled token; returns the text it releases and sets finish_reason when done.
        end_tokens: the model's end-of-text id, or all of them (Llama 3 ends a turn with
        <|eot_id|> and a text with <|end_of_text|>)."""
        p = self.params
        self.token_ids.append(token)
        self.text_offsets.append(len(self._text))
        n_out = self.num_generated
        is_end = token == end_tokens if isinstance(end_tokens, int) else token in end_tokens
        ends = is_end and (not p.ignore_eos or self.constraint is not None)
        if token in p.stop_token_ids or ends:
            self.finish_reason = "stop"
            return self._release(self._text[self._released :])  # the stop token adds no text
        if self.constraint is not None:  # structured output: the grammar says when it is complete
            self.constraint.advance(token)
        if n_out <= p.min_tokens:  # a stop string may end in the text of token min_tokens on
            self._stop_from = len(self._text)
        self._text += self._detok.add(token)
        if p.stop and n_out >= p.min_tokens:
            found = self._find_stop()
            if found is not None:
                cut, self.stop_reason = found
                self.finish_reason = "stop"
                self._text = self._text[:cut]
                return self._release(self._text[self._released :])
        complete = self.constraint is not None and self.constraint.is_finished()
        if complete or n_out >= p.max_tokens or len(self.token_ids) >= max_len:
            self.finish_reason = "stop" if complete else "length"
            self._text += self._detok.flush()
            return self._release(self._text[self._released :])
        return self._release(self._text[self._released : len(self._text) - self._held_back()])

    def _find_stop(self) -> tuple[int, str] | None:
        """Index in _text where the earliest stop string begins, among those that end in text
        not yet released and past _stop_from (held-back text never begins inside released text,
        so neither does a match), and that string (the first listed of those found there)."""
        hits = []
        for s in self.params.stop:
            start = max(0, self._released - len(s) + 1, self._stop_from - len(s) + 1)
            if (i := self._text.find(s, start)) >= 0:
                hits.append((i, s))
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of _text that could begin a stop string."""
        text = self._text
        for n in range(min(self._hold - 1, len(text) - self._released), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.params.stop):
                return n
        return 0

    def _release(self, piece: str) -> str:
        self._released += len(piece)
        return piece

    @property
    def text(self) -> str:
        """Text handed out so far."""
        return self._text[: self._released]
