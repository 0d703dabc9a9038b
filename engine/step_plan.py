"""One engine step as data: what the scheduler decided, read by the model runner and the engine.

A `StepPlan` lists the sequences that run, in packed order, each as a `ScheduledSeq`: how many new
tokens it feeds, what they are (its last sampled token, that token and guesses to verify, or a
chunk of tokens not yet cached), which rows of the step's logits it gets, and whether the step
draws its next token. An embedding request (`SamplingParams.pooling`) gets no logits rows but
rows of the step's final hidden states instead: every position of its chunk for mean pooling,
its last token for last pooling; its last chunk ends it (`pools`). The plan is built once per
step and read, never changed, afterwards.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gptserve.engine.sequence import Sequence


class StepKind(enum.Enum):
    """What a sequence's new tokens are in a step."""

    DECODE = "decode"  # its last sampled token: one logits row, a token is drawn from it
    VERIFY = "verify"  # its last sampled token, then guesses: a logits row each, for `verify`
    PREFILL = "prefill"  # a chunk of tokens not yet cached (a prompt's, or a preempted sequence's)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's part of a step."""

    seq: Sequence
    kind: StepKind
    num_tokens: int  # new tokens fed to the model (the KV cache grows by as many)
    first_row: int  # its first row in the step's logits
    num_rows: int  # 0 for a prefill chunk that ends inside the tokens still to compute
    samples: bool  # the chunk reaches the sequence's last token: the step draws what follows
    scores_prompt: bool  # every position gets logits, for the prompt's logprobs
    guesses: list[int] = field(default_factory=list)  # VERIFY only: the tokens after the last
    first_hidden: int = 0  # an embedding's first row in the step's hidden states
    num_hidden: int = 0  # its rows there (0 for anything but an embedding's chunk)
    pools: bool = False  # an embedding's last chunk: its vector is ready after the step

    @property
    def hidden_rows(self) -> slice:
        """Its rows of the step's final hidden states (an embedding's)."""
        return slice(self.first_hidden, self.first_hidden + self.num_hidden)

    @property
    def rows(self) -> slice:
        """Its rows of the step's logits."""
        return slice(self.first_row, self.first_row + self.num_rows)

    @property
    def last_row(self) -> int:
        """The row the next token is drawn from (for a chunk that samples)."""
        return self.first_row + self.num_rows - 1

    def input_ids(self) -> list[int]:
        """The token ids it feeds, read from the sequence as it was when the plan was made."""
        if self.kind is StepKind.VERIFY:
            return [self.seq.token_ids[-1], *self.guesses]
        start = self.seq.num_cached
        return self.seq.token_ids[start : start + self.num_tokens]


@dataclass(frozen=True)
class StepPlan:
    """The step's work in packed order, the packed positions that get logits (and final hidden
    states, for embeddings), and who was preempted to make room for it (their blocks are already
    freed)."""

    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    logits_positions: list[int]  # row i of the step's logits is packed position logits_positions[i]
    num_tokens: int
    # row i of the step's final hidden states is packed position hidden_positions[i]
    hidden_positions: list[int] = field(default_factory=list)

    @classmethod
    def build(
        cls, work: list[tuple[Sequence, int, list[int]]], preempted: list[Sequence]
    ) -> StepPlan:
        """Classify (sequence, new tokens, guesses) triples, in packed order, and lay out rows."""
        scheduled: list[ScheduledSeq] = []
        positions: list[int] = []
        hidden: list[int] = []
        start = 0  # the sequence's first packed position
        for seq, n, guesses in work:
            if guesses:
                if n != 1 + len(guesses) or seq.pending != 1:
                    raise ValueError("a verification feeds the last token and its guesses")
                kind = StepKind.VERIFY
            elif seq.pending == 1 and seq.num_generated >= 1:
                kind = StepKind.DECODE
            else:
                kind = StepKind.PREFILL
            verifies = kind is StepKind.VERIFY
            pooling = seq.params.pooling
            if pooling is not None:  # an embedding: hidden-state rows, no logits, no draw
                if kind is not StepKind.PREFILL:
                    raise ValueError("an embedding request only prefills")
                pools, first_hidden = n == seq.pending, len(hidden)
                if pooling.mode == "mean":
                    hidden.extend(range(start, start + n))
                elif pools:
                    hidden.append(start + n - 1)
                scheduled.append(
                    ScheduledSeq(seq, kind, n, len(positions), 0, False, False, [],
                                 first_hidden, len(hidden) - first_hidden, pools)
                )  # fmt: skip
                start += n
                continue
            samples = verifies or n == seq.pending
            scores = (
                seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_generated == 0
            )
            first_row = len(positions)
            if scores or verifies:
                positions.extend(range(start, start + n))
            elif samples:
                positions.append(start + n - 1)
            rows = len(positions) - first_row
            scheduled.append(
                ScheduledSeq(seq, kind, n, first_row, rows, samples, scores, list(guesses))
            )
            start += n
        return cls(scheduled, preempted, positions, start, hidden)
