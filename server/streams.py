"""One API request's engine work: its prompts' event streams merged, with a deadline, and the
per-choice bookkeeping (text, tokens, logprobs, timings) that both endpoints share.

Choices are numbered prompt_index * n + completion_index, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from gptserve.engine.async_engine import AsyncEngine
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import TokenEvent, TokenLogprob
from gptserve.model.tokenizers import Tokenizer
from gptserve.server.metrics import Metrics
from gptserve.server.request_ids import bind_engine_request, unbind_engine_request
from gptserve.server.request_log import RequestLog


class RequestTimeout(Exception):
    """The request ran past --request-timeout."""


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


_TIMEOUT, _GONE = object(), object()


async def _wait_disconnect(request: Request) -> None:
    """Return when the client hangs up (the body has been read, so receive() only reports that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def engine_id(request_id: str, prompt: int) -> str:
    """The engine's id of an API request's prompt `prompt` (its n completions)."""
    return f"{request_id}-{prompt}"


async def merged_events(
    async_engine: AsyncEngine,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    timeout: float,
    watch: Request | None = None,
) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) for every event of every prompt until all completions end.

    Raises RequestTimeout past the deadline and ClientGone when `watch` disconnects; leaving early
    in any way (including being closed or cancelled) aborts the engine requests still running.

    The engine hands each prompt's events straight to this request's queue (`AsyncEngine.submit`):
    a token costs the event loop one wake-up and one hand-over, whatever the number of prompts.
    """
    queue: asyncio.Queue = asyncio.Queue()
    n = params.n
    remaining: list[int] = []  # per submitted prompt: its completions not yet ended

    def deliverer(prompt: int) -> Callable[[TokenEvent], None]:
        first, put = prompt * n, queue.put_nowait

        def deliver(event: TokenEvent) -> None:
            put((first + event.index, event))

        return deliver

    async def on_disconnect() -> None:
        await _wait_disconnect(watch)
        queue.put_nowait((-1, _GONE))

    watcher = asyncio.create_task(on_disconnect()) if watch is not None else None
    timer = asyncio.get_running_loop().call_later(timeout, queue.put_nowait, (-1, _TIMEOUT))
    bind_engine_request(request_id)  # the engine thread's lines about it carry its request id
    try:
        for p, ids in enumerate(prompts):
            # admitted by server.validation: the engine takes it unchecked
            async_engine.submit(engine_id(request_id, p), ids, params, deliverer(p), True)
            remaining.append(n)
        running = len(prompts) * n
        while running:
            index, item = await queue.get()
            if item is _TIMEOUT:
                raise RequestTimeout()
            if item is _GONE:
                raise ClientGone()
            if item.finished:
                remaining[index // n] -= 1
                running -= 1
            yield index, item
    finally:
        unbind_engine_request(request_id)
        timer.cancel()
        for p, left in enumerate(remaining):
            async_engine.release(engine_id(request_id, p), aborted=left > 0)
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


def prompt_offsets(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Where each prompt token's text begins in the prompt's text."""
    detok, offsets, chars = tokenizer.detokenizer(), [], 0
    for token in ids:
        offsets.append(chars)
        chars += len(detok.add(token))
    return offsets


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """A token as a string: its UTF-8 text, or "bytes:\\xNN..." when its bytes are not whole characters."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    lp_tokens: list[int] = field(default_factory=list)  # tokens that have logprobs entries
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # character offset of each token
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it (finish_reason "stop")
    error: str | None = None
    error_code: str | None = None  # engine.sequence: whose failure the error is
    num_generated: int = 0
    num_cached_tokens: int = 0  # of its prompt's tokens, those read from the prefix cache
    text_base: int = 0  # characters before the generated text (an echoed prompt)
    last_token_at: float | None = None


class ChoiceTracker:
    """Choices of one request plus its latency metrics."""

    def __init__(
        self, num_choices: int, tokenizer: Tokenizer, metrics: Metrics, started: float
    ) -> None:
        self.choices = [Choice(i) for i in range(num_choices)]
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.started = started
        self.first_token_at: float | None = None
        self.scheduled_at: float | None = None  # the engine's first step on it (its queue wait)
        self.log: RequestLog | None = None  # its finished line and span (server.request_log)

    def add_prompt(
        self, choice: Choice, ids: list[int], text: str, lps: list[TokenLogprob | None] | None
    ) -> None:
        """Echo: the prompt's text (and its logprobs, the first one None) open the choice."""
        choice.text.append(text)
        choice.text_base = len(text)
        if lps is not None:
            self._add_logprobs(choice, ids, lps, prompt_offsets(self.tokenizer, ids))

    def update(self, choice: Choice, event: TokenEvent) -> None:
        now = time.perf_counter()
        if event.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.started)
            elif choice.last_token_at is not None:
                self.metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
        if event.scheduled_at is not None and (
            self.scheduled_at is None or event.scheduled_at < self.scheduled_at
        ):
            self.scheduled_at = event.scheduled_at
        if event.logprobs:
            offsets = [choice.text_base + offset for offset in event.text_offsets]
            self._add_logprobs(choice, event.token_ids, event.logprobs, offsets)
        choice.text.append(event.text)
        choice.num_generated = event.num_generated
        choice.num_cached_tokens = event.num_cached_tokens
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.stop_reason = event.stop_reason
        if event.error is not None:
            choice.error, choice.error_code = event.error, event.error_code

    @staticmethod
    def _add_logprobs(
        choice: Choice, ids: list[int], entries: list[TokenLogprob | None], offsets: list[int]
    ) -> None:
        choice.lp_tokens.extend(ids)
        choice.logprobs.extend(entries)
        choice.offsets.extend(offsets)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_generated for c in self.choices)

    def finish(self, endpoint: str, status: int | str) -> None:
        reasons = [c.finish_reason for c in self.choices if c.finish_reason]
        reason = (
            "error" if any(c.error for c in self.choices) else (reasons[0] if reasons else None)
        )
        if status == 200:
            self.metrics.e2e.observe(time.perf_counter() - self.started)
        self.metrics.count_request(endpoint, status, reason)
        if self.log is not None:
            each = [c.finish_reason or ("error" if c.error else "none") for c in self.choices]
            self.log.finish(
                status, reason, each, self.completion_tokens, self.first_token_at,
                self.scheduled_at,
            )  # fmt: skip

    # ---- OpenAI shapes -------------------------------------------------------------------

    def completion_logprobs(self, choice: Choice, start: int = 0) -> dict:
        """Legacy completions shape over the choice's entries from `start`: parallel lists."""
        tokens, token_lps, tops = [], [], []
        for token, entry in zip(choice.lp_tokens[start:], choice.logprobs[start:]):
            tokens.append(token_text(self.tokenizer, token))
            if entry is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(entry.logprob)
                tops.append({token_text(self.tokenizer, t): lp for t, lp in entry.top})
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": choice.offsets[start:],
        }

    def chat_logprobs(self, choice: Choice, start: int = 0) -> dict:
        """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        content = []
        for token, entry in zip(choice.lp_tokens[start:], choice.logprobs[start:]):
            if entry is None:
                continue
            item = self._chat_entry(token, entry.logprob)
            item["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in entry.top]
            content.append(item)
        return {"content": content}

    def _chat_entry(self, token: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes(token)
        return {"token": token_text(self.tokenizer, token), "logprob": logprob, "bytes": list(raw)}
