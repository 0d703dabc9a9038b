"""One engine step's attention metadata: the packed batch as every paged-attention backend reads it.

The KV cache builds one `AttentionMetadata` per step (`engine.kv_cache.KVCache.prepare`) and the model
hands the same object to every layer's attention. A backend that derives something from the batch
layout alone (which blocks to read, masks, splits) builds it on the first layer with `plan` and
every later layer of the step reuses it; the plan dies with the step's metadata. Nothing is
global, so two engines in one process, or two threads, never see each other's plans.

The lengths are also kept on the host (`seq_lens`, `query_lens`), so no backend has to read a
device tensor back to learn how many decodes lead the batch or how long the longest context is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, TypeVar

import torch

Plan = TypeVar("Plan")


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
    plans: dict[str, Any] = field(default_factory=dict, init=False, repr=False)  # by name

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

    def plan(self, name: str, build: Callable[[], Plan]) -> Plan:
        """The step's plan called `name`, built by the first caller and kept for the step."""
        if name not in self.plans:
            self.plans[name] = build()
        return self.plans[name]

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

        tables[i] lists sequence i's pool blocks in order and must cover its context.
        """
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for table, length, n_new in zip(tables, context_lens, query_lens, strict=True):
            if not 0 < n_new <= length or len(table) * block_size < length:
                raise ValueError(f"bad sequence: {n_new} new of {length} in {len(table)} blocks")
            for p in range(length - n_new, length):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            starts.append(starts[-1] + n_new)
        width = max(len(t) for t in tables)
        padded = [list(t) + [0] * (width - len(t)) for t in tables]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            positions=tensor(positions, torch.long),
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(padded, torch.int32),
            context_lens=tensor(list(context_lens), torch.int32),
            query_start=tensor(starts, torch.int32),
            seq_lens=list(context_lens),
            query_lens=list(query_lens),
        )


class PagedKV(Protocol):
    """What a model's cached forward needs of a KV cache: per-layer pools and a write."""

    k: torch.Tensor  # (n_layer, num_blocks, block_size, n_kv_head, head_dim)
    v: torch.Tensor

    def write(
        self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...
