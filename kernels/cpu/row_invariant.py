"""Attention for `--batch-invariant` on a CPU: every new token attends as a decoding one does.

By default a step's new tokens take one of three attention paths, chosen by the step: the
leading decodes the compiled decode kernel (`kernels.cpu.native`'s `paged_decode`), a prompt
chunk gather + SDPA over the step's padded shapes (`kernels.sdpa_paged`), and, where several
sequences of the step continue one cached prefix (a chat template's system prompt), the cascade
(`kernels.cpu.cascade`). Each sums in its own order, so a token's attention, and from there its
logits, depended on its batch: the default model's first sampled token, after a prompt whose
system prompt other requests' prompts in the step shared, moved by 0.06 in logprob in bfloat16,
enough to change the text.

`RowInvariantCpuBackend` takes every new token as a decode: `rows_as_decodes` re-describes a
step of B sequences and N new tokens as N one-token sequences, token i of a chunk that starts at
position p being a sequence of p + i + 1 tokens over its sequence's block table. The compiled
decode kernel writes every new key and value first and then computes each of its sequences alone
(in float32, its blocks read where they lie), so a token's attention is the same arithmetic
whether it is a decode, a prompt's last token, a chunk's middle row, alone or beside any others;
a step of new tokens is also always a decode step for the one-call layers
(`model.cpu.llama_layer`), so those take every step, prefills included, rather than some. What
it costs: a prompt's attention as one matrix-vector product per token and head instead of SDPA's
matrix products (docs/RELIABILITY.md, "Batch invariance").

Where the compiled kernels are not built, PyTorch's decode attention (`kernels.cpu.decode`)
computes a sequence alone and among others alike only where it shares no block with another and
its last block holds nothing past its token; the tokens then go in rounds: round r writes and
attends the r-th new token of each sequence, sequences that share a block (a cached prefix,
n > 1 completions) in rounds of their own. Slower (a prompt of L new tokens is L rounds a layer),
but to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gptserve.kernels.backends import CpuPagedBackend, CpuPagedPlan, KVSpec
from gptserve.kernels.cpu.decode import DecodePlan, decode_attention_cpu, plan_decode
from gptserve.kernels.metadata import AttentionMetadata, KVWrite

__all__ = ["RowInvariantCpuBackend", "rows_as_decodes", "share_free_rounds"]


def rows_as_decodes(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with each new token a sequence of its own: (N,) contexts ending at the token, each
    over its sequence's block table; positions and write slots unchanged. `meta` itself when
    every sequence has one new token."""
    if meta.is_decode:
        return meta
    n = meta.num_tokens
    lens = [ctx - q + i + 1 for ctx, q in zip(meta.seq_lens, meta.query_lens) for i in range(q)]
    device = meta.block_tables.device
    owner = torch.repeat_interleave(
        torch.arange(meta.num_seqs), torch.tensor(meta.query_lens), output_size=n
    ).to(device)  # (N,) each token's sequence
    tables = meta.block_tables.index_select(0, owner).contiguous()  # (N, nb)
    return AttentionMetadata(
        positions=meta.positions,
        slot_mapping=meta.slot_mapping,
        block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True),
        query_start=torch.arange(n + 1, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=lens,
        query_lens=[1] * n,
    )


def share_free_rounds(meta: AttentionMetadata, block_size: int) -> list[list[int]]:
    """The packed rows of `meta` in rounds, each round at most one new token of a sequence and
    no two sequences that share a block: round by round, the r-th new token of each sequence,
    sequences sharing a block with an earlier one of the round moved to a round of their own.
    Rounds come in order of each sequence's tokens (a token's earlier tokens are in earlier
    rounds)."""
    tables = meta.block_tables.cpu().tolist()
    used = [set(t[: -(-n // block_size)]) for t, n in zip(tables, meta.seq_lens)]
    colours: list[int] = []  # each sequence's: sequences of one colour share no block
    members: list[set[int]] = []  # the blocks each colour's sequences hold
    for blocks in used:
        colour = next((c for c, held in enumerate(members) if not held & blocks), len(members))
        if colour == len(members):
            members.append(set())
        members[colour] |= blocks
        colours.append(colour)
    starts = meta.query_start.cpu().tolist()
    rounds: list[list[int]] = []
    for colour in range(len(members)):
        seqs = [b for b, c in enumerate(colours) if c == colour]
        for r in range(max(meta.query_lens[b] for b in seqs)):
            rounds.append([starts[b] + r for b in seqs if r < meta.query_lens[b]])
    return rounds


@dataclass(frozen=True)
class _Round:
    """Rows that attend together on PyTorch's decode path."""

    rows: torch.Tensor  # (R,) packed rows
    meta: AttentionMetadata  # their one-token sequences
    write: KVWrite
    decode: DecodePlan


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class RoundsPlan(CpuPagedPlan):
    """A step's tokens as decodes in share-free rounds (no compiled kernel)."""

    rounds: tuple[_Round, ...] = field(default=(), kw_only=True)


@dataclass
class RowInvariantCpuBackend(CpuPagedBackend):
    """`CpuPagedBackend` whose every new token attends as a decode (`rows_as_decodes`), reduced
    precision keys never upcast by the step's size: a token's attention does not depend on its
    batch, on how its prompt was cut into chunks, or on blocks it shares."""

    cascade: bool = False
    batch_invariant: bool = True

    def plan(
        self, meta: AttentionMetadata, spec: KVSpec, window: int | None = None
    ) -> CpuPagedPlan:
        rows = rows_as_decodes(meta)
        if self._native() is not None:  # all decodes: the compiled kernel takes them
            return super().plan(rows, spec, window)
        rounds = []
        for members in share_free_rounds(meta, spec.block_size):
            index = torch.tensor(members, device=meta.positions.device)
            part = _select(rows, index)
            decode = plan_decode(part, spec.block_size, spec.n_kv_head, window)
            rounds.append(_Round(index, part, KVWrite.of(part, spec.block_size), decode))
        write = KVWrite.of(rows, spec.block_size)
        first = rounds[0].decode
        return RoundsPlan(rows, write, rows, first, None, None, window=window, rounds=tuple(rounds))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
        v_pool: torch.Tensor, plan: CpuPagedPlan, sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if not isinstance(plan, RoundsPlan):
            return super().forward(q, k, v, k_pool, v_pool, plan, sm_scale)
        # each round writes its tokens and then attends: the slots past a token in its last
        # block hold nothing yet when PyTorch's decode zeroes their values
        queries = q if q.dtype == k_pool.dtype else q.to(k_pool.dtype)
        out = torch.empty_like(queries)  # (N, H, D)
        for part in plan.rounds:
            self.write(k_pool, v_pool, k[part.rows], v[part.rows], part.write)
            out[part.rows] = decode_attention_cpu(
                queries[part.rows], k_pool, v_pool, part.meta, sm_scale, part.decode, 0,
                plan.window,
            )  # fmt: skip
        return out if out.dtype == q.dtype else out.to(q.dtype)


def _select(meta: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
    """The one-token sequences `rows` of a decode step's metadata."""
    host = rows.cpu().tolist()
    return AttentionMetadata(
        positions=meta.positions[rows],
        slot_mapping=meta.slot_mapping[rows],
        block_tables=meta.block_tables[rows],
        context_lens=meta.context_lens[rows],
        query_start=torch.arange(len(host) + 1, dtype=torch.int32, device=rows.device),
        seq_lens=[meta.seq_lens[i] for i in host],
        query_lens=[1] * len(host),
    )
