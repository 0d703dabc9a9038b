"""The KV cache's bookkeeping: which blocks each sequence holds, and which prompts they cache.

A sequence's keys and values live in blocks that need not be contiguous nor in order; its block
table lists them. `BlockManager` keeps the tables, the allocator (`engine.block_pool`) and the
prefix index (`engine.prefix_index`); it is the scheduler's, and it never touches the pools'
memory (`kernels.paged_kv.KVPools`, the runner's): where a block's contents must be copied (a
copy on write, a partial prefix match) it records the copy, and the runner makes every copy a
step asked for before that step's forward (`take_copies`). Running out of blocks raises
`OutOfBlocks` before anything is changed, so the engine can preempt a sequence and retry.

Prefix caching: once a block is full, it is keyed by its tokens and every token before them
(`register_full_blocks`); when a sequence ends, its last, partly filled block is keyed by the
tokens it holds. A new sequence takes the longest run of keyed full blocks that matches its
prompt (`reuse_prefix`), then, token by token, the longest start of one more keyed block that
follows the same blocks (a conversation's next turn diverges from the last inside a block: where
the previous answer ended, or where its text re-tokenizes differently); that block is copied,
since the sequence writes its own tokens after the match. It computes only the rest. A
sequence's cache salt (`reuse_prefix`, `register_full_blocks`) keeps its blocks apart from those
of every other salt: see `engine.prefix_index`. Shared blocks are read only: a sequence writes
only into blocks it holds alone, and one that would write into a shared block (the last, partly
filled block of a prompt that n > 1 completions share) first gets a copy of its own.

Sliding windows: when every layer of the model attends within a window (`window`, the widest of
them; `kernels.window`), a sequence's blocks whose every token lies before the window of its next
token (all positions <= seq_len - window) are never read again, and are let go
(`release_out_of_window`, before each step is planned and prepared): back to the pool, or, when
keyed, cached for their contents as any released block is. Their table entries stay, as
`RELEASED`, so every block keeps its place in the table; a step's metadata names block 0 there,
and attention never reads those entries (it reads the tables trimmed to each layer's window).
Released entries are never keyed, held, copied or freed again. Where some layer is global
(`window` None), nothing is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gptserve.engine.block_pool import BlockAllocator, OutOfBlocks
from gptserve.engine.prefix_index import PrefixIndex, Salt, salt_root
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.window import skipped_blocks

__all__ = ["RELEASED", "BlockAllocator", "BlockManager", "OutOfBlocks", "StepBlocks"]

RELEASED = -1  # a table entry whose block was let go: out of every layer's window


@dataclass(frozen=True)
class StepBlocks:
    """What a step's forward needs of the bookkeeping: its attention metadata, and the block
    copies (source, destination) to make before it."""

    meta: AttentionMetadata
    copies: list[tuple[int, int]]


class BlockManager:
    """Block tables of the sequences, over a pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        block_order: Sequence[int] | None = None,
        prefix_caching: bool = True,
        window: int | None = None,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be positive or None, got {window}")
        self.device = torch.device(device)  # where a step's metadata goes
        self.block_size = block_size
        # every layer's window fits in this many tokens (None: some layer is global, or there
        # are no windows): blocks before it are released
        self.window = window
        self._released: dict[int, int] = {}  # seq_id -> leading table entries released
        self.allocator = BlockAllocator(num_blocks, block_order)
        self.prefix_caching = prefix_caching
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self.index = PrefixIndex(self.allocator, block_size)
        self._copies: list[tuple[int, int]] = []  # (source, destination) for the next step

    @property
    def prefix_queried_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache."""
        return self.index.queried_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        """Of those, tokens found there."""
        return self.index.hit_tokens

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def seq_len(self, seq_id: int) -> int:
        return self._lens.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in order; `RELEASED` where one was let go (`window`)."""
        return list(self._tables.get(seq_id, []))

    def num_released(self, seq_id: int) -> int:
        """Leading blocks of the sequence let go as out of every layer's window."""
        return self._released.get(seq_id, 0)

    def release_out_of_window(self, seq_id: int) -> int:
        """Let go of the sequence's blocks that no layer's window will read again: every token
        in them at or before seq_len - window (its next token, at position seq_len, sees keys
        after seq_len - window; the block the next token goes to is never one of them). Returns
        how many were released now; none without a `window`."""
        table = self._tables.get(seq_id)
        if self.window is None or not table:
            return 0
        # the blocks attention's trim_to_window skips for the next token (one query at seq_len)
        next_len = self.seq_len(seq_id) + 1
        dead = min(len(table), skipped_blocks(next_len, 1, self.window, self.block_size))
        done = self._released.get(seq_id, 0)
        if dead <= done:
            return 0
        gone = table[done:dead]
        table[done:dead] = [RELEASED] * (dead - done)
        self._released[seq_id] = dead
        self.allocator.free(reversed(gone))  # keyed ones stay cached, by their contents
        return dead - done

    def holds(self, seq_id: int) -> bool:
        """Whether the cache has a block table for this sequence."""
        return seq_id in self._tables

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Blocks that appending new_tokens to seq_id would take from the pool."""
        length = self.seq_len(seq_id)
        table = self._tables.get(seq_id, ())
        fresh = max(0, -(-(length + new_tokens) // self.block_size) - len(table))
        return fresh + int(new_tokens > 0 and self._shared_tail(seq_id) is not None)

    def _shared_tail(self, seq_id: int) -> int | None:
        """The index in seq_id's table of the partly filled block it shares, if it has one."""
        length, table = self.seq_len(seq_id), self._tables.get(seq_id, ())
        i = length // self.block_size
        if length % self.block_size and self.allocator.ref(table[i]) > 1:
            return i
        return None

    def free(self, seq_id: int) -> None:
        """Let go of all of a sequence's blocks (no-op for unknown ids). A partly filled last
        block that nobody else holds stays cached, keyed by the tokens it holds."""
        if seq_id in self._tables:
            self.index.key_tail(seq_id, self._tables[seq_id], self.seq_len(seq_id))
        blocks = self._tables.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        done = self._released.pop(seq_id, 0)
        self.index.drop(seq_id)
        if blocks:  # last blocks first: they go out of the cache before the ones they extend
            self.allocator.free(reversed(blocks[done:]))

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only the sequence's first `length` tokens (rejected speculative tokens go)."""
        if length > self.seq_len(seq_id):
            raise ValueError(f"sequence {seq_id} has {self.seq_len(seq_id)} tokens, not {length}")
        table = self._tables[seq_id]
        keep = -(-length // self.block_size)
        if keep < self._released.get(seq_id, 0):
            raise ValueError(f"sequence {seq_id} released the blocks before token {length}")
        self.allocator.free(reversed(table[keep:]))
        del table[keep:]
        self._lens[seq_id] = length
        self.index.truncate(seq_id, length)

    def fork(self, src: int, dst: int) -> None:
        """Give new sequence dst src's cached tokens: it shares src's blocks (copied on write)."""
        if dst in self._tables:
            raise ValueError(f"sequence {dst} already has blocks")
        table = self._tables.get(src, [])
        done = self._released.get(src, 0)
        for block in table[done:]:
            self.allocator.hold(block)
        self._tables[dst] = list(table)
        self._lens[dst] = self._lens.get(src, 0)
        if done:
            self._released[dst] = done
        self.index.fork(src, dst)

    def reuse_prefix(self, seq_id: int, token_ids: Sequence[int], salt: Salt = None) -> int:
        """Give a sequence with no blocks the cached blocks that match its tokens' prefix: whole
        blocks, then a copy of the keyed block after them that matches the most tokens. A
        salted sequence matches only blocks that sequences with the same salt computed.

        Returns how many tokens are now cached for it, always fewer than len(token_ids), so at
        least one token is left to compute (it gives the logits).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        root = salt_root(salt)
        keys, blocks = self.index.match_full_blocks(token_ids, root)
        for block in blocks:
            self.allocator.hold(block)
        start = len(blocks) * bs
        rest = token_ids[start : min(start + bs, len(token_ids) - 1)]
        partial = self._partial_match(keys[-1] if keys else root, rest)
        if partial is not None:
            blocks.append(partial[0])
        self._tables[seq_id] = blocks
        self._lens[seq_id] = start + (partial[1] if partial else 0)
        self.index.adopt(seq_id, keys, root)
        return self._lens[seq_id]

    def _partial_match(self, parent: bytes | None, tokens: Sequence[int]) -> tuple[int, int] | None:
        """A copy of the keyed block after `parent` whose tokens start most like `tokens`, and
        how many of them match; None when none matches a token or no block is free for the copy."""
        found = self.index.best_partial(parent, tokens)
        if found is None:
            return None
        best, matched = found
        self.allocator.hold(best)  # so allocating the copy cannot evict it
        try:
            if self.allocator.num_free < 1:
                return None
            (copy,) = self.allocator.allocate(1)
            self._copies.append((best, copy))
        finally:
            self.allocator.free([best])
        return copy, matched

    def count_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted prompt's lookup in the prefix cache (for /metrics)."""
        if self.prefix_caching:
            self.index.count_query(num_tokens, num_hit)

    def register_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], salt: Salt = None
    ) -> None:
        """Key the sequence's newly filled blocks (its first seq_len tokens are token_ids')
        under its cache salt (the one it gives `reuse_prefix`)."""
        if not self.prefix_caching:
            return
        table, length = self._tables.get(seq_id, []), self.seq_len(seq_id)
        self.index.register(
            seq_id, table, length, token_ids, salt_root(salt), self._released.get(seq_id, 0)
        )

    def audit(self) -> None:
        """Assert the pool's invariants (reference counts match the tables; see BlockAllocator)."""
        self.allocator.audit(b for table in self._tables.values() for b in table if b != RELEASED)
        for seq_id, table in self._tables.items():
            assert len(table) == -(-self.seq_len(seq_id) // self.block_size), "a table is torn"
            done = self._released.get(seq_id, 0)
            assert all(b == RELEASED for b in table[:done]), "a released entry names a block"
            assert RELEASED not in table[done:], "a block was released out of order"

    def prepare(self, batch: Sequence[tuple[int, int]]) -> StepBlocks:
        """Reserve room for (seq_id, new_tokens) pairs and describe the step to attention, with
        the block copies the step needs first (these and every copy asked for since the last
        step). All or nothing: raises OutOfBlocks (the pool is too small) or ValueError (a
        sequence with no new token) with the tables unchanged. A sequence about to write into a
        block it shares gets its own copy of that block first."""
        if any(n < 1 for _, n in batch):
            raise ValueError("every sequence of a step needs at least one new token")
        needed = sum(self.blocks_needed(s, n) for s, n in batch)
        if needed > self.allocator.num_free:
            raise OutOfBlocks(f"batch needs {needed} KV blocks, {self.allocator.num_free} free")
        for seq_id, _ in batch:  # (before the step's tokens: its next token's window)
            self.release_out_of_window(seq_id)
        for seq_id, n_new in batch:
            table = self._tables.setdefault(seq_id, [])
            shared = self._shared_tail(seq_id) if n_new else None
            if shared is not None:
                self._copy_on_write(table, shared)
            table.extend(self.allocator.allocate(self.blocks_needed(seq_id, n_new)))
            self._lens[seq_id] = self._lens.get(seq_id, 0) + n_new
        meta = AttentionMetadata.build(
            [self._step_table(s) for s, _ in batch],
            [self._lens[s] for s, _ in batch],
            [n for _, n in batch],
            self.block_size,
            self.device,
        )
        return StepBlocks(meta, self.take_copies())

    def _step_table(self, seq_id: int) -> list[int]:
        """The sequence's table as a step's metadata gets it: block 0 for released entries
        (never read: attention reads only the blocks of each layer's window)."""
        table, done = self._tables[seq_id], self._released.get(seq_id, 0)
        return table if not done else [0] * done + table[done:]

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies asked for since they were last taken, in order (and forgets them)."""
        copies, self._copies = self._copies, []
        return copies

    def _copy_on_write(self, table: list[int], i: int) -> None:
        """Replace shared block table[i] by a copy held by this table alone."""
        (block,) = self.allocator.allocate(1)
        self._copies.append((table[i], block))
        self.allocator.free([table[i]])
        table[i] = block
