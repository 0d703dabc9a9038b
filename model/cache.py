"""The paged KV cache: per-layer pools of fixed-size blocks, an allocator, per-sequence block tables.

A sequence's keys and values live in blocks that need not be contiguous nor in order; its block
table lists them. Running out of blocks raises `OutOfBlocks` before anything is changed, so the
engine can preempt a sequence and retry; no sequence ever writes into another's blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import torch

from kernels.metadata import AttentionMetadata


class OutOfBlocks(RuntimeError):
    """The block pool cannot hold what was asked; nothing was allocated."""


class BlockAllocator:
    """Hands out and takes back block ids; the free block earliest in `order` goes out first.

    Handing out the earliest free block keeps the blocks in use packed at the front of the pool,
    so CPU decode attention can read them as one run, in place (`kernels.paged_decode_cpu`).
    """

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
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._order[heapq.heappop(self._free)] for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            heapq.heappush(self._free, self._rank[b])


class KVCache:
    """Key and value pools indexed (n_layer, num_blocks, block_size, n_head, head_dim).

    `k` and `v` have that shape, but each (block, head) is stored as one contiguous
    (block_size, head_dim) tile: `k.transpose(2, 3)` is contiguous. Kernels take strides, and CPU
    decode attention multiplies those tiles where they lie.
    """

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        block_order: Sequence[int] | None = None,
    ) -> None:
        stored = (n_layer, num_blocks, n_head, block_size, head_dim)
        self.k = torch.zeros(stored, device=device, dtype=dtype).transpose(2, 3)
        self.v = torch.zeros(stored, device=device, dtype=dtype).transpose(2, 3)
        self.block_size = block_size
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks, block_order)
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}

    @staticmethod
    def bytes_per_block(
        n_layer: int, n_head: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layer * block_size * n_head * head_dim * itemsize

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def seq_len(self, seq_id: int) -> int:
        return self._lens.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, []))

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Blocks that appending new_tokens to seq_id would take from the pool."""
        total = self.seq_len(seq_id) + new_tokens
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-total // self.block_size) - have)

    def free(self, seq_id: int) -> None:
        """Return all of a sequence's blocks to the pool (no-op for unknown ids)."""
        blocks = self._tables.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        if blocks:
            self.allocator.free(blocks)

    def fork(self, src: int, dst: int) -> None:
        """Give new sequence dst a copy of src's cached tokens, in blocks of its own."""
        if dst in self._tables:
            raise ValueError(f"sequence {dst} already has blocks")
        table = self._tables.get(src, [])
        blocks = self.allocator.allocate(len(table))
        if table:
            old = torch.tensor(table, device=self.device)
            new = torch.tensor(blocks, device=self.device)
            self.k[:, new] = self.k[:, old]
            self.v[:, new] = self.v[:, old]
        self._tables[dst] = blocks
        self._lens[dst] = self._lens.get(src, 0)

    def prepare(self, batch: Sequence[tuple[int, int]]) -> AttentionMetadata:
        """Reserve room for (seq_id, new_tokens) pairs and describe the step to attention.

        All or nothing: raises OutOfBlocks with the cache unchanged if the pool is too small.
        """
        needed = sum(self.blocks_needed(s, n) for s, n in batch)
        if needed > self.allocator.num_free:
            raise OutOfBlocks(f"batch needs {needed} KV blocks, {self.allocator.num_free} free")
        for seq_id, n_new in batch:
            table = self._tables.setdefault(seq_id, [])
            table.extend(self.allocator.allocate(self.blocks_needed(seq_id, n_new)))
            self._lens[seq_id] = self._lens.get(seq_id, 0) + n_new
        return AttentionMetadata.build(
            [self._tables[s] for s, _ in batch],
            [self._lens[s] for s, _ in batch],
            [n for _, n in batch],
            self.block_size,
            self.device,
        )

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new keys/values (N, H, D) of one layer at their slots."""
        where = (slot_mapping // self.block_size, slot_mapping % self.block_size)  # (block, offset)
        self.k[layer].index_put_(where, k.to(self.k.dtype))
        self.v[layer].index_put_(where, v.to(self.v.dtype))
