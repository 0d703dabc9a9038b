"""Structured output: constraints that say which next tokens keep the output in a grammar.

A constraint is already decided when it comes here (which request field asked for it is the
server's business, `server.structured_request`): JSON valid under a schema ("json"; any JSON
object is `JSON_OBJECT_SCHEMA`), text matching a regular expression ("regex"), exactly one of a
list of strings ("choice") or a grammar in llguidance's Lark syntax ("lark": what a server builds
for a format of its own, such as tool calls in running text). Each becomes a `Constraint`: a
per-sequence matcher that, before every step, fills a row of a token bitmask (one bit per
vocabulary id), and after every step is advanced with the sampled token. The sampler then
applies `logits.masked_fill(~mask, -inf)` to the constrained rows.

    constraint = compile_constraint("json", schema, tokenizer)
    bitmask = allocate_bitmask(batch, vocab_size)        # once per engine, reused every step
    fill_bitmask([constraint, None, ...], bitmask)       # None: an unconstrained row
    mask = bitmask_to_bool(bitmask, vocab_size)          # (B, V) bool, on any device
    constraint.advance(token)                            # after sampling

The grammar engine is llguidance (Rust, no Python dependencies). Measured with the GPT-2 vocabulary
on a 2-core CPU (bench/structured.py --compare; the table is in docs/STRUCTURED.md), mean mask time
per token, llguidance / xgrammar / outlines-core: JSON schema 15 / 3 / 26 us, JSON mode 9 / 5 / 50
us, regexes 10-200 / 2-35 / 1-83 us, choice 10-27 / 1-2 us; compile (with the first mask) 1-5 ms /
0.5-18 ms / 8 ms-4.8 s. xgrammar masks fastest, but it compiles schemas with `not`, `uniqueItems`
or `dependentRequired` without enforcing them (it accepted `[true,true,true]` for `uniqueItems`),
so it would return JSON that fails the request's schema; llguidance refuses such schemas
("Unimplemented keys"), which is what lets us answer 400 instead. xgrammar also imports
transformers (+0.9 s at startup). The extra 5-15 us per token for JSON is under 0.1 % of a GPT-2
decode step on the same CPU (about 30 ms); outlines-core compiles JSON mode in 4.7 s.

Compiled grammars are kept in an LRU keyed by (kind, spec, vocabulary); the tokenizer-level data
(token bytes and the token trie) is built once per tokenizer and vocabulary size.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import llguidance
import numpy as np
import torch
from gptserve.engine.grammar_bounds import TooCostly, check_lark, check_schema, on_deep_stack
from gptserve.engine.sequence import GRAMMAR_ERROR
from gptserve.model.tokenizers import Tokenizer

ConstraintKind = Literal["json", "regex", "choice", "lark"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "lark")
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}  # "json" spec for any JSON object
GRAMMAR_CACHE_SIZE = 256
MAX_SPEC_CHARS = 200_000  # serialized schema / regex / choices; compile time grows with size
# Compact JSON, one way to write each value: small models loop on free whitespace. Given as
# overrides, so a schema's own "x-guidance" options cannot turn them off.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "coerce_one_of": False,  # oneOf is not anyOf: refuse it rather than emit two-branch matches
    "lenient": False,  # an unimplemented keyword is an error, never silently ignored
}
_SHIFTS = torch.arange(32, dtype=torch.int32)
# The grammar engine's budgets. A lexer state costs work the first time a mask reaches it, and a
# pathological regex (counted repetitions nested: `a{600}{600}`) makes one mask cost seconds
# under llguidance's defaults. A smaller fuel for building the first lexer states and a cap on
# their number stop such a grammar within tens of milliseconds (the adversarial set of
# tests/engine/test_grammar_budget.py; docs/RELIABILITY.md); a step's fuel stays the default
# (about 15 ms a mask), since less fails a plain `(\w+\s?){1,100}` on ordinary text.
_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=200_000,  # building the first lexer states (~50k a millisecond)
    max_lexer_states=50_000,  # distinct lexer states over a sequence's life
    verbose_errors=False,  # errors name no parser internals
)
PROBE_TOKENS = 4  # admission walks a grammar's first tokens: most blow-ups show there
PROBE_BUDGET_S = 0.25  # ... and refuses one whose walk costs more than this
# a sequence's grammar time over its whole life; past it the sequence (alone) fails
SEQUENCE_BUDGET_S = 5.0


class GrammarError(ValueError):
    """A constraint that cannot be built; the message is one line. `code` is GRAMMAR_ERROR for
    one refused as too costly before it was compiled (engine.grammar_bounds), else None."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ConstraintViolation(RuntimeError):
    """A token the constraint did not allow was fed to `advance` (the mask was not applied), or
    the grammar engine gave up on the sequence (a budget ran out): the sequence cannot go on."""


