"""Speculative decoding in the engine: who proposes guesses, for which sequences, and when not.

Before each step the `Speculator` offers some decoding sequences a few guesses ({seq_id: tokens});
the scheduler puts them in the step's plan as a chunk of 1 + k tokens (cut to its budget), the
model scores them all in the step's one forward, and the engine keeps what `engine.verify.verify`
accepts.

Two proposers:
- `NgramProposer` (prompt lookup, `--speculative ngram`): no second model; guesses what followed
  the sequence's last few tokens the last time they occurred in it. Pays on text that repeats
  (code, quoted passages, summaries of the prompt).
- `DraftProposer` (`--draft-model DIR`): a smaller model with the same tokenizer decodes k tokens
  greedily over a KV cache of its own, batched over the sequences.

It falls back to plain decoding, per sequence, where it does not pay: when the proposer has
nothing, when too many sequences decode at once (a CPU is then busy with the batch already, and a
guess costs a full token of compute), and for a while after a sequence's guesses were mostly
rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gptserve.engine.block_manager import BlockManager, OutOfBlocks
from gptserve.engine.sequence import Sequence
from gptserve.engine.verify import propose_ngram
from gptserve.kernels.paged_kv import KVPools
from gptserve.model.gpt import GPT


class NgramProposer:
    """Prompt lookup over the sequence's own tokens (prompt and output)."""

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n

    def propose(self, seqs: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """{seq_id: guesses} for (sequence, at most k guesses) pairs; sequences may get none."""
        return {s.seq_id: g for s, k in seqs if (g := propose_ngram(s.token_ids, k, self.max_n))}

    def forget(self, seq_id: int) -> None:
        pass


class DraftProposer:
    """A small model decodes k tokens greedily for each sequence, over its own paged cache."""

    def __init__(self, model: GPT, max_num_seqs: int, block_size: int = 16) -> None:
        self.model = model.eval()
        blocks = max_num_seqs * -(-model.config.context_length // block_size)
        self.pools = KVPools.for_model(model, blocks, block_size)
        self.blocks = BlockManager(blocks, block_size, self.pools.device, prefix_caching=False)
        self.device = next(model.parameters()).device
        # tokens of each sequence the draft's cache holds as the sequence's own, counted once a
        # forward over them succeeded (its guesses after them are the draft's, dropped before the
        # next proposal whether they were checked or not)
        self._own_tokens_fed: dict[int, int] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        # first forward: each sequence's tokens the draft has not seen yet (its prompt at first)
        todo: list[tuple[Sequence, int]] = []
        for s, k in seqs:
            if len(s.token_ids) + k <= self.model.config.context_length:
                todo.append((s, k))
        feed = {}
        for s, _ in todo:
            # past _own_tokens_fed: guesses, or room a failed forward reserved but never filled
            fed = self._own_tokens_fed.get(s.seq_id, 0)
            if self.blocks.seq_len(s.seq_id) > fed:
                self.blocks.truncate(s.seq_id, fed)
            feed[s.seq_id] = s.token_ids[fed:]
        guesses: dict[int, list[int]] = {s.seq_id: [] for s, _ in todo}
        for step in range(max((k for _, k in todo), default=0)):
            batch = [(s, feed[s.seq_id]) for s, k in todo if step < k]
            try:
                step_blocks = self.blocks.prepare([(s.seq_id, len(t)) for s, t in batch])
            except OutOfBlocks:
                break  # the draft's pool is full: propose what there is
            tokens = torch.tensor([t for _, ts in batch for t in ts], device=self.device)
            self.pools.copy_blocks(step_blocks.copies)
            logits = self.model.forward_cached(tokens, self.pools, step_blocks.meta)  # (B, V)
            if step == 0:  # the sequences' own tokens are in the draft's cache now
                for s, _ in batch:
                    self._own_tokens_fed[s.seq_id] = len(s.token_ids)
            for (s, _), token in zip(batch, logits.argmax(-1).tolist()):
                guesses[s.seq_id].append(token)
                feed[s.seq_id] = [token]
        return {sid: g for sid, g in guesses.items() if g}

    def forget(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self._own_tokens_fed.pop(seq_id, None)


@dataclass
class _Record:
    attempts: int = 0
    proposed: int = 0
    accepted: int = 0
    misses: int = 0  # proposals in a row that had no guess to offer
    paused_until: int = 0  # a step count: no guesses before it
    pauses: int = 0  # poor runs of guesses in a row: each pause lasts twice the one before


@dataclass
class Speculator:
    """Hands out guesses before a step and learns from what verification accepted."""

    proposer: NgramProposer | DraftProposer
    num_tokens: int = 4  # guesses per sequence and step, at most
    max_batch: int = 4  # no guesses while more sequences than this decode
    pause_steps: int = 16  # after a first poor run of guesses, how long a sequence decodes plainly
    window: int = 2  # verifications judged together
    max_doublings: int = 6  # the longest pause: pause_steps * 2**6 steps
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    _records: dict[int, _Record] = field(default_factory=dict)
    _steps: int = 0

    def propose(self, running: list[Sequence], max_len: int) -> dict[int, list[int]]:
        """{seq_id: guesses} for the decoding sequences that get some this step."""
        self._steps += 1
        # decoding sequences past their first token (a prompt's last chunk samples plainly: n > 1
        # forks happen there)
        decoding = [s for s in running if s.pending == 1 and s.num_generated >= 1]
        if not decoding or len(decoding) > self.max_batch:
            return {}
        wanted = []
        for s in decoding:
            room = min(s.params.max_tokens - s.num_generated, max_len - len(s.token_ids)) - 1
            record = self._records.setdefault(s.seq_id, _Record())
            if room > 0 and record.paused_until <= self._steps and s.constraint is None:
                wanted.append((s, min(self.num_tokens, room)))
        got = self.proposer.propose(wanted)
        offered: dict[int, list[int]] = {}
        for s, k in wanted:
            if guesses := got.get(s.seq_id, [])[:k]:
                offered[s.seq_id] = guesses
                continue
            r = self._records[s.seq_id]  # nothing to offer, again and again: stop asking a while
            r.misses += 1
            if r.misses >= 4:
                r.paused_until, r.misses = self._steps + self.pause_steps, 0
        return offered

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Count a verification of `proposed` guesses. Every `window` verifications, a sequence
        that got under a quarter of its guesses accepted pauses, each poor run in a row twice as
        long as the last (so a draft that does not pay for this text costs a few tries, not one in
        every few steps); one that got half or more starts its backoff over."""
        r = self._records.setdefault(seq.seq_id, _Record())
        r.attempts += 1
        r.misses = 0
        r.proposed += proposed
        r.accepted += accepted
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        if r.attempts < self.window:
            return
        if r.accepted < 0.25 * r.proposed:
            r.paused_until = self._steps + (self.pause_steps << min(r.pauses, self.max_doublings))
            r.pauses += 1
        elif r.accepted >= 0.5 * r.proposed:
            r.pauses = 0
        r.attempts = r.proposed = r.accepted = 0

    def forget(self, seq: Sequence) -> None:
        self._records.pop(seq.seq_id, None)
        self.proposer.forget(seq.seq_id)


def make_speculator(
    kind: str | None,
    draft_model: GPT | None,
    num_tokens: int,
    max_batch: int,
    max_num_seqs: int,
    block_size: int,
) -> Speculator | None:
    """The engine's speculator: None, "ngram" (prompt lookup) or "draft" (needs draft_model)."""
    if kind is None:
        if draft_model is not None:
            raise ValueError('a draft model needs speculative="draft"')
        return None
    if num_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    if kind == "ngram":
        proposer: NgramProposer | DraftProposer = NgramProposer()
    elif kind == "draft":
        if draft_model is None:
            raise ValueError('speculative="draft" needs a draft model')
        proposer = DraftProposer(draft_model, max_num_seqs, block_size)
    else:
        raise ValueError(f'speculative must be "ngram" or "draft", not {kind!r}')
    return Speculator(proposer, num_tokens, max_batch)
