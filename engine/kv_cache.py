"""The paged KV cache: per-layer pools of fixed-size blocks, an allocator, per-sequence block tables.

A sequence's keys and values live in blocks that need not be contiguous nor in order; its block
table lists them. Running out of blocks raises `OutOfBlocks` before anything is changed, so the
engine can preempt a sequence and retry.

Prefix caching (the keys live in `engine.prefix_index`): once a block is full, it is keyed by
its tokens and every token before them (`register_full_blocks`); when a sequence ends, its last, partly filled block is keyed by the
tokens it holds. A new sequence takes the longest run of keyed full blocks that matches its
prompt (`reuse_prefix`), then, token by token, the longest start of one more keyed block that
follows the same blocks (a conversation's next turn diverges from the last inside a block: where
the previous answer ended, or where its text re-tokenizes differently); that block is copied,
since the sequence writes its own tokens after the match. It computes only the rest. A
sequence's cache salt (`reuse_prefix`, `register_full_blocks`) keeps its blocks apart from those
of every other salt: see `engine.prefix_index`. Shared
blocks are read only: a sequence writes only into blocks it holds alone, and one that would
write into a shared block (the last, partly filled block of a prompt that n > 1 completions
share) first gets a copy of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.block_pool import BlockAllocator, OutOfBlocks
from engine.prefix_index import PrefixIndex, salt_root
from kernels.backends import (
    NARROWER_POOLS,
    AttentionBackend,
    KVSpec,
    select_attention_backend,
)
from kernels.metadata import AttentionMetadata, AttentionPlan, KVWrite

__all__ = ["BlockAllocator", "KVCache", "OutOfBlocks", "cache_dtype"]


def cache_dtype(model_dtype: torch.dtype, asked: torch.dtype | None) -> torch.dtype:
    """The KV cache's dtype for a model computing in `model_dtype`: `asked`, or the model's own
    where None. A cache is the model's dtype or, under a float32 model, float16 or bfloat16;
    raises ValueError for any other (a cache wider than its model, or of another 16-bit kind)."""
    if asked is None or asked == model_dtype:
        return model_dtype
    if model_dtype == torch.float32 and asked in NARROWER_POOLS:
        return asked
    name = str(model_dtype).removeprefix("torch.")
    raise ValueError(
        f"--kv-cache-dtype {str(asked).removeprefix('torch.')} does not go with a {name} model: "
        f"the cache is the model's dtype ({name}) or, under a float32 model, float16 or bfloat16"
    )


class KVCache:
    """Key and value pools indexed (n_layer, num_blocks, block_size, n_kv_head, head_dim).

    `k` and `v` have that shape whatever their layout in memory, which is the attention backend's
    (`kernels.backends`): chosen once here, from the device and dtype unless one is given. A
    step's attention goes through it: `plan(meta)` once, then `attend(layer, ...)` per layer.
    The pools hold the model's key/value heads only: with grouped-query attention, `group`
    query heads read each of them (`kernels.gqa`).
    """

    def __init__(
        self,
        n_layer: int,
        n_kv_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        block_order: Sequence[int] | None = None,
        prefix_caching: bool = True,
        backend: AttentionBackend | None = None,
        group: int = 1,
        batch_invariant: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.spec = KVSpec(
            n_layer, num_blocks, block_size, n_kv_head, head_dim, dtype, self.device, group
        )
        self.backend = backend or select_attention_backend(self.device, dtype, batch_invariant)
        self.k, self.v = self.backend.allocate(self.spec)
        # each layer's pools as views made once: indexing self.k per layer and step costs more
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, block_order)
        self.prefix_caching = prefix_caching
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self.index = PrefixIndex(self.allocator, block_size)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        block_order: Sequence[int] | None = None,
        prefix_caching: bool = True,
        backend: AttentionBackend | None = None,
        batch_invariant: bool = False,
    ) -> KVCache:
        """A cache shaped for `model` (its config's layers and key/value heads), on its device
        and dtype."""
        p = next(model.parameters())
        c = model.config
        return cls(
            c.n_layer, c.kv_heads, c.head_dim, num_blocks, block_size,
            device=device or p.device, dtype=dtype or p.dtype,
            block_order=block_order, prefix_caching=prefix_caching, backend=backend,
            group=c.n_head // c.kv_heads, batch_invariant=batch_invariant,
        )  # fmt: skip

    @staticmethod
    def bytes_per_block(
        n_layer: int, n_kv_head: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Key and value bytes of one block over all layers, `n_kv_head` heads a slot."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layer * block_size * n_kv_head * head_dim * itemsize

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes one cached token takes over all layers."""
        return self.spec.bytes_per_token

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
        return list(self._tables.get(seq_id, []))

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
        self.index.drop(seq_id)
        if blocks:  # last blocks first: they go out of the cache before the ones they extend
            self.allocator.free(reversed(blocks))

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only the sequence's first `length` tokens (rejected speculative tokens go)."""
        if length > self.seq_len(seq_id):
            raise ValueError(f"sequence {seq_id} has {self.seq_len(seq_id)} tokens, not {length}")
        table = self._tables[seq_id]
        keep = -(-length // self.block_size)
        self.allocator.free(reversed(table[keep:]))
        del table[keep:]
        self._lens[seq_id] = length
        self.index.truncate(seq_id, length)

    def fork(self, src: int, dst: int) -> None:
        """Give new sequence dst src's cached tokens: it shares src's blocks (copied on write)."""
        if dst in self._tables:
            raise ValueError(f"sequence {dst} already has blocks")
        table = self._tables.get(src, [])
        for block in table:
            self.allocator.hold(block)
        self._tables[dst] = list(table)
        self._lens[dst] = self._lens.get(src, 0)
        self.index.fork(src, dst)

    def reuse_prefix(self, seq_id: int, token_ids: Sequence[int], salt: str | None = None) -> int:
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
            self.k[:, copy] = self.k[:, best]
            self.v[:, copy] = self.v[:, best]
        finally:
            self.allocator.free([best])
        return copy, matched

    def count_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted prompt's lookup in the prefix cache (for /metrics)."""
        if self.prefix_caching:
            self.index.count_query(num_tokens, num_hit)

    def register_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], salt: str | None = None
    ) -> None:
        """Key the sequence's newly filled blocks (its first seq_len tokens are token_ids')
        under its cache salt (the one it gives `reuse_prefix`)."""
        if not self.prefix_caching:
            return
        table, length = self._tables.get(seq_id, []), self.seq_len(seq_id)
        self.index.register(seq_id, table, length, token_ids, salt_root(salt))

    def audit(self) -> None:
        """Assert the pool's invariants (reference counts match the tables; see BlockAllocator)."""
        self.allocator.audit(b for table in self._tables.values() for b in table)
        for seq_id, table in self._tables.items():
            assert len(table) == -(-self.seq_len(seq_id) // self.block_size), "a table is torn"

    def prepare(self, batch: Sequence[tuple[int, int]]) -> AttentionMetadata:
        """Reserve room for (seq_id, new_tokens) pairs and describe the step to attention.

        All or nothing: raises OutOfBlocks (the pool is too small) or ValueError (a sequence with no
        new token) with the cache unchanged. A sequence about to write into a block it shares gets its own copy of that block first.
        """
        if any(n < 1 for _, n in batch):
            raise ValueError("every sequence of a step needs at least one new token")
        needed = sum(self.blocks_needed(s, n) for s, n in batch)
        if needed > self.allocator.num_free:
            raise OutOfBlocks(f"batch needs {needed} KV blocks, {self.allocator.num_free} free")
        for seq_id, n_new in batch:
            table = self._tables.setdefault(seq_id, [])
            shared = self._shared_tail(seq_id) if n_new else None
            if shared is not None:
                self._copy_on_write(table, shared)
            table.extend(self.allocator.allocate(self.blocks_needed(seq_id, n_new)))
            self._lens[seq_id] = self._lens.get(seq_id, 0) + n_new
        return AttentionMetadata.build(
            [self._tables[s] for s, _ in batch],
            [self._lens[s] for s, _ in batch],
            [n for _, n in batch],
            self.block_size,
            self.device,
        )

    def _copy_on_write(self, table: list[int], i: int) -> None:
        """Replace shared block table[i] by a copy held by this table alone."""
        (block,) = self.allocator.allocate(1)
        self.k[:, block] = self.k[:, table[i]]
        self.v[:, block] = self.v[:, table[i]]
        self.allocator.free([table[i]])
        table[i] = block

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        """The backend's plan of the step `meta` describes, for every layer's `attend`."""
        return self.backend.plan(meta, self.spec)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """Store one layer's new keys/values (N, H_kv, D) at the step's slots, then attend the
        new tokens' queries (N, H, D) over their sequences' cache: (N, H, D)."""
        return self.backend.forward(q, k, v, *self._layers[layer], plan)

    def attend_qkv(
        self, layer: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
        plan: AttentionPlan, n_head: int, out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """A whole decode step of one layer from its q/k/v product (N, (H + 2 H_kv) * D) and
        rotary cos, sin (N, 1, D) (None: no rotary positions): the rotation, the writes and the
        attention, (N, H, D) in `out_dtype` (None: qkv's); None where the backend has no such
        path for this step."""
        cos, sin = rope if rope is not None else (None, None)
        return self.backend.forward_qkv(
            qkv, cos, sin, *self._layers[layer], plan, n_head, out_dtype
        )

    def one_call_step(self, layer: int, plan: AttentionPlan) -> tuple[torch.Tensor, ...] | None:
        """One layer's pools and this step's slots, tables and context lengths, as the compiled
        one-call decode takes them (`model.cpu.decode_layer`); None where the backend has no such
        path for this step."""
        return self.backend.one_call_step(*self._layers[layer], plan)

    def write(self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new keys/values (N, H_kv, D) at the step's slots
        (`meta.slot_mapping`)."""
        at = KVWrite.of(meta, self.block_size)
        self.backend.write(*self._layers[layer], k, v, at)
