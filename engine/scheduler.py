"""Which sequences run in the next engine step, and how many of their tokens.

Every step: running sequences decode one token each; sequences still prefilling get chunks of
their prompt within a token budget; waiting sequences are admitted while there is room (sequence
slots, token budget, KV blocks). A sequence being admitted first takes whatever prefix of its
tokens the cache already holds (`BlockManager.reuse_prefix`) and prefills only the rest. A decoding
sequence offered guesses (speculative decoding) verifies them as a chunk of 1 + k tokens, trimmed
to the budget. When the cache cannot hold the step, every guess is dropped first; then the newest
running sequence is preempted: its blocks are freed and it is requeued at the front, to be
recomputed later. The answer is a `StepPlan`.

Fair to every sender (`SamplingParams.tenant`, an API key's), so that one sender's large request
cannot hold another's first token:
- waiting sequences are admitted tenant by tenant in turn, the tenant with the fewest running
  sequences first (first come, first served within a tenant);
- a sequence that does not fit the cache yet lets those behind it that fit go ahead, at most
  MAX_PASSED_OVER times: then nothing goes ahead of it until it fits;
- running prompts are prefilled shortest first, and while a tenant with nothing running waits,
  they leave it at least NEWCOMER_SHARE of the step's token budget;
- while another tenant's sequences decode (or wait for their first token), the other tenants'
  prompts take at most SHARED_STEP_PREFILL tokens between them in a step, and only as often as
  the time they add allows: the engine reports each step's seconds (`record_step`), and a step
  with such a chunk runs up a debt of its time beyond a decode step's, which the decode-only
  steps after it pay back at (STREAM_SLOWDOWN - 1) times their own time. The decodes' time per
  token so stays within about STREAM_SLOWDOWN times their own, however costly the chunks are
  (a chunk deep into a long prompt attends to all of it). One tenant alone (or no API keys)
  keeps the whole budget.
- with API keys (any tenant set), a step's prompt chunks are bounded by their cost, not only
  their count: `tenant_step_tokens` tokens' worth, a token deep into its prompt counting as
  1 + position / KEYS_PER_TOKEN_COST (it attends to every key before it). A step already
  running cannot be cut short, so this bounds how long another key's first token waits for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from gptserve.engine.block_manager import BlockManager
from gptserve.engine.sequence import Sequence
from gptserve.engine.step_plan import StepPlan

# (sequence, new tokens, guesses it verifies) in packed order: a plan before it is classified
_Work = list[tuple[Sequence, int, list[int]]]
MAX_PASSED_OVER = 64  # admissions that may go ahead of a waiting sequence that does not fit
NEWCOMER_SHARE = 0.5  # of a step's token budget, kept for a waiting tenant with nothing running
# prompt tokens a step gives other tenants while a tenant's sequences decode: on a CPU a few
# rows cost about what one does, so the decodes keep their pace (bench/fairness.py) and the
# prompt, computed at about the rate of a large chunk, still moves
SHARED_STEP_PREFILL = 8
# ... in steps spaced so that the decodes' time per token stays within this many times its own
STREAM_SLOWDOWN = 1.5
# with API keys, a step's prompt chunks cost at most this many prompt tokens at the start of a
# prompt by default (about 0.1 s for the default model on 2 cores), fewer deeper in (a token
# counting 1 + its position / KEYS_PER_TOKEN_COST): docs/BENCHMARKS.md, "Fair admission"
TENANT_STEP_PREFILL = 128
# the default model on a CPU: a token 7000 keys deep costs about 4x its products, so 2048 would
# cost steps truly; each step also copies its prompts' keys once, so chunks sized by 4096 keep a
# lone key's 8000-token prompt near its speed without keys (steps of at most about 0.3 s)
KEYS_PER_TOKEN_COST = 4096
DECODE_TIME_WEIGHT = 0.2  # of a new decode-only step's seconds in their running average


class Scheduler:
    """Plans each step over the KV cache's block bookkeeping, which it owns."""

    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int,
        tenant_step_tokens: int = TENANT_STEP_PREFILL,
    ) -> None:  # fmt: skip
        """tenant_step_tokens: the cost bound of a step's prompt chunks with API keys (0: none,
        the whole max_batch_tokens as without keys)."""
        if max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError("max_num_seqs and max_batch_tokens must be positive")
        if tenant_step_tokens < 0:
            raise ValueError("tenant_step_tokens must be >= 0")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.tenant_step_tokens = tenant_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._decoding: set[str | None] = set()  # tenants with a sequence decoding this step
        self._newcomers: set[str | None] = set()  # tenants waiting with nothing running
        self._shared_left = SHARED_STEP_PREFILL  # prompt tokens left beside their decodes
        # seconds of decode time the last prompt turns still owe; a turn waits until it is paid
        self._turn_debt = 0.0
        self._decode_seconds: float | None = None  # a decode-only step's, averaged
        self._held = False  # the planned step held back another tenant's prompt (debt unpaid)
        self._work_left = float(tenant_step_tokens)  # tenants' prompt cost left in the step

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
        self.blocks.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, guesses: Mapping[int, list[int]] | None = None) -> StepPlan:
        """The next step's plan; guesses maps a decoding sequence's seq_id to tokens to verify.

        Preempted sequences have their blocks freed before this returns. A plan with nothing
        scheduled means a lone running sequence does not fit the cache: the engine fails it.
        """
        guesses = guesses or {}
        preempted: list[Sequence] = []
        for seq in self.running:  # blocks out of every layer's window go back first
            self.blocks.release_out_of_window(seq.seq_id)
        while True:
            work = self._plan(guesses)
            needed = sum(self.blocks.blocks_needed(s.seq_id, n) for s, n, _ in work)
            if needed <= self.blocks.num_free_blocks:
                break
            if any(g for _, _, g in work):  # drop speculative guesses before anyone
                guesses = {}
                continue
            if len(self.running) <= 1:
                break
            victim = self.running.pop()  # newest first
            self._preempt(victim)
            preempted.append(victim)
        if needed > self.blocks.num_free_blocks:
            work = []  # a lone sequence that does not fit: the engine fails it
        self._admit(work)
        return StepPlan.build(work, preempted)

    def _plan(self, guesses: Mapping[int, list[int]]) -> _Work:
        """Decodes first (one token each, grouped by LoRA adapter), then verifications, then
        prefill chunks, within the token budget; a verification's guesses are cut to what the
        budget leaves."""
        budget = self.max_batch_tokens
        work: _Work = []
        # decodes grouped by LoRA adapter (in running order within each): an adapter's rows are
        # then one run of the step's rows, which its products take as views (model.lora.batched)
        for seq in sorted(self.running, key=_lora_slot):
            if seq.pending == 1 and not guesses.get(seq.seq_id):
                work.append((seq, 1, []))
                budget -= 1
        for seq in self.running:  # decodes that verify guesses: their last token and the guesses
            if seq.pending == 1 and (offered := guesses.get(seq.seq_id)):
                n = min(1 + len(offered), max(budget, 1))
                work.append((seq, n, list(offered[: n - 1])))
                budget -= n
        # prompts being prefilled, shortest first, leaving a share to tenants that wait with
        # nothing running (they are admitted after this plan, from what budget is left)
        prefill = budget - self._newcomers_share()
        # prompts give way to the tenants whose next tokens wait on this step: those decoding,
        # and those waiting with nothing running (their first token; they give way to decodes)
        running = {s.params.tenant for s in self.running}
        self._newcomers = {s.params.tenant for s in self.waiting if s.params.tenant not in running}
        self._decoding = {s.params.tenant for s in self.running if s.pending == 1}
        self._shared_left, self._held = SHARED_STEP_PREFILL, False
        self._work_left = float(self.tenant_step_tokens)  # tenants' prompt cost left in the step
        for seq in sorted((s for s in self.running if s.pending > 1), key=_pending):
            n = min(seq.pending, prefill, self._chunk_cap(seq))
            if n > 0:
                work.append((seq, n, []))
                budget, prefill = budget - n, prefill - n
                self._take_shared(seq, n)
        return work

    def record_step(self, seconds: float) -> None:
        """The engine's report of how long the step last planned took: a step that gave other
        tenants' prompts their turn beside decodes adds its time beyond a decode step's to the
        debt; a step that held them back pays it off at (STREAM_SLOWDOWN - 1) times its time."""
        if self._shared_left < SHARED_STEP_PREFILL:  # a turn: capped prompt tokens ran
            self._turn_debt += max(0.0, seconds - (self._decode_seconds or 0.0))
        elif self._held:
            self._turn_debt = max(0.0, self._turn_debt - (STREAM_SLOWDOWN - 1) * seconds)
            last = self._decode_seconds
            self._decode_seconds = seconds if last is None else (
                last + DECODE_TIME_WEIGHT * (seconds - last)
            )  # fmt: skip

    def _capped(self, seq: Sequence) -> bool:
        """Whether another tenant's next tokens wait on this step beside `seq`'s prompt."""
        tenant = seq.params.tenant
        if self._decoding - {tenant}:
            return True
        return tenant not in self._newcomers and bool(self._newcomers - {tenant})

    def _chunk_cap(self, seq: Sequence) -> int:
        """The most prompt tokens `seq` may take this step: while another tenant's sequences
        decode, what is left of the step's SHARED_STEP_PREFILL (big chunks would stretch every
        one of their tokens to the chunk's time), else the budget; with API keys, no more than
        the step's prompt cost left allows."""
        bounded = seq.params.tenant is not None and self.tenant_step_tokens
        cap = self._work_cap(seq) if bounded else self.max_batch_tokens
        if not self._capped(seq):
            return cap
        # their turn comes once the last turns' time is paid off: the steps between decode alone,
        # on the one-call decode layers (a step with a prompt chunk is several times one without)
        if self._turn_debt > 0:
            self._held = True
            return 0
        return min(cap, self._shared_left)

    def _work_cap(self, seq: Sequence) -> int:
        """Prompt tokens of `seq` that the step's tenant_step_tokens cost left pays for, at
        least one while none has been spent (a prompt always moves)."""
        n = int(self._work_left / _token_cost(seq))
        return max(n, 1) if self._work_left == self.tenant_step_tokens else n

    def _take_shared(self, seq: Sequence, n: int) -> None:
        if seq.params.tenant is not None:
            self._work_left -= n * _token_cost(seq)
        if self._capped(seq):
            self._shared_left -= n

    def _newcomers_share(self) -> int:
        """Tokens of the step kept for the first chunks of tenants that wait with nothing running."""
        running = {s.params.tenant for s in self.running}
        waiting = sum(s.pending for s in self.waiting if s.params.tenant not in running)
        return min(waiting, int(self.max_batch_tokens * NEWCOMER_SHARE))

    def _fair_order(self) -> list[Sequence]:
        """The waiting sequences in the order they are offered admission: tenants in turn, the
        tenant with the fewest running sequences (then the longest waiting) first; within a
        tenant, first come first served (a preempted sequence is back at its front)."""
        queues: dict[str | None, list[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.params.tenant, []).append(seq)
        if len(queues) == 1:
            return list(self.waiting)
        running: dict[str | None, int] = {}
        for seq in self.running:
            running[seq.params.tenant] = running.get(seq.params.tenant, 0) + 1
        turns = sorted(queues.values(), key=lambda q: running.get(q[0].params.tenant, 0))
        order: list[Sequence] = []
        for i in range(max(map(len, turns))):
            order.extend(q[i] for q in turns if i < len(q))
        return order

    def _admit(self, work: _Work) -> None:
        """Move waiting sequences into the batch while slots, budget and blocks allow."""
        budget = self.max_batch_tokens - sum(n for _, n, _ in work)
        reserved = sum(self.blocks.blocks_needed(s.seq_id, n) for s, n, _ in work)
        stuck: list[Sequence] = []  # offered admission, but the cache has no room for them yet
        for seq in self._fair_order() if self.waiting else ():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if any(s.passed_over >= MAX_PASSED_OVER for s in stuck):
                break  # it has waited long enough: nothing more goes ahead of it
            reuses = _reuses_prefix(seq)
            if not self.blocks.holds(seq.seq_id) and reuses:
                salt = seq.prefix_salt
                seq.num_cached = self.blocks.reuse_prefix(seq.seq_id, seq.token_ids, salt)
            n = min(seq.pending, budget, self._chunk_cap(seq))
            if n <= 0:  # this step's tokens beside another tenant's decodes are taken
                continue
            need = self.blocks.blocks_needed(seq.seq_id, n)
            free = self.blocks.num_free_blocks - reserved  # reused blocks are no longer free
            # a block of headroom per running sequence, so an admission does not force preemption
            if need > free or (need + len(self.running) > free and self.running):
                self.blocks.free(seq.seq_id)  # give back what it reused; it waits as it was
                seq.num_cached = 0
                stuck.append(seq)
                continue
            for s in stuck:
                s.passed_over += 1
            seq.passed_over = 0
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.scheduled_at is None:  # its queue wait ends (the server's traces report it)
                seq.scheduled_at = time.perf_counter()
            if seq.num_generated == 0 and reuses:  # first admission
                seq.num_prefix_hit = seq.num_cached
                self.blocks.count_prefix_query(seq.num_prompt, seq.num_cached)
            work.append((seq, n, []))
            budget -= n
            reserved += need
            self._take_shared(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        seq.num_cached = 0
        self.waiting.appendleft(seq)


def _token_cost(seq: Sequence) -> float:
    """What each of `seq`'s next prompt tokens costs, in tokens at a prompt's start: it attends
    to every key before it."""
    return 1.0 + seq.num_cached / KEYS_PER_TOKEN_COST


def _lora_slot(seq: Sequence) -> int:
    return seq.lora_slot


def _pending(seq: Sequence) -> int:
    return seq.pending


def _reuses_prefix(seq: Sequence) -> bool:
    """Whether a sequence may start from cached prefix blocks. Prompt logprobs need every prompt
    position computed, and so does an embedding (its pooling reads every position's hidden
    state, or, for last pooling, is kept independent of what others cached): those reuse nothing."""
    return seq.params.prompt_logprobs is None and seq.params.pooling is None
