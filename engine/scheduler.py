"""Which sequences run in the next engine step, and how many of their tokens.

Every step: running sequences decode one token each; sequences still prefilling get chunks of
their prompt within a token budget; waiting sequences are admitted while there is room (sequence
slots, token budget, KV blocks). A sequence being admitted first takes whatever prefix of its
tokens the cache already holds (`KVCache.reuse_prefix`) and prefills only the rest. When the cache cannot hold the step, the newest running sequence
is preempted: its blocks are freed and it is requeued at the front, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_cache import KVCache
from engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    """The step's work: (sequence, number of new tokens) in packed order."""

    items: list[tuple[Sequence, int]]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_batch_tokens: int) -> None:
        if max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError("max_num_seqs and max_batch_tokens must be positive")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose cache is already filled (a fork of a finished prefill)."""
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> ScheduledBatch:
        preempted: list[Sequence] = []
        while True:
            items = self._plan()
            needed = sum(self.cache.blocks_needed(s.seq_id, n) for s, n in items)
            if needed <= self.cache.num_free_blocks:
                break
            if any(s.guesses for s in self.running):  # drop speculative guesses before anyone
                for s in self.running:
                    s.guesses = []
                continue
            if len(self.running) <= 1:
                break
            victim = self.running.pop()  # newest first
            self._preempt(victim)
            preempted.append(victim)
        if needed > self.cache.num_free_blocks:
            items = []  # a lone sequence that does not fit: the engine fails it
        self._admit(items)
        return ScheduledBatch(items, preempted)

    def _plan(self) -> list[tuple[Sequence, int]]:
        """Decodes first (one token each), then prefill chunks, within the token budget."""
        budget = self.max_batch_tokens
        items = []
        for seq in self.running:
            if seq.pending == 1 and not seq.guesses:
                items.append((seq, 1))
                budget -= 1
        for seq in self.running:  # decodes that verify guesses: their last token and the guesses
            if seq.pending == 1 and seq.guesses:
                n = min(1 + len(seq.guesses), max(budget, 1))
                seq.guesses = seq.guesses[: n - 1]
                items.append((seq, n))
                budget -= n
        for seq in self.running:
            if seq.pending > 1 and budget > 0:
                n = min(seq.pending, budget)
                items.append((seq, n))
                budget -= n
        return items

    def _admit(self, items: list[tuple[Sequence, int]]) -> None:
        """Move waiting sequences into the batch while slots, budget and blocks allow."""
        budget = self.max_batch_tokens - sum(n for _, n in items)
        reserved = sum(self.cache.blocks_needed(s.seq_id, n) for s, n in items)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs need every prompt position computed: such requests reuse nothing
            if not self.cache.holds(seq.seq_id) and seq.params.prompt_logprobs is None:
                salt = seq.params.cache_salt
                seq.num_cached = self.cache.reuse_prefix(seq.seq_id, seq.token_ids, salt)
            n = min(seq.pending, budget)
            need = self.cache.blocks_needed(seq.seq_id, n)
            free = self.cache.num_free_blocks - reserved  # reused blocks are no longer free
            # a block of headroom per running sequence, so an admission does not force preemption
            if need > free or (need + len(self.running) > free and self.running):
                self.cache.free(seq.seq_id)  # give back what it reused; it waits as it was
                seq.num_cached = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.num_generated == 0 and seq.params.prompt_logprobs is None:  # first admission
                seq.num_prefix_hit = seq.num_cached
                self.cache.count_prefix_query(seq.num_prompt, seq.num_cached)
            items.append((seq, n))
            budget -= n
            reserved += need

    def _preempt(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        seq.num_cached = 0
        seq.guesses = []
        self.waiting.appendleft(seq)
