"""Sampling parameters and a batched sampler whose rows each have their own parameters.

The sampler turns a batch of logits into one token per row, with the token's logprob and the top-N
alternatives. Logprobs are those of the model's distribution after logit_bias and penalties (DRY
too), before temperature and truncation (min-p/top-k/typical-p/top-p/XTC), so they describe the
model, not the dice.

The order of the steps; a row that does not ask for a step skips it and is left as it was:
1. on the logits, every row (`apply_penalties`): logit_bias, presence and frequency penalties,
   repetition_penalty, DRY, min_tokens' bans;
2. a greedy row (temperature 0) takes the argmax there: no truncation step changes it;
3. a sampled row: divided by its temperature, then `truncate`: min_p, top_k, typical_p, top_p,
   XTC; then the draw.
llama.cpp's default order is penalties, DRY, top_k, typical_p, top_p, min_p, XTC, temperature.
This one differs in two places, both kept from before the llama.cpp samplers came so that no
request changes: the temperature scales the logits before the truncation (vLLM's order; at
temperature 1 the two agree), and min_p comes first (top_k, typical_p and top_p then see the
distribution renormalised after it). A greedy row is greedy: typical_p and XTC, which can drop
the best token, leave it alone (llama.cpp applies them before its greedy pick).

The llama.cpp samplers, as its server defines them (our own code):
- typical_p (locally typical sampling, Meister et al. 2022): the smallest set of tokens, taken by
  |-log p - H| ascending (H the entropy of the distribution so far; ties: the more probable
  first), whose probability reaches typical_p.
- XTC (exclude top choices): with probability xtc_probability (one draw from the row's own
  generator each sampled step, whatever the distribution) every token whose probability is at
  least xtc_threshold is removed except the least probable of them (ties all kept), when at least
  two reach it; a threshold above 0.5 leaves at most one such token, so XTC is off (no draw).
- DRY (don't repeat yourself): a token that would extend a repetition of n >= dry_allowed_length
  tokens (the longest suffix of the context's last dry_penalty_last_n tokens that occurs earlier
  in them followed by that token) loses dry_multiplier * dry_base ** (n - dry_allowed_length)
  from its logit. The suffix never reaches back across a sequence breaker (`DryBreakers`), and a
  single-token breaker is never penalised itself. The exponent stops where dry_base ** exponent
  would pass float32's largest value, as in llama.cpp, and so does the penalty (a logit DRY
  lowers stays finite: a row never becomes all -inf through it).

Each row is sampled as it would be alone: a seeded row draws its noise from its own generator, and
each row is truncated by its own parameters only. So a seeded request's tokens depend on its batch
only through its logits: on a CPU in float32 these are the same alone and in any batch to the bit,
so are its tokens; in bfloat16, int8 and a GGUF file's bits they agree to rounding, and a token
can differ where two candidates are that close, unless the server runs with `--batch-invariant`
(`EngineConfig.batch_invariant` and `load_for_inference(..., batch_invariant=True)`), which makes
them equal to the bit there too (docs/RELIABILITY.md, "Batch invariance", with the exceptions).
The sampler runs on the logits' device and reads its results back to the host once per call.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gptserve.engine.errors import RequestError
from gptserve.engine.pooling import PoolingParams
from gptserve.kernels.cpu.native import logit_stats_op

MAX_LOGPROBS = 20
# DRY's sequence breakers by default (llama.cpp's), and the bounds on a request's list
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 32
# the llama.cpp samplers' fields, named as SamplingParams and the HTTP requests name them
LLAMA_CPP_SAMPLER_FIELDS = (
    "typical_p", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
)  # fmt: skip
XTC_MAX_THRESHOLD = 0.5  # above it at most one token can reach the threshold: XTC is off
_FLOAT32_MAX_LOG = 88.7228391  # log of float32's largest value: DRY's exponent stops below it
_FLOAT32_MAX = torch.finfo(torch.float32).max  # and its penalty there: a logit stays finite
DRY_NUMPY_PASSES = 48  # DRY's runs longer than this are found by the Z-algorithm


@dataclass(frozen=True)
class DryBreakers:
    """DRY's sequence breakers as token ids: `ids`, every token whose text contains a breaker
    string; `sequences`, the tokenization of each breaker that takes several tokens. A
    repetition never reaches back across a breaker token or a whole breaker sequence."""

    ids: frozenset[int] = frozenset()
    sequences: tuple[tuple[int, ...], ...] = ()


def check_dry_sequence_breakers(breakers: Any) -> None:
    """RequestError unless breakers is a list of at most 16 non-empty strings of at most 32
    characters each (valid Unicode)."""
    param = "dry_sequence_breakers"
    if not isinstance(breakers, (list, tuple)) or len(breakers) > MAX_DRY_BREAKERS:
        raise RequestError(f"{param} must be a list of at most {MAX_DRY_BREAKERS} strings", param)
    for text in breakers:
        if not isinstance(text, str) or not 0 < len(text) <= MAX_DRY_BREAKER_CHARS:
            raise RequestError(
                f"{param} must be non-empty strings of at most {MAX_DRY_BREAKER_CHARS} characters",
                param,
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"{param} contains invalid Unicode", param) from None


class DryBreakerIndex:
    """A tokenizer's DRY breakers: breaker strings -> `DryBreakers`. Each new string costs one
    scan of the vocabulary's bytes (milliseconds); the last `cache_size` strings are kept."""

    def __init__(self, tokenizer: Any, cache_size: int = 1024) -> None:
        self._tokenizer = tokenizer
        self._vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self._one = functools.lru_cache(cache_size)(self._breaker)

    def resolve(self, breakers: Sequence[str]) -> DryBreakers:
        """The breakers' tokens (RequestError naming dry_sequence_breakers for a bad list)."""
        check_dry_sequence_breakers(breakers)
        ids: set[int] = set()
        sequences: set[tuple[int, ...]] = set()
        for text in breakers:
            contain, sequence = self._one(text)
            ids |= contain
            if sequence:
                sequences.add(sequence)
        return DryBreakers(frozenset(ids), tuple(sorted(sequences)))

    def _breaker(self, text: str) -> tuple[frozenset[int], tuple[int, ...] | None]:
        needle = text.encode("utf-8")
        contain = frozenset(i for i, piece in enumerate(self._vocab) if needle in piece)
        ids = tuple(self._tokenizer.encode(text, allow_special=False))
        return contain, (ids if len(ids) > 1 else None)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 is greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0  # 1: off
    xtc_probability: float = 0.0  # 0: off
    xtc_threshold: float = 0.1  # above 0.5: off
    repetition_penalty: float = 1.0
    dry_multiplier: float = 0.0  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context; 0: off
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS))
    # the breakers as tokens, resolved against the tokenizer (`DryBreakerIndex.resolve`; the
    # server does it); None: not resolved, and DRY runs without breakers
    dry_breakers: DryBreakers | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per generated token
    prompt_logprobs: int | None = None  # the same for prompt tokens (scoring)
    n: int = 1
    # structured output: a `engine.grammar.Constraint` at its start; each sequence follows a copy
    constraint: Any = None
    # prefix cache isolation: prompts share cached KV blocks only with prompts of the same salt
    # (None: the shared, unsalted chain); not a sampling choice, but it travels with the request
    cache_salt: str | None = None
    # who sent it (an API key's tenant id; None: no keys): the scheduler admits tenants in turn
    tenant: str | None = None
    # the LoRA adapter that serves the request, by name (None: the base model); like the salt,
    # not a sampling choice (engine.adapters)
    lora: str | None = None
    # an embedding request (engine.pooling): its prompt is pooled into one vector, nothing is
    # sampled (n 1, max_tokens 0)
    pooling: PoolingParams | None = None

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise RequestError naming the first bad field; returns self."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise RequestError(f"{param} {message}", param)

        def finite(x: float) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        check(finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "must be -1, 0 (off) or a positive integer",
        )
        check(finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(
            finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        check(finite(self.typical_p) and 0 < self.typical_p <= 1, "typical_p", "must be in (0, 1]")
        check(
            finite(self.xtc_probability) and 0 <= self.xtc_probability <= 1,
            "xtc_probability",
            "must be in [0, 1]",
        )
        check(
            finite(self.xtc_threshold) and 0 <= self.xtc_threshold <= 1,
            "xtc_threshold",
            "must be in [0, 1] (above 0.5 XTC is off)",
        )
        check(
            finite(self.dry_multiplier) and self.dry_multiplier >= 0,
            "dry_multiplier",
            "must be >= 0",
        )
        check(finite(self.dry_base) and self.dry_base > 1, "dry_base", "must be > 1")
        check(
            isinstance(self.dry_allowed_length, int) and self.dry_allowed_length >= 0,
            "dry_allowed_length",
            "must be >= 0",
        )
        check(
            isinstance(self.dry_penalty_last_n, int) and self.dry_penalty_last_n >= -1,
            "dry_penalty_last_n",
            "must be -1 (the whole context), 0 (off) or a positive integer",
        )
        check_dry_sequence_breakers(self.dry_sequence_breakers)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        for tok, bias in self.logit_bias.items():
            check(isinstance(tok, int) and tok >= 0, "logit_bias", f"bad token id {tok!r}")
            check(
                vocab_size is None or tok < vocab_size, "logit_bias", f"token id {tok} out of range"
            )
            check(
                finite(bias) and -100 <= bias <= 100, "logit_bias", "biases must be in [-100, 100]"
            )
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens", "must be >= 0"
        )
        check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be in [0, max_tokens]",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for tok in self.stop_token_ids:
            check(
                isinstance(tok, int) and tok >= 0 and (vocab_size is None or tok < vocab_size),
                "stop_token_ids",
                f"bad token id {tok!r}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be between 0 and {MAX_LOGPROBS}",
            )
        check(isinstance(self.n, int) and self.n >= 1, "n", "must be >= 1")
        check(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
            "cache_salt",
            "must be a non-empty string",
        )
        check(
            self.lora is None or (isinstance(self.lora, str) and self.lora),
            "model",
            "must name the base model or a LoRA adapter",
        )
        if self.pooling is not None:  # an embedding: one vector of the prompt, nothing sampled
            check(self.n == 1, "n", "must be 1 for an embedding")
            check(self.max_tokens == 0, "max_tokens", "must be 0 for an embedding")
            check(self.prompt_logprobs is None, "prompt_logprobs", "is not for an embedding")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def uses_xtc(self) -> bool:
        return self.xtc_probability > 0 and self.xtc_threshold <= XTC_MAX_THRESHOLD

    def make_generator(self, offset: int = 0) -> torch.Generator | None:
        """The request's own RNG (seed + offset for the offset-th of n completions), or None."""
        if self.seed is None:
            return None
        return torch.Generator().manual_seed((self.seed + offset) % (2**63))


@dataclass
class SampleOutput:
    """Per row: chosen token, its logprob (NaN where no row of the batch reports logprobs: not
    computed), and top-N alternatives (padded to the batch's max N)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class SampleRow:
    """What the sampler needs to know about one row besides its logits."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    eos_token: int | None = None  # banned while fewer than min_tokens are generated


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """logit_bias, repetition/presence/frequency penalties, DRY and min_tokens on (B, V) logits.

    The input is left as it was: the result is a copy, made at the first change, or the input
    itself when no row has anything to apply.
    """
    vocab, device = logits.shape[1], logits.device
    copy: list[torch.Tensor] = []

    def own() -> torch.Tensor:
        if not copy:
            copy.append(logits.clone())
        return copy[0]

    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
            own()[i, ids] += bias
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            out_ids = torch.tensor(row.output_ids, device=device)
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab]
            counts = counts.to(logits.dtype)
            own()[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = sorted(set(row.prompt_ids) | set(row.output_ids))
            seen = torch.tensor(seen, dtype=torch.long, device=device)
            if len(seen):
                out = own()
                vals = out[i, seen]
                penalty = p.repetition_penalty
                out[i, seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if p.uses_dry:
            penalties = dry_penalties(row.prompt_ids + row.output_ids, p)
            if penalties:
                ids = torch.tensor(list(penalties), dtype=torch.long, device=device)
                values = torch.tensor(list(penalties.values()), dtype=logits.dtype, device=device)
                own()[i, ids] -= values
        if len(row.output_ids) < p.min_tokens:
            banned = list(p.stop_token_ids)
            if row.eos_token is not None and not p.ignore_eos:
                banned.append(row.eos_token)
            if banned:
                own()[i, banned] = float("-inf")
    return copy[0] if copy else logits


def dry_penalties(tokens: Sequence[int], params: SamplingParams) -> dict[int, float]:
    """DRY after `tokens` (the prompt and the output so far): token -> what its logit loses.

    Each position j of the window (its last dry_penalty_last_n tokens) holds a token that followed
    a run matching the window's suffix; the run's length (at most the tokens after the last
    breaker) is the repetition that token would extend. The runs grow one token a pass, over the
    positions still matching (numpy), so a pass costs what is left of them; past
    `DRY_NUMPY_PASSES` passes (long repetitions, where that grows quadratic) the Z-algorithm
    finds them instead, in one linear pass in Python.
    """
    last_n = params.dry_penalty_last_n
    window = list(tokens[-last_n:]) if last_n > 0 else list(tokens)
    n, allowed = len(window), params.dry_allowed_length
    if n < 2 or n <= allowed:
        return {}
    breakers = params.dry_breakers or DryBreakers()
    limit = _tokens_after_breaker(window, breakers)
    if limit < allowed:
        return {}
    seq = np.asarray(window, dtype=np.int64)
    length = np.zeros(n - 1, dtype=np.int64)  # [e]: the run ending at e, followed by seq[e + 1]
    alive = np.arange(n - 1)
    for m in range(min(limit, n - 1)):
        if m >= DRY_NUMPY_PASSES:
            length = np.minimum(_suffix_runs(window), limit)
            break
        alive = alive[alive >= m]
        alive = alive[seq[alive - m] == seq[n - 1 - m]]
        if not alive.size:
            break
        length[alive] = m + 1
    hit = np.nonzero(length >= allowed)[0]
    if not hit.size:
        return {}
    follow, runs = seq[hit + 1], length[hit]
    order = np.lexsort((runs, follow))  # by token, then run: each token's longest run last
    follow, runs = follow[order], runs[order]
    longest = np.append(follow[1:] != follow[:-1], True)
    max_exp = int(_FLOAT32_MAX_LOG / math.log(params.dry_base))
    mult, base = params.dry_multiplier, params.dry_base
    return {
        tok: min(mult * base ** min(run - allowed, max_exp), _FLOAT32_MAX)
        for tok, run in zip(follow[longest].tolist(), runs[longest].tolist())
        if tok not in breakers.ids
    }


def _suffix_runs(window: list[int]) -> np.ndarray:
    """[e] for e < len(window) - 1: the longest common suffix of window[: e + 1] and window (the
    Z-algorithm on the reversed window: z[k] is the common prefix of it and its k-th suffix)."""
    r = window[::-1]
    n = len(r)
    z = [0] * n
    left = right = 0  # the match found furthest right: r[left:right] == r[: right - left]
    for k in range(1, n):
        run = min(right - k, z[k - left]) if k < right else 0
        while k + run < n and r[run] == r[k + run]:
            run += 1
        z[k] = run
        if k + run > right:
            left, right = k, k + run
    return np.asarray(z[:0:-1], dtype=np.int64)  # e = n - 1 - k


def _tokens_after_breaker(window: list[int], breakers: DryBreakers) -> int:
    """How many of the window's tokens come after its last breaker token or breaker sequence."""
    n = after = len(window)
    if breakers.ids:
        for k in range(n - 1, -1, -1):
            if window[k] in breakers.ids:
                after = n - 1 - k
                break
    if breakers.sequences and after:
        data = array("q", window).tobytes()  # 8 bytes a token: bytes.rfind finds a sequence
        for sequence in breakers.sequences:
            needle = array("q", sequence).tobytes()
            end = len(data)
            while (at := data.rfind(needle, 0, end)) >= 0:
                if at % 8 == 0:  # aligned on a token
                    after = min(after, n - at // 8 - len(sequence))
                    break
                end = at + len(needle) - 1
    return after


def truncate(scaled: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Mask tokens outside each row's min-p / top-k / typical-p / top-p set with -inf, then apply
    XTC; (B, V) in place.

    Each row is truncated as it would be alone: only the rows that ask for top-k, typical-p or
    top-p go through the sort, typical-p changes only the rows that ask for it, and top-p cuts only
    rows with top_p < 1 (in float32 the cumulative sum of a large vocabulary reaches 1 before its
    tail, which would drop thousands of tokens). XTC draws once for each row that asks for it,
    from the row's generator (or the global one), and changes only the rows it picks.
    """
    device = scaled.device
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        probs = torch.softmax(scaled, dim=-1)
        floor = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None]
        floor = floor * probs.max(-1, keepdim=True).values
        scaled.masked_fill_(probs < floor, float("-inf"))
    cut = [
        i
        for i, r in enumerate(rows)
        if r.params.top_k > 0 or r.params.top_p < 1 or r.params.typical_p < 1
    ]
    if cut:
        _sorted_cut(scaled, rows, cut)
    xtc = [i for i, r in enumerate(rows) if r.params.uses_xtc]
    if xtc:
        _exclude_top_choices(scaled, rows, xtc)
    return scaled


def _sorted_cut(scaled: torch.Tensor, rows: list[SampleRow], cut: list[int]) -> None:
    """top-k, typical-p and top-p on the rows `cut`, in place: one sort of those rows."""
    device = scaled.device
    index = None if len(cut) == len(rows) else torch.tensor(cut, device=device)
    part = scaled if index is None else scaled[index]  # (C, V)
    sorted_logits, order = part.sort(dim=-1, descending=True)  # (C, V)
    vocab = part.shape[1]
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = [rows[i].params.top_k for i in cut]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device)[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    guard = torch.ones(len(cut), 1, dtype=torch.bool, device=device)  # the best token survives
    typical = [j for j, i in enumerate(cut) if rows[i].params.typical_p < 1]
    if typical:  # those rows alone: the others keep their probabilities to the bit
        at = torch.tensor(typical, device=device)
        guard[at] = False  # the most typical token survives, which may not be the best
        mass = [rows[cut[j]].params.typical_p for j in typical]
        mass = torch.tensor(mass, dtype=probs.dtype, device=device)[:, None]
        keep = drop[at] | _atypical(probs[at], mass)
        drop[at] = keep
        probs[at] = torch.softmax(sorted_logits[at].masked_fill(keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(-1) - probs  # probability of strictly better tokens
    top_p = [p if p < 1 else math.inf for p in (rows[i].params.top_p for i in cut)]
    drop |= mass_before >= torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None]
    drop[:, :1] &= ~guard
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    if index is None:
        scaled.scatter_(1, order, kept)
    else:
        scaled.index_copy_(0, index, part.scatter_(1, order, kept))  # part is a copy


def _atypical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: (T, V) probabilities sorted best first and (T, 1) typical_p ->
    (T, V) bool, the tokens outside the smallest set that, taken by |-log p - H| ascending (ties
    in that order: the better token first), holds typical_p of the probability."""
    entropy = -torch.special.xlogy(probs, probs).sum(-1, keepdim=True)  # 0 log 0 = 0
    shift = (-torch.log(probs) - entropy).abs()  # inf where p = 0: last
    shift, by_shift = shift.sort(dim=-1, stable=True)
    taken = probs.gather(1, by_shift)
    drop = (taken.cumsum(-1) - taken) >= mass  # what came before already holds typical_p
    drop[:, 0] = False
    return torch.zeros_like(drop).scatter_(1, by_shift, drop)


def _exclude_top_choices(scaled: torch.Tensor, rows: list[SampleRow], xtc: list[int]) -> None:
    """XTC on the rows `xtc`, in place: each draws whether it applies this step; in a row that
    does, every token of probability >= xtc_threshold but the least probable of them goes, if at
    least two reach it."""
    picked = []
    for i in xtc:
        gen = rows[i].generator
        draw = float(torch.rand(1, generator=gen)) if gen is not None else float(torch.rand(1))
        if draw < rows[i].params.xtc_probability:
            picked.append(i)
    if not picked:
        return
    device = scaled.device
    index = torch.tensor(picked, device=device)
    part = scaled[index]  # (X, V), a copy
    probs = torch.softmax(part, dim=-1)
    threshold = [rows[i].params.xtc_threshold for i in picked]
    threshold = torch.tensor(threshold, dtype=probs.dtype, device=device)[:, None]
    top = (probs >= threshold) & (part > float("-inf"))  # a masked token never counts
    least = probs.masked_fill(~top, math.inf).min(dim=-1, keepdim=True).values
    drop = top & (probs > least) & (top.sum(-1, keepdim=True) >= 2)
    scaled.index_copy_(0, index, part.masked_fill_(drop, float("-inf")))


def draw_distribution(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """(B, V) penalised logits of sampled rows (temperature > 0) -> the (B, V) probabilities each
    row draws from: divided by its temperature, truncated (min-p/top-k/typical-p/top-p/XTC: XTC
    draws from a row's generator), softmaxed.

    The sampler and speculative verification (`engine.verify`) both draw from this.
    """
    temps = [r.params.temperature for r in rows]
    temps = torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]  # (B, 1)
    return torch.softmax(truncate(logits / temps, rows), dim=-1)


def sample(
    logits: torch.Tensor, rows: list[SampleRow], allowed: torch.Tensor | None = None
) -> SampleOutput:
    """Pick one token per row of (B, V) logits according to each row's parameters.

    allowed (B, V) bool, if given, masks each row first (structured output): the logprobs
    reported are those of the masked distribution.
    """
    device = logits.device
    if allowed is not None:
        logits = logits.float().masked_fill(~allowed.to(device, non_blocking=True), float("-inf"))
    logits = apply_penalties(logits.float(), rows)  # a copy only if a row changes it
    # no row reports a logprob: the greedy choices alone (no exp pass over the vocabulary)
    reported = any(r.params.logprobs is not None for r in rows)
    tokens, lse = _argmax_and_logsumexp(logits, reported)  # (B,) each; greedy, replaced below
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=device)
        probs = draw_distribution(logits[idx], [rows[i] for i in sampled])  # (S, V)
        # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each row has its own E,
        # drawn as -log(U) for U ~ Uniform[0, 1): on a CPU 5x faster than exponential_ (32 rows
        # of GPT-2's vocabulary: 4.7 against 23 ms); U = 0 gives E = inf, a weight of 0
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(sampled) if rows[i].generator is not None]
        if len(seeded) < len(sampled):
            noise.uniform_()  # the seeded rows are drawn again below
        for j in seeded:  # a seeded row: its own CPU generator's draw
            draw = torch.empty(probs.shape[1]).uniform_(generator=rows[sampled[j]].generator)
            noise[j] = draw.to(device, non_blocking=True)
        tokens[idx] = (probs / noise.log_().neg_()).argmax(dim=-1)
    if lse is None:
        no_top = [[] for _ in rows], [[] for _ in rows]  # ids, logprobs
        return SampleOutput(tokens.tolist(), [math.nan] * len(rows), *no_top)
    chosen = logits.gather(1, tokens[:, None])[:, 0] - lse  # (B,) log-probabilities
    n_top = max((r.params.logprobs or 0) for r in rows)
    if n_top:
        values, ids = logits.topk(n_top, dim=-1)  # (B, n_top)
        values = values - lse[:, None]
    else:  # no row asked for alternatives: a topk of 0 still reads every row (0.15 ms)
        values = ids = logits.new_empty(len(rows), 0)
    tokens, chosen, ids, values = _to_host(tokens, chosen, ids, values)
    wanted = [r.params.logprobs or 0 for r in rows]
    top_ids = [row[:n] for row, n in zip(ids, wanted)]
    top_lp = [row[:n] for row, n in zip(values, wanted)]
    return SampleOutput(tokens, chosen, top_ids, top_lp)


def _argmax_and_logsumexp(
    logits: torch.Tensor, with_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, V) float logits -> each row's first largest index (B,) and log-sum-exp (B,), or
    None for the latter without `with_lse`.

    On a CPU one compiled pass a row where the kernels build (kernels/cpu/logit_stats.cpp);
    elsewhere a log_softmax, which on a CPU is faster than logsumexp (32 rows of GPT-2's
    vocabulary: 0.36 against 0.71 ms, and 3.3 ms for logsumexp when masked rows hold -inf,
    whose exp takes a slow path)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        stats = logit_stats_op()
        if stats is not None:
            top, lse = stats(logits if logits.stride(-1) == 1 else logits.contiguous(), with_lse)
            return top, lse if with_lse else None
    top = logits.argmax(dim=-1)  # (B,)
    if not with_lse:
        return top, None
    lse = (
        logits.gather(1, top[:, None])[:, 0]
        - torch.log_softmax(logits, dim=-1).gather(1, top[:, None])[:, 0]
    )  # the largest logit minus its log-probability
    return top, lse


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """Each tensor as (nested) Python lists, read back from the device in one transfer.

    Packed as float64, which holds token ids (< 2**53) exactly.
    """
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        part = flat[at : at + t.numel()]
        at += t.numel()
        if t.dim() == 2:
            width = t.shape[1]
            part = [part[r * width : (r + 1) * width] for r in range(t.shape[0])]
        if not t.is_floating_point():
            part = [[int(v) for v in p] for p in part] if t.dim() == 2 else [int(v) for v in part]
        out.append(part)
    return out


def prompt_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, n_top: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Logprob of each actual next token (T,) under logits (T, V), plus the top n_top alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    chosen = lp.gather(1, next_ids[:, None].long())[:, 0]
    if n_top:
        values, ids = lp.topk(n_top, dim=-1)
        return chosen.tolist(), ids.tolist(), values.tolist()
    return chosen.tolist(), [[] for _ in range(len(chosen))], [[] for _ in range(len(chosen))]