# ---- tokenizer-level data, once per (tokenizer, vocabulary size) ----

_VOCABS: dict[tuple[str, int], llguidance.LLTokenizer] = {}
_VOCABS_LOCK = threading.Lock()


class _TokenizerView:
    """What llguidance reads from a tokenizer: every id's bytes, EOS, and an encode function."""

    def __init__(self, tokenizer: Tokenizer, size: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eot_token
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (size - tokenizer.vocab_size)  # padding ids: never allowed
        # ids that are never text: a grammar never spells its strings with them
        self.special_token_ids = list(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, allow_special=False)


def grammar_vocab(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """The engine's view of `tokenizer`, padded to `vocab_size` ids (default: the tokenizer's).

    Built once, by the first constrained request (about 0.15 s and tens of MB for a 50k vocabulary:
    a server whose clients never constrain their output never pays for it), and shared by every
    grammar. Ids at or past the tokenizer's size are never allowed.
    """
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if size < tokenizer.vocab_size:
        raise ValueError(
            f"vocab_size {size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    key = (tokenizer.fingerprint, size)
    with _VOCABS_LOCK:
        vocab = _VOCABS.get(key)
        if vocab is None:
            view = llguidance.TokenizerWrapper(_TokenizerView(tokenizer, size))
            vocab = _VOCABS[key] = llguidance.LLTokenizer(view)
    return vocab


# ---- compiled grammars, LRU by (kind, spec, vocabulary) ----


class _Compiled:
    """A validated grammar and a matcher in its start state that constraints are copied from."""

    def __init__(self, matcher: llguidance.LLMatcher, warnings: list[str]) -> None:
        self.matcher = matcher
        self.warnings = warnings
        self.lock = threading.Lock()  # deep_copy of one matcher from two threads at once


def _clean(message: str) -> str:
    """The engine's error without its grammar excerpt: 'error: ...' line or the first line."""
    for line in message.splitlines():
        if line.startswith("error: "):
            return line[len("error: ") :]
    first = message.splitlines()[0] if message else "invalid grammar"
    return re.sub(r"^at \d+\(\d+\): ", "", first)


_INVALID = {
    "regex": "invalid regular expression",
    "choice": "invalid choices",
    "lark": "invalid grammar",
}


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _compile(kind: str, text: str, vocab_key: tuple[str, int]) -> _Compiled:
    vocab = _VOCABS[vocab_key]
    if kind == "json":
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "lark":
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as exc:
            raise GrammarError(f"invalid grammar: {_clean(str(exc))}") from None
    else:
        choices = json.loads(text)
        grammar = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, vocab, limits=_LIMITS
    )
    if is_error:
        what = _INVALID.get(kind, "unsupported or invalid JSON schema")
        raise GrammarError(f"{what}: {_clean(messages[0])}")
    matcher = llguidance.LLMatcher(vocab, grammar, log_level=0, limits=_LIMITS)
    if matcher.is_error():
        raise GrammarError(_clean(matcher.get_error()))
    _probe(matcher.deep_copy(), vocab)
    return _Compiled(matcher, messages)


def _probe(matcher: llguidance.LLMatcher, vocab: llguidance.LLTokenizer) -> None:
    """Walk the grammar's first PROBE_TOKENS tokens (each time the lowest allowed id that is
    not EOS) and raise GrammarError if the engine gives up or the walk takes longer than
    PROBE_BUDGET_S: a grammar too costly to constrain is refused before it reaches a batch."""
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    ends = set(vocab.eos_tokens)
    start = time.perf_counter()
    for _ in range(PROBE_TOKENS):
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        if matcher.is_error():
            raise GrammarError(_too_costly(matcher.get_error()))
        allowed = bitmask_to_bool(bitmask, vocab.vocab_size)[0].nonzero()[:, 0].tolist()
        token = next((t for t in allowed if t not in ends), None)
        if matcher.is_stopped() or token is None:
            return
        if not matcher.consume_token(token):
            raise GrammarError(_too_costly(matcher.get_error()))
        if time.perf_counter() - start > PROBE_BUDGET_S:
            raise GrammarError(
                f"too costly to constrain: its first {PROBE_TOKENS} tokens took over "
                f"{PROBE_BUDGET_S * 1000:.0f} ms"
            )


def _too_costly(message: str) -> str:
    reason = _clean(message)
    if "lexer" in reason or "fuel" in reason or "too many" in reason:
        return f"too costly to constrain ({reason})"
    return reason


_REFUSED: dict[tuple[str, str, tuple[str, int]], str] = {}  # oldest first, GRAMMAR_CACHE_SIZE


def cache_info() -> functools._CacheInfo:
    """Hits, misses and size of the compiled-grammar LRU."""
    return _compile.cache_info()


def clear_cache() -> None:
    _compile.cache_clear()
    with _VOCABS_LOCK:
        _REFUSED.clear()


# ---- specs -> canonical text ----


def _spec_text(kind: str, spec: object) -> str:
    """The grammar's source as text: the cache key and what the engine compiles."""
    if kind == "json":
        if not isinstance(spec, dict):
            raise GrammarError("the schema must be a JSON object")
        try:  # key order is kept: it is the order the properties are generated in
            text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from None
    elif kind in ("regex", "lark"):
        if not isinstance(spec, str):
            what = "a regular expression" if kind == "regex" else "a Lark grammar"
            raise GrammarError(f"must be a string ({what})")
        text = spec
    elif kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec:
            raise GrammarError("must be a non-empty list of strings")
        if not all(isinstance(c, str) for c in spec):
            raise GrammarError("every choice must be a string")
        text = json.dumps(list(spec), ensure_ascii=False)
    else:
        raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(f"longer than {MAX_SPEC_CHARS} characters")
    return text


# ---- the per-sequence constraint ----


class Constraint:
    """One sequence's position in a grammar: which tokens may come next, and what came so far.

    Not thread-safe: one sequence, one thread at a time (`fill_bitmask` may run it on a pool).
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, kind: str, vocab_size: int, eos_token: int
    ) -> None:
        self._m = matcher
        self.kind = kind
        self.vocab_size = vocab_size
        self.eos_token = eos_token
        self.seconds = 0.0  # spent computing this sequence's masks

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed-token bits into row `row` of an int32 (B, ceil(V/32)) CPU bitmask.

        Bit `t % 32` of word `t // 32` is set when token t is allowed. A finished constraint
        allows only EOS; a broken one (after a violation or a spent budget: see `error`) too, so
        no row is ever all -inf.
        """
        _check_bitmask(bitmask, row + 1)
        words = bitmask[row]
        start = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        self.seconds += time.perf_counter() - start
        if self._m.is_error():
            _eos_only(bitmask, row, self.eos_token)

    @property
    def error(self) -> str | None:
        """Why this sequence cannot go on under its grammar (the engine gave up on it, or its
        masks took longer than SEQUENCE_BUDGET_S in all), or None. The engine ends such a
        sequence with this error rather than let an EOS-only row end it with text the grammar
        does not accept."""
        if self._m.is_error():
            return _too_costly(self._m.get_error())
        if self.seconds > SEQUENCE_BUDGET_S:
            return f"too costly to constrain: its masks took over {SEQUENCE_BUDGET_S:g} s"
        return None

    def allowed_mask(self) -> torch.Tensor:
        """(V,) bool: True where the next token may be that id."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask)
        return bitmask_to_bool(bitmask, self.vocab_size)[0]

    def is_allowed(self, token: int) -> bool:
        """Whether `token` may come next (EOS: whether the output may end here)."""
        if token == self.eos_token:
            return self.accepts_eos()
        return self._m.validate_tokens([token]) == 1

    def advance(self, token: int) -> None:
        """Feed the sampled token; raises ConstraintViolation if it was not allowed."""
        if not self._m.consume_token(token):
            reason = self._m.get_error().splitlines()[0]
            raise ConstraintViolation(f"token {token} is not allowed here: {reason}")

    def accepts_eos(self) -> bool:
        """The output so far is complete: ending here (EOS) satisfies the grammar."""
        return self._m.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but EOS can follow (or EOS was consumed): the engine can end the sequence."""
        return self._m.is_stopped()

    def fork(self) -> Constraint:
        """An independent copy in the same state (for `n` completions of one prompt)."""
        return Constraint(self._m.deep_copy(), self.kind, self.vocab_size, self.eos_token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances."""
        if not self._m.rollback(num_tokens):
            raise ConstraintViolation(f"cannot roll back {num_tokens} tokens")

    def reset(self) -> None:
        """Back to the start state, as if no token had been fed."""
        self._m.reset()


class AfterToken:
    """A constraint that starts after a token: until `token` is sampled every token but the end
    of text is allowed (the text is free and cannot end there), then `inner` constrains the
    rest; with `opening`, that token comes first. A reasoning model's thinking stays free and
    its answer follows the grammar (`server.chat.reasoning`: `<think>` ... `</think>`). It
    answers what the engine asks of a `Constraint`."""

    def __init__(
        self, inner: Constraint, token: int, text_ids: int, opening: int | None = None
    ) -> None:
        self.inner = inner
        self.token = token
        self.text_ids = text_ids  # ids below it are the tokenizer's (above: padding, never)
        self.opening = opening
        self.state = "free" if opening is None else "opening"  # -> "free" -> "started"
        self.kind = inner.kind
        self.vocab_size = inner.vocab_size
        self.eos_token = inner.eos_token

    @property
    def seconds(self) -> float:
        return self.inner.seconds

    @property
    def error(self) -> str | None:
        return self.inner.error

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self.state == "started":
            self.inner.fill_bitmask(bitmask, row)
            return
        _check_bitmask(bitmask, row + 1)
        if self.state == "opening":
            bitmask[row] = 0
            bitmask[row, self.opening // 32] = _bit(self.opening % 32)
            return
        bitmask[row] = -1
        bitmask[row, self.eos_token // 32] &= ~_bit(self.eos_token % 32)  # no end before the answer
        first, used = divmod(self.text_ids, 32)  # the ids past the tokenizer's: never
        if used:
            bitmask[row, first] &= (1 << used) - 1
            first += 1
        bitmask[row, first:] = 0

    def allowed_mask(self) -> torch.Tensor:
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask)
        return bitmask_to_bool(bitmask, self.vocab_size)[0]

    def advance(self, token: int) -> None:
        if self.state == "started":
            self.inner.advance(token)
        elif self.state == "opening":
            if token != self.opening:
                raise ConstraintViolation(f"token {token} is not allowed here: {self.opening} is")
            self.state = "free"
        elif token == self.token:
            self.state = "started"
        elif token == self.eos_token:
            raise ConstraintViolation("the output ended before its constrained part began")

    def accepts_eos(self) -> bool:
        return self.state == "started" and self.inner.accepts_eos()

    def is_finished(self) -> bool:
        return self.state == "started" and self.inner.is_finished()

    def fork(self) -> AfterToken:
        copy = AfterToken(self.inner.fork(), self.token, self.text_ids, self.opening)
        copy.state = self.state
        return copy


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed int32."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def compile_constraint(
    kind: ConstraintKind, spec: object, tokenizer: Tokenizer, *, vocab_size: int | None = None
) -> Constraint:
    """A fresh constraint for one sequence. Raises GrammarError with a one-line message.

    kind/spec: "json" (spec: a JSON schema as a dict; `JSON_OBJECT_SCHEMA` for any object),
    "regex" (spec: a regular expression the whole output must match, Rust `regex` syntax: no
    lookaround or backreferences), "choice" (spec: a list of strings; the output is exactly one),
    "lark" (spec: a grammar in llguidance's Lark syntax, `%json {...}` and lazy lexemes included).
    vocab_size: the model's logits width, if larger than the tokenizer's (padded vocabularies).
    """
    try:
        if kind == "json":
            check_schema(spec)
        elif kind == "lark" and isinstance(spec, str):
            check_lark(spec)
    except TooCostly as exc:
        raise GrammarError(f"too costly to compile: {exc}", GRAMMAR_ERROR) from None
    text = _spec_text(kind, spec)
    vocab = grammar_vocab(tokenizer, vocab_size)
    key = (kind, text, (tokenizer.fingerprint, vocab.vocab_size))
    with _VOCABS_LOCK:
        refused = _REFUSED.get(key)
    if refused is not None:  # a costly refusal is not paid for twice
        raise GrammarError(refused)
    try:
        compiled = on_deep_stack(_compile, *key)  # its native recursion: engine.grammar_bounds
    except GrammarError as exc:
        with _VOCABS_LOCK:
            _REFUSED[key] = exc.message
            while len(_REFUSED) > GRAMMAR_CACHE_SIZE:
                _REFUSED.pop(next(iter(_REFUSED)))
        raise
    with compiled.lock:
        matcher = compiled.matcher.deep_copy()
    return Constraint(matcher, kind, vocab.vocab_size, tokenizer.eot_token)


# ---- batches of rows ----


def allocate_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An int32 (batch, ceil(vocab_size / 32)) CPU bitmask, all tokens allowed."""
    words = (vocab_size + 31) // 32
    return torch.full((batch, words), -1, dtype=torch.int32, pin_memory=pin_memory)


def _check_bitmask(bitmask: torch.Tensor, rows: int) -> None:
    """The engine writes through raw pointers: shape, dtype and place must be right."""
    if not (
        bitmask.dtype == torch.int32
        and bitmask.dim() == 2
        and bitmask.device.type == "cpu"
        and bitmask.is_contiguous()
    ):
        raise ValueError("bitmask must be a contiguous int32 (B, words) CPU tensor")
    if rows > bitmask.shape[0]:
        raise ValueError(f"{rows} rows asked of a bitmask with {bitmask.shape[0]}")


def _eos_only(bitmask: torch.Tensor, row: int, eos: int) -> None:
    bitmask[row] = 0
    word = (1 << (eos % 32)) - (1 << 32 if eos % 32 == 31 else 0)  # as a signed int32
    bitmask[row, eos // 32] = word


POOL_THREADS = min(os.cpu_count() or 1, 16)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor(num_threads=POOL_THREADS)


def fill_bitmask(
    constraints: Sequence[Constraint | None],
    bitmask: torch.Tensor,
    *,
    parallel: bool = False,
) -> None:
    """Row i of `bitmask` <- constraints[i]'s allowed tokens; rows with None allow every token.

    Rows past len(constraints) are left as they are. parallel: fill the rows on a pool of
    POOL_THREADS threads (the GIL is released) rather than one after another. Off by default:
    on 2 cores the pool is slower than the loop (bench/structured.py, 32 sequences: 21 vs 13 us
    a row for a JSON schema); measure before turning it on for a machine with more cores.
    """
    _check_bitmask(bitmask, len(constraints))
    rows = [(c, i) for i, c in enumerate(constraints) if c is not None]
    for i, c in enumerate(constraints):
        if c is None:
            bitmask[i] = -1
    if len(rows) == 1 or not parallel:
        for c, i in rows:
            c.fill_bitmask(bitmask, i)
    elif rows:
        pooled = [(c, i) for c, i in rows if isinstance(c, Constraint)]
        for c, i in rows:
            if not isinstance(c, Constraint):  # a wrapper (AfterToken) fills its own row
                c.fill_bitmask(bitmask, i)
        _executor().unsafe_compute_mask_ptr(
            [(c._m, i) for c, i in pooled], bitmask.data_ptr(), bitmask.shape[1] * 4,
            bitmask.shape[0],
        )  # fmt: skip
        for c, i in pooled:
            if c._m.is_error():
                _eos_only(bitmask, i, c.eos_token)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, words) int32 bitmask -> (B, vocab_size) bool, on the bitmask's device."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # numpy unpacks on one thread in microseconds; torch's (B, words, 32) shift spreads a
        # small job over its thread pool, which costs milliseconds on a busy machine
        rows = bitmask.contiguous().numpy().view(np.uint8)  # word w's bit j: byte 4w + j // 8
        bits = np.unpackbits(rows, axis=-1, count=vocab_size, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, words, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of (B, V) logits set to -inf, in place; returns logits."""
    mask = bitmask_to_bool(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    return logits.masked_fill_(~mask, float("-inf"))
