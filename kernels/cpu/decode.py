"""Decode attention on the CPU, reading the paged pools where they lie (no gathered copy).

For a decode step (one new token per sequence) over pools stored head-major, as
`kernels.backends.CpuPagedBackend` lays them out: each (block, head) is a contiguous
(block_size, D) tile, so one `bmm` multiplies every used tile by its sequence's query, another
every tile's probabilities by its values. In between, the small score tensor is laid out per
sequence in block-table order for one softmax per sequence and head, and the tiles' outputs are
summed in that order, so in float32 a sequence's result does not depend on where its blocks lie
or on what else is in the batch, to the bit, unless it shares blocks (below: a later holder's
product rounds like a several-query product, within about 1e-7) or its batch decides the
bfloat16/float16 upcast (`UPCAST_ELEMENTS`).

The allocator hands out the lowest free blocks (`engine.block_pool.BlockAllocator`), so the blocks of a
batch usually form one run at the front of the pool, which is read in place, holes included
(masked). When the run is over twice the blocks in use, those blocks are gathered instead.

Sequences may share blocks (a cached prompt prefix, n > 1 completions). The first pass reads each
distinct block once, scored by its first holder; the blocks with more holders are then read once
more, as a run of their own where they lie (or gathered), against all their further holders'
queries at once (one (Mb, D) x (D, bs) product per block and head). A shared block is read twice
however many sequences hold it, never copied per holder. A decoding sequence's last block is
its own (its new key was just written there; `KVCache` copies a shared block before a write):
a batch where it is not is refused.

The pools may hold fewer key/value heads than the queries have heads (grouped-query attention,
`kernels.gqa`): the G query heads that read one KV head are the G rows of one product with its
tile, (G, D) x (D, bs), so a tile is read once per KV head, not once per query head. With G = 1
these are the (1, D) x (D, bs) products of plain multi-head attention, the same calls.

Slots past a sequence's length in its last block may hold anything, even NaN. Their scores are
masked; their values are set to zero in the pool, since 0 * NaN is NaN. Nothing lives there: the
sequence writes those slots as it grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gptserve.kernels.gqa import kv_group
from gptserve.kernels.metadata import AttentionMetadata

# bfloat16 and float16 tiles of up to this many elements are multiplied in float32: for a few
# short sequences the copy costs less than bfloat16's slower small products (one sequence of 128
# tokens, 12 heads of 64: 1.17 -> 0.89 ms a step over 12 layers), while for 32 sequences of 160
# tokens bfloat16 is the faster (9.6 against 19 ms with the copy)
UPCAST_ELEMENTS = 1 << 18


@dataclass
class _Shared:
    """The further holders of blocks that several sequences of the batch share (a cached prefix).

    Each shared block is read once more with `width` query slots, one per holder after its first,
    so its keys and values are never copied per holder.
    """

    run: tuple[int, int] | None  # shared pool blocks [first, last) read in place, or None
    blocks: torch.Tensor | None  # (Rb,) the shared blocks to gather when there is no run
    width: int  # Mb: query slots per shared block (the most holders of one block, less one)


@dataclass
class DecodePlan:
    """What a decode step's layers share, from its metadata alone (`plan_decode`).

    Rows: one per pool block of the first run (each with its first holder), then Rb * Mb
    slots for the further holders of shared blocks (`shared`); a row is scored by one sequence."""

    run: tuple[int, int] | None  # pool blocks [first, last) read in place, or None
    blocks: torch.Tensor | None  # (R0,) pool blocks to gather when there is no run
    shared: _Shared | None  # further holders of shared blocks, if any
    n_first: int  # R0: rows of the first pass
    row_seq: torch.Tensor  # (R,) the sequence each row (block) belongs to (0 for a hole)
    row_place: torch.Tensor  # (R,) sequence * nb + the row's place in its block table
    masked: torch.Tensor  # (R, 1, bs) True where a row's slot is not a key of its sequence
    seq_rows: torch.Tensor  # (B, nb) each sequence's rows in table order; R pads
    padded: bool  # whether seq_rows holds pads (sequences of different block counts)
    in_order: bool  # rows are the sequences' blocks in table order, no holes: no reordering
    stale: torch.Tensor | None  # (S,) rows of the (NB * H * bs, D) value tiles past sequences' ends


def _rows_for(blocks: torch.Tensor, n_unique: int) -> tuple[tuple[int, int] | None, torch.Tensor]:
    """Read `blocks` (sorted, unique) in place as one run when it is at most twice their number,
    else gather them: (the run or None, each block's row in what is read)."""
    first, last = int(blocks[0]), int(blocks[-1]) + 1
    if last - first <= 2 * n_unique:
        return (first, last), blocks - first
    return None, torch.arange(n_unique, device=blocks.device)


def _holder_rank(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U,) blocks of all uses -> each use's rank among the uses of its block (0 for the first in
    batch order), the distinct blocks (sorted) and how many uses each has."""
    order = torch.argsort(blocks, stable=True)
    distinct, counts = torch.unique_consecutive(blocks[order], return_counts=True)
    group_start = (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    rank = torch.empty_like(blocks)
    rank[order] = torch.arange(blocks.numel(), device=blocks.device) - group_start
    return rank, distinct, counts


def plan_decode(
    meta: AttentionMetadata, bs: int, n_kv_head: int, window: int | None = None
) -> DecodePlan:
    """The rows, runs, masks and stale slots of a decode step over pools of `bs`-slot blocks and
    `n_kv_head` key/value heads; raises ValueError for a batch this path does not cover. With a
    sliding `window` each query sees only its sequence's last `window` keys; give it the metadata
    trimmed to the window (`kernels.window.trim_to_window`), so that no block before is read."""
    if not meta.is_decode:
        raise ValueError("decode_attention_cpu takes decode steps over head-major pools")
    block_tables = meta.block_tables
    batch = block_tables.shape[0]
    device = block_tables.device
    ctx = meta.context_lens.long()  # (B,)
    n_blocks = -(-ctx // bs)  # (B,)
    width = int(n_blocks.max())
    j = torch.arange(width, device=device)  # (nb,)
    used = j[None, :] < n_blocks[:, None]  # (B, nb)
    blocks = block_tables[:, :width].long()[used]  # (U,) in sequence, then table, order
    seq = torch.arange(batch, device=device)[:, None].expand(-1, width)[used]  # (U,)
    index = j[None, :].expand(batch, -1)[used]  # (U,)
    first_key = (j * bs)[None, :].expand(batch, -1)[used]  # (U,) position of a block's slot 0
    last_block = block_tables.long().gather(1, (n_blocks - 1)[:, None])[:, 0]  # (B,)

    # first pass: every distinct block once, scored by its first holder; the run is read in place
    # (holes masked) unless it is over twice the blocks in use, then the blocks are gathered
    rank, distinct, counts = _holder_rank(blocks)
    run, block_row = _rows_for(distinct, distinct.numel())
    n_first = block_row.numel() if run is None else run[1] - run[0]
    row_of_distinct = torch.searchsorted(distinct, blocks)  # (U,)
    row = block_row[row_of_distinct]  # (U,) first-pass row of each use's block
    shared = None
    n_rows = n_first
    if int(counts.max()) > 1:  # further holders: Mb slots per shared block, after the first pass
        shared_blocks = distinct[counts > 1]  # (Rs,) sorted
        if bool(torch.isin(last_block, shared_blocks).any()):  # its new key was written there
            raise ValueError(
                "a decoding sequence's last block is shared: it must hold it alone (KVCache "
                "copies a shared block before a write)"
            )
        slots = int(counts.max()) - 1
        shared_run, shared_row = _rows_for(shared_blocks, shared_blocks.numel())
        n_shared = shared_row.numel() if shared_run is None else shared_run[1] - shared_run[0]
        later = rank > 0
        place = torch.searchsorted(shared_blocks, blocks[later])
        row = row.clone()
        row[later] = n_first + shared_row[place] * slots + rank[later] - 1
        shared = _Shared(shared_run, None if shared_run else shared_blocks, slots)
        n_rows = n_first + n_shared * slots
    row_seq = torch.zeros(n_rows, dtype=torch.long, device=device).index_copy_(0, row, seq)
    row_place = torch.zeros(n_rows, dtype=torch.long, device=device)
    row_place.index_copy_(0, row, seq * width + index)  # holes: 0, never read back
    row_first = torch.full((n_rows,), 1 << 40, dtype=torch.long, device=device)
    row_first.index_copy_(0, row, first_key)  # holes start past any context: fully masked
    slot = row_first[:, None] + torch.arange(bs, device=device)[None, :]  # (R, bs) positions
    masked = slot >= ctx[row_seq][:, None]  # (R, bs)
    if window is not None:  # the query at ctx - 1 sees keys from ctx - window on
        masked |= slot < (ctx[row_seq] - window)[:, None]

    seq_rows = torch.full((batch, width), n_rows, dtype=torch.long, device=device)
    seq_rows[used] = row
    last_slot = (ctx - 1) % bs  # (B,) slot of each sequence's newest key in its last block
    offsets = torch.arange(bs, device=device)[None, :]
    stale_at = offsets > last_slot[:, None]  # (B, bs)
    heads = torch.arange(n_kv_head, device=device)[None, :]
    stale = (
        last_block[:, None].expand(-1, bs)[stale_at][:, None] * n_kv_head + heads
    ) * bs  # (S, H_kv) first row of a tile
    stale = (stale + offsets.expand(batch, -1)[stale_at][:, None]).reshape(-1)
    return DecodePlan(
        run=run,
        blocks=None if run else distinct,
        shared=shared,
        n_first=n_first,
        row_seq=row_seq,
        row_place=row_place,
        masked=masked[:, None, :],
        seq_rows=seq_rows,
        padded=not bool(used.all()),
        in_order=n_rows == batch * width
        and bool((seq_rows.view(-1) == torch.arange(n_rows, device=device)).all()),
        stale=stale if stale.numel() else None,
    )


def is_head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether each (block, head) of both pools is one contiguous tile (the CPU backend's layout)."""
    return k_cache.transpose(1, 2).is_contiguous() and v_cache.transpose(1, 2).is_contiguous()


def decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    sm_scale: float | None = None, plan: DecodePlan | None = None,
    upcast_elements: int = UPCAST_ELEMENTS, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """(B, H, D) decode queries against head-major paged K/V of H_kv heads (`is_head_major`;
    H a multiple of H_kv).

    Reduced-precision keys and values are multiplied in float32 when the step reads at most
    `upcast_elements` of them (0: never, so a sequence's result does not depend on its batch).

    Same contract as `kernels.reference.paged_attention_reference`, for a decode step: every
    sequence has exactly one new token. `plan` is the step's `plan_decode(meta, ...)`, which
    every layer shares; without it, one is built for this call, with `window`.
    """
    k_tiles, v_tiles = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (NB, H_kv, bs, D)
    if not (k_tiles.is_contiguous() and v_tiles.is_contiguous()):  # `is_head_major`
        raise ValueError("decode_attention_cpu takes decode steps over head-major pools")
    out_dtype = q.dtype
    n_kv, bs, head_dim = k_tiles.shape[1:]
    n_head = q.shape[1]
    group = kv_group(n_head, n_kv)  # G: the query heads of one KV head are one product's rows
    if plan is None:
        plan = plan_decode(meta, bs, n_kv, window)
    if plan.stale is not None:
        v_tiles.view(-1, head_dim).index_fill_(0, plan.stale, 0)
    keys, values = _read(k_tiles, v_tiles, plan.run, plan.blocks)  # (R0, H_kv, bs, D)
    if keys.dtype != torch.float32 and keys.numel() <= upcast_elements:
        keys, values, q = keys.float(), values.float(), q.float()  # faster in float32 (above)
    batch, width = plan.seq_rows.shape
    scale = sm_scale if sm_scale is not None else head_dim**-0.5
    q_rows = (q * scale).index_select(0, plan.row_seq)  # (R, H, D)
    n0 = plan.n_first  # the first pass's rows: all of them unless blocks are shared
    first_q = q_rows if plan.shared is None else q_rows[:n0]
    scores = torch.bmm(
        first_q.view(n0 * n_kv, group, head_dim),
        keys.reshape(n0 * n_kv, bs, head_dim).transpose(1, 2),
    ).view(n0, n_head, bs)  # query head h = KV head h // G, row h % G of its product
    if plan.shared is not None:
        sh_keys, sh_values = _read(k_tiles, v_tiles, plan.shared.run, plan.shared.blocks)
        sh_keys, sh_values = sh_keys.to(keys.dtype), sh_values.to(keys.dtype)
        sh_q = _slots_by_block(q_rows[n0:], plan.shared.width, n_kv)  # (Rb * H_kv, Mb * G, D)
        sh_scores = torch.bmm(sh_q, sh_keys.reshape(-1, bs, head_dim).transpose(1, 2))
        scores = torch.cat([scores, _rows_by_slot(sh_scores, plan.shared.width, n_head)])
    scores = scores.masked_fill_(plan.masked, float("-inf"))
    # one softmax per sequence and head over all its keys, laid out in table order
    by_seq = _by_sequence(scores, plan, float("-inf"))  # (B, nb, H, bs)
    flat = by_seq.transpose(1, 2).reshape(batch, n_head, width * bs)
    if flat.dtype != torch.float32:  # (a Python check costs less than a no-op call)
        flat = flat.float()
    probs = torch.softmax(flat, dim=-1).view(batch, n_head, width, bs)
    row_probs = probs.transpose(1, 2).reshape(batch * width, n_head, bs)
    if not plan.in_order:
        row_probs = row_probs.index_select(0, plan.row_place)
    if row_probs.dtype != values.dtype:
        row_probs = row_probs.to(values.dtype)  # (R, H, bs)
    first_probs = row_probs if plan.shared is None else row_probs[:n0]
    out = torch.bmm(
        first_probs.reshape(n0 * n_kv, group, bs), values.reshape(n0 * n_kv, bs, head_dim)
    ).view(n0, n_head, head_dim)  # (R0, H, D): each block's share of its sequence's output
    if plan.shared is not None:
        sh_probs = _slots_by_block(row_probs[n0:], plan.shared.width, n_kv)  # (Rb*H_kv, Mb*G, bs)
        sh_out = torch.bmm(sh_probs, sh_values.reshape(-1, bs, head_dim))  # (Rb*H_kv, Mb*G, D)
        out = torch.cat([out, _rows_by_slot(sh_out, plan.shared.width, n_head)])  # (R, H, D)
    out = _by_sequence(out, plan, 0.0).sum(1)  # (B, H, D), summed in table order
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _read(
    k_tiles: torch.Tensor, v_tiles: torch.Tensor, run: tuple[int, int] | None,
    blocks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(n, H, bs, D) key and value tiles: the run where it lies, else the blocks gathered."""
    if run is not None:
        return k_tiles[run[0] : run[1]], v_tiles[run[0] : run[1]]
    return k_tiles[blocks], v_tiles[blocks]


def _slots_by_block(rows: torch.Tensor, slots: int, n_kv: int) -> torch.Tensor:
    """(Rb * Mb, H, X) rows, slot after slot within each block -> (Rb * H_kv, Mb * G, X) for
    bmm: the rows that read one KV head of one block, slot by slot, the G heads of a slot."""
    n_head, x = rows.shape[1:]
    grouped = rows.view(-1, slots, n_kv, n_head // n_kv, x)  # (Rb, Mb, H_kv, G, X)
    return grouped.transpose(1, 2).reshape(-1, slots * (n_head // n_kv), x)


def _rows_by_slot(out: torch.Tensor, slots: int, n_head: int) -> torch.Tensor:
    """(Rb * H_kv, Mb * G, X) -> (Rb * Mb, H, X): the inverse of `_slots_by_block`."""
    group, x = out.shape[1] // slots, out.shape[2]
    grouped = out.view(-1, n_head // group, slots, group, x)  # (Rb, H_kv, Mb, G, X)
    return grouped.transpose(1, 2).reshape(-1, n_head, x)


def _by_sequence(rows: torch.Tensor, plan: DecodePlan, pad: float) -> torch.Tensor:
    """(R, ...) -> (B, nb, ...): each sequence's rows in block-table order, `pad` past its end."""
    if plan.in_order:
        return rows.view(*plan.seq_rows.shape, *rows.shape[1:])
    if plan.padded:
        rows = torch.cat([rows, rows.new_full((1, *rows.shape[1:]), pad)])
    return rows.index_select(0, plan.seq_rows.view(-1)).view(*plan.seq_rows.shape, *rows.shape[1:])
