"""The KV block pool's bookkeeping: which blocks are free, who holds the rest, what they contain.

A block is in one of three states:
- free: nobody holds it and its contents mean nothing;
- held: one or more sequences hold it (`ref` counts them); a block held by more than one is
  shared (a common prompt prefix, or the prompt of n > 1 completions) and read only;
- cached: nobody holds it, but it is a full block whose contents are known by their key (the
  tokens in it and every token before them), so a later sequence with the same prefix can take it
  back instead of recomputing it.
Cached blocks count as free: `allocate` hands out free blocks first and then evicts cached ones,
least recently released first.

Free blocks go out earliest in `order` first, which keeps the blocks in use packed at the front
of the pool, so CPU decode attention can read them as one run, in place
(`kernels.cpu.decode`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class OutOfBlocks(RuntimeError):
    """The block pool cannot hold what was asked; nothing was allocated."""


class BlockAllocator:
    """Hands out, shares and takes back block ids; remembers full blocks by their content key."""

    def __init__(self, num_blocks: int, order: Sequence[int] | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        order = list(range(num_blocks)) if order is None else list(order)
        if sorted(order) != list(range(num_blocks)):
            raise ValueError("order must be a permutation of range(num_blocks)")
        self.num_blocks = num_blocks
        self._order = order
        self._rank = {block: rank for rank, block in enumerate(order)}
        self._free = list(range(num_blocks))  # ranks of free blocks, a min-heap
        self._ref: dict[int, int] = {}  # held blocks -> number of holders
        self._cached: OrderedDict[int, None] = OrderedDict()  # unheld keyed blocks, oldest first
        self._by_key: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones plus cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unheld blocks kept for their contents."""
        return len(self._cached)

    def ref(self, block: int) -> int:
        """How many sequences hold the block (0 if it is free or cached)."""
        return self._ref.get(block, 0)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each held once; free blocks first, then the least recently cached."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._order[heapq.heappop(self._free)]
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def hold(self, block: int) -> None:
        """One more holder for a held or cached block (a shared prefix, a fork)."""
        if block in self._cached:
            del self._cached[block]
            self._ref[block] = 0
        if block not in self._ref:
            raise ValueError(f"block {block} is free")
        self._ref[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each block; a block nobody holds is cached if keyed, else free."""
        for block in blocks:
            if block not in self._ref:
                raise ValueError(f"block {block} is not allocated")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                del self._ref[block]
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._free, self._rank[block])

    def lookup(self, key: Hashable) -> int | None:
        """The held or cached block whose contents have this key, if any."""
        return self._by_key.get(key)

    def set_key(self, block: int, key: Hashable) -> None:
        """Record that a held, full block's contents have `key` (the first block wins a key)."""
        if block not in self._ref:
            raise ValueError(f"block {block} is not held")
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key

    def audit(self, holders: Iterable[int]) -> None:
        """Check every invariant against `holders` (each table's blocks, one entry per hold)."""
        counts: dict[int, int] = {}
        for block in holders:
            counts[block] = counts.get(block, 0) + 1
        free = {self._order[rank] for rank in self._free}
        assert counts == self._ref, "reference counts differ from the block tables"
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & set(self._ref) and not free & set(self._cached), "a held block is free"
        assert not set(self._cached) & set(self._ref), "a held block is also cached"
        assert len(free) + len(self._ref) + len(self._cached) == self.num_blocks, "a block is lost"
        assert all(b in self._key_of for b in self._cached), "a cached block has no key"
        assert all(self._by_key[k] == b for b, k in self._key_of.items()), "the key index is torn"
