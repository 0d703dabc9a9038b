"""Speculative decoding: propose a few tokens cheaply, let the model check them all in one forward.

A proposer guesses the next k tokens of a sequence; the engine runs the sequence's last token and
the k guesses through the model as one chunk, which gives k + 1 next-token distributions, and
`verify` keeps the longest run of guesses the model agrees with, plus one token of the model's
own. Decoding is bound by reading the weights, so a forward over k + 1 tokens costs little more
than over one, and each accepted guess saves a whole step.

`verify` keeps the model's distribution exactly (rejection sampling, as in Leviathan et al. 2023
and Chen et al. 2023). Every proposer here is deterministic (prompt lookup, a draft model decoding
greedily), so a guess x is certain, q(x) = 1: it is accepted with probability p(x); on a
rejection the token is drawn from p without x, renormalised (max(0, p - q)); when every guess is
accepted a bonus token is drawn from the last distribution. The token kept at each position is
then distributed as p there. A greedy row accepts a guess when it is the argmax, so its output is
the one plain greedy decoding gives.

p is the distribution the sampler draws from: after penalties and logit bias (per position, with
the guesses before it counted as output), temperature and top-k/top-p/min-p.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from gptserve.engine.sampler import SampleRow, apply_penalties, draw_distribution, sample


def propose_ngram(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: find the sequence's last n tokens earlier in it and propose what followed.

    The longest n in [min_n, max_n] with a match wins, and its latest earlier occurrence. Returns
    up to k tokens (none when nothing matches). The search runs over the tokens as bytes
    (`bytes.rfind`), so it costs microseconds even for thousands of tokens.
    """
    if k <= 0 or len(tokens) < 2:
        return []
    data = array("q", tokens).tobytes()  # 8 bytes a token
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = data[-8 * n :]
        end = 8 * (len(tokens) - 1)  # a match must end before the last token: not the tail itself
        while (at := data.rfind(tail, 0, end)) >= 0:
            if at % 8 == 0:  # aligned on a token
                start = at // 8 + n
                return tokens[start : start + k]
            end = at + len(tail) - 1  # look further left
    return []


@dataclass
class Verified:
    """What one sequence keeps from a verification step."""

    tokens: list[int]  # the accepted guesses, then one token of the model's own
    logprobs: list[float]  # of each token, under the model's distribution (before temperature)
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def verify(logits: torch.Tensor, row: SampleRow, guesses: list[int]) -> Verified:
    """Check certain guesses against logits (k + 1, V): row j is the distribution after guess
    j - 1."""
    k = len(guesses)
    rows = [_row_after(row, guesses[:j]) for j in range(k + 1)]
    if row.params.greedy:
        out = sample(logits, rows)  # argmax of each position, penalties per position
        n = next((j for j in range(k) if out.tokens[j] != guesses[j]), k)
        end = n + 1
        return Verified(out.tokens[:end], out.logprobs[:end], out.top_ids[:end],
                        out.top_logprobs[:end])  # fmt: skip
    penalised = apply_penalties(logits.float(), rows)  # (k + 1, V)
    probs = draw_distribution(penalised, rows)  # (k + 1, V), as the sampler would draw
    gen = row.generator
    uniforms = torch.rand(k, generator=gen).tolist()  # one acceptance draw per guess
    accepted: list[int] = []
    final = None
    for j, guess in enumerate(guesses):
        if uniforms[j] < float(probs[j, guess]):
            accepted.append(guess)
            continue
        residual = probs[j].clone()  # (V,)
        residual[guess] = 0.0
        # p held nothing but the guess (a rejection then comes of p rounding just below 1)
        final = _draw(residual, gen) if float(residual.sum()) > 0 else guess
        break
    if final is None:  # every guess accepted: a bonus token from the last distribution
        final = _draw(probs[k], gen)
    tokens = accepted + [final]
    # logprobs and alternatives of the kept positions, as the plain sampler reports them
    log_total = torch.logsumexp(penalised[: len(tokens)], dim=-1)
    chosen = penalised[torch.arange(len(tokens)), torch.tensor(tokens)] - log_total
    n_top = row.params.logprobs or 0
    values, ids = penalised[: len(tokens)].topk(n_top, dim=-1)
    values = values - log_total[:, None]
    return Verified(tokens, chosen.tolist(), ids.tolist(), values.tolist())


def _row_after(row: SampleRow, guesses: list[int]) -> SampleRow:
    """The sampler row for the position after these guesses (they count as output so far)."""
    if not guesses:
        return row
    return SampleRow(row.params, row.prompt_ids, row.output_ids + guesses, row.generator,
                     row.eos_token)  # fmt: skip


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token drawn in proportion to weights (V,)."""
    return int(torch.multinomial(weights.float().cpu(), 1, generator=gen))
