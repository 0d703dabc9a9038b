"""One engine step's attention metadata, and what a backend derives from it for every layer.

The KV cache builds one `AttentionMetadata` per step (`engine.block_manager.BlockManager.prepare`): the
packed batch as every paged-attention backend reads it. The model asks the cache for the step's
plan once (`PagedKV.plan`): its backend turns the metadata into a typed `AttentionPlan` (which
blocks to read, masks, splits, where the new keys go) that every layer of the step then reads.
Nothing is global and nothing is cached on the metadata, so two engines in one process, or two
threads, never see each other's plans.

The lengths are also kept on the host (`seq_lens`, `query_lens`), so no backend has to read a
device tensor back to learn how many decodes lead the batch or how long the longest context is.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """The new tokens of B sequences packed one after another (N tokens in all).

    positions: (N,) int64 absolute position of each new token.
    slot_mapping: (N,) int64 pool slot (block * block_size + offset) each new token is written to.
    block_tables: (B, max_blocks) int32 pool blocks of each sequence in order, padded with 0.
    context_lens: (B,) int32 tokens of each sequence including the new ones.
    query_start: (B + 1,) int32 offset of each sequence's first new token in the packed batch.
    seq_lens, query_lens: context_lens and the new tokens per sequence, on the host.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @cached_property
    def num_decodes(self) -> int:
        """The leading sequences that have exactly one new token (the scheduler puts decodes first)."""
        return next((i for i, n in enumerate(self.query_lens) if n != 1), len(self.query_lens))

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @cached_property
    def max_context_len(self) -> int:
        return max(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token."""
        return self.num_decodes == self.num_seqs

    @property
    def last_token_index(self) -> torch.Tensor:
        """(B,) index of each sequence's last new token in the packed batch."""
        return self.query_start[1:].long() - 1

    def split(self, n: int) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The first n sequences and the rest, each as metadata of its own (tokens re-based)."""
        t = sum(self.query_lens[:n])
        starts = self.query_start
        head = AttentionMetadata(
            self.positions[:t], self.slot_mapping[:t], self.block_tables[:n],
            self.context_lens[:n], starts[: n + 1], self.seq_lens[:n], self.query_lens[:n],
        )  # fmt: skip
        tail = AttentionMetadata(
            self.positions[t:], self.slot_mapping[t:], self.block_tables[n:],
            self.context_lens[n:], starts[n:] - starts[n], self.seq_lens[n:], self.query_lens[n:],
        )  # fmt: skip
        return head, tail

    @classmethod
    def build(
        cls,
        tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences whose last query_lens[i] of context_lens[i] tokens are new.

        tables[i] lists sequence i's pool blocks in order and must cover its context. Positions
        and slots come from tensor ops over the whole batch: the Python work is per sequence.
        """
        if not len(tables) == len(context_lens) == len(query_lens) > 0:
            raise ValueError("tables, context_lens and query_lens must be as long, and not empty")
        for table, length, n_new in zip(tables, context_lens, query_lens):
            if not 0 < n_new <= length or len(table) * block_size < length:
                raise ValueError(f"bad sequence: {n_new} new of {length} in {len(table)} blocks")
        width = max(len(t) for t in tables)
        # the padded tables as C ints (4 bytes): an array fills from lists faster than
        # torch.tensor reads nested ones
        flat = array("i")
        for table in tables:
            flat.extend(table)
            flat.extend([0] * (width - len(table)))  # padding
        padded = torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width)  # (B, nb)
        ctx = torch.tensor(context_lens, dtype=torch.int32)  # (B,)
        offsets = list(accumulate(query_lens, initial=0))  # (B + 1,) each sequence's first row
        starts = torch.tensor(offsets, dtype=torch.int32)
        n_tokens, batch = offsets[-1], len(tables)
        if n_tokens == batch:  # a decode step: one new token per sequence, the context's last
            last = [n - 1 for n in context_lens]  # in Python: two tensors, not nine operations
            positions = torch.tensor(last)  # (N,)
            slots = torch.tensor(
                [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, last)]
            )  # (N,)
        else:
            n_new = torch.tensor(query_lens)  # (B,)
            seq = torch.repeat_interleave(torch.arange(batch), n_new, output_size=n_tokens)
            first = (ctx - n_new - starts[:-1]).long()  # (B,) a sequence's position at row 0
            positions = first[seq] + torch.arange(n_tokens)  # (N,)
            blocks = padded[seq, positions // block_size].long()  # (N,) pool block of each token
            slots = blocks * block_size + positions % block_size  # (N,)

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return cls(
            positions=put(positions),
            slot_mapping=put(slots),
            block_tables=put(padded),
            context_lens=put(ctx),
            query_start=put(starts),
            seq_lens=list(context_lens),
            query_lens=list(query_lens),
        )


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class KVWrite:
    """Where a step's new keys and values go in a layer's pools: (N,) int64 block and offset of
    each new token, for `index_put_` on pools indexed (num_blocks, block_size, H, D)."""

    block: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata, block_size: int) -> KVWrite:
        slots = meta.slot_mapping
        return cls(slots // block_size, slots % block_size)


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class AttentionPlan:
    """What a backend derives from one step's metadata, built once and read by every layer.

    Each backend extends it with its own fields (`kernels.backends`); a plan belongs to the
    backend that built it and to its step.

    window: the sliding window this plan's layers attend within (None: the whole context); its
    `meta` then is the step's trimmed to the blocks the window reaches (`kernels.window`).
    windows: the step's plans for its windowed layers, by window, filled by the cache that built
    this one (`kernels.paged_kv.KVPools.plan`); `for_window` picks a layer's.
    """

    meta: AttentionMetadata
    write: KVWrite
    window: int | None = field(default=None, kw_only=True)
    windows: dict[int, AttentionPlan] = field(default_factory=dict, kw_only=True, repr=False)

    def for_window(self, window: int | None) -> AttentionPlan:
        """The plan a layer with this `window` reads (this one for a global layer)."""
        return self if window is None else self.windows[window]


class PagedKV(Protocol):
    """What a model's cached forward needs of a KV cache (`kernels.paged_kv.KVPools`): one plan
    per step, then per layer a write of the new keys and values and attention over everything
    cached. Two faster paths are declared, each with the question that says whether this step
    takes it: a whole decode layer's attention from the q/k/v product (`has_qkv_path`,
    `attend_qkv`), and the compiled one-call decode of a whole layer (`has_one_call_step`,
    `one_call_step`)."""

    def plan(self, meta: AttentionMetadata) -> AttentionPlan: ...

    def window(self, layer: int) -> int | None:
        """`layer`'s sliding window in tokens (`kernels.window`), None for a global layer."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """Store k, v (N, H, D) of the step's new tokens in `layer`'s pools, then return the
        attention (N, H, D) of q over each sequence's cached and new keys."""
        ...

    def has_qkv_path(
        self, plan: AttentionPlan, qkv_dtype: torch.dtype, rope_dtype: torch.dtype | None
    ) -> bool: ...

    def attend_qkv(
        self, layer: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
        plan: AttentionPlan, n_head: int, out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...  # fmt: skip

    def has_one_call_step(self, plan: AttentionPlan) -> bool: ...

    def one_call_step(self, layer: int, plan: AttentionPlan) -> tuple[torch.Tensor, ...]: ...
