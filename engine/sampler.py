"""Sampling parameters and a batched sampler whose rows each have their own parameters.

The sampler turns a batch of logits into one token per row, with the token's logprob and the top-N
alternatives. Logprobs are those of the model's distribution after logit_bias and penalties, before
temperature and truncation (top-k/top-p/min-p), so they describe the model, not the dice.
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

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from gptserve.engine.errors import RequestError
from gptserve.engine.pooling import PoolingParams
from gptserve.kernels.cpu.native import logit_stats_op

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 is greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
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
    """logit_bias, repetition/presence/frequency penalties and min_tokens on (B, V) logits.

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
        if len(row.output_ids) < p.min_tokens:
            banned = list(p.stop_token_ids)
            if row.eos_token is not None and not p.ignore_eos:
                banned.append(row.eos_token)
            if banned:
                own()[i, banned] = float("-inf")
    return copy[0] if copy else logits


def truncate(scaled: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p / min-p set with -inf; (B, V) in place.

    Each row is truncated as it would be alone: only the rows that ask for top-k or top-p go
    through the sort, and top-p cuts only rows with top_p < 1 (in float32 the cumulative sum of a
    large vocabulary reaches 1 before its tail, which would drop thousands of tokens).
    """
    device = scaled.device
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        probs = torch.softmax(scaled, dim=-1)
        floor = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None]
        floor = floor * probs.max(-1, keepdim=True).values
        scaled.masked_fill_(probs < floor, float("-inf"))
    cut = [i for i, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1]
    if not cut:
        return scaled
    index = None if len(cut) == len(rows) else torch.tensor(cut, device=device)
    part = scaled if index is None else scaled[index]  # (C, V)
    sorted_logits, order = part.sort(dim=-1, descending=True)  # (C, V)
    vocab = part.shape[1]
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = [rows[i].params.top_k for i in cut]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device)[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(-1) - probs  # probability of strictly better tokens
    top_p = [p if p < 1 else math.inf for p in (rows[i].params.top_p for i in cut)]
    drop |= mass_before >= torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None]
    drop[:, 0] = False  # the best token always survives
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    if index is None:
        return scaled.scatter_(1, order, kept)
    return scaled.index_copy_(0, index, part.scatter_(1, order, kept))  # part is a copy


def draw_distribution(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """(B, V) penalised logits of sampled rows (temperature > 0) -> the (B, V) probabilities each
    row draws from: divided by its temperature, truncated (top-k/top-p/min-p), softmaxed.

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
