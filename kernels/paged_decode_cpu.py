"""Decode attention on the CPU, reading the paged pools where they lie (no gathered copy).

For a decode step (one new token per sequence) over pools stored head-major, as `KVCache` stores
them: each (block, head) is a contiguous (block_size, D) tile, so one `bmm` multiplies every
used tile by its sequence's query, another every tile's probabilities by its values. In between,
the small score tensor is laid out per sequence in block-table order for one softmax per
sequence and head, and the tiles' outputs are summed in that order, so a sequence's result does
not depend on where its blocks lie or on what else is in the batch.

The allocator hands out the lowest free blocks (`model.cache.BlockAllocator`), so the blocks of a
batch usually form one run at the front of the pool, which is read in place, holes included
(masked). When the run is over twice the blocks in use, or sequences share blocks (a cached
prompt prefix), those blocks are gathered instead.

Slots past a sequence's length in its last block may hold anything, even NaN. Their scores are
masked; their values are set to zero in the pool, since 0 * NaN is NaN. Nothing lives there: the
sequence writes those slots as it grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata


@dataclass
class _Plan:
    run: tuple[int, int] | None  # pool blocks [first, last) read in place, or None
    blocks: torch.Tensor | None  # (R,) pool blocks to gather when there is no run
    row_seq: torch.Tensor  # (R,) the sequence each row (block) belongs to (0 for a hole)
    row_place: torch.Tensor  # (R,) sequence * nb + the row's place in its block table
    masked: torch.Tensor  # (R, 1, bs) True where a row's slot is not a key of its sequence
    seq_rows: torch.Tensor  # (B, nb) each sequence's rows in table order; R pads
    padded: bool  # whether seq_rows holds pads (sequences of different block counts)
    stale: torch.Tensor | None  # (S,) rows of the (NB * H * bs, D) value tiles past sequences' ends


def _make_plan(meta: AttentionMetadata, bs: int, n_head: int) -> _Plan:
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

    first, last = int(blocks.min()), int(blocks.max()) + 1
    n_used = blocks.numel()
    # a row is one pool block of one sequence: blocks that sequences share (a cached prefix) need
    # a row per sequence, so such a batch gathers
    shared = torch.unique(blocks).numel() < n_used
    if last - first <= 2 * n_used and not shared:  # read the run in place; holes masked
        n_rows = last - first
        row = blocks - first  # (U,) the row of each used block
        run, gather = (first, last), None
    else:
        n_rows = n_used
        row = torch.arange(n_used, device=device)
        run, gather = None, blocks
    row_seq = torch.zeros(n_rows, dtype=torch.long, device=device).index_copy_(0, row, seq)
    row_place = torch.zeros(n_rows, dtype=torch.long, device=device)
    row_place.index_copy_(0, row, seq * width + index)  # holes: 0, never read back
    row_first = torch.full((n_rows,), 1 << 40, dtype=torch.long, device=device)
    row_first.index_copy_(0, row, first_key)  # holes start past any context: fully masked
    slot = row_first[:, None] + torch.arange(bs, device=device)[None, :]  # (R, bs) positions
    masked = slot >= ctx[row_seq][:, None]  # (R, bs)

    seq_rows = torch.full((batch, width), n_rows, dtype=torch.long, device=device)
    seq_rows[used] = row
    last_slot = (ctx - 1) % bs  # (B,) slot of each sequence's newest key in its last block
    offsets = torch.arange(bs, device=device)[None, :]
    stale_at = offsets > last_slot[:, None]  # (B, bs)
    last_block = block_tables.long().gather(1, (n_blocks - 1)[:, None]).expand(-1, bs)
    heads = torch.arange(n_head, device=device)[None, :]
    stale = (last_block[stale_at][:, None] * n_head + heads) * bs  # (S, H) first row of a tile
    stale = (stale + offsets.expand(batch, -1)[stale_at][:, None]).reshape(-1)
    return _Plan(
        run=run,
        blocks=gather,
        row_seq=row_seq,
        row_place=row_place,
        masked=masked[:, None, :],
        seq_rows=seq_rows,
        padded=not bool(used.all()),
        stale=stale if stale.numel() else None,
    )


def is_head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether each (block, head) of both pools is one contiguous tile, as `KVCache` stores them."""
    return k_cache.transpose(1, 2).is_contiguous() and v_cache.transpose(1, 2).is_contiguous()


def decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    sm_scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """(B, H, D) decode queries against head-major paged K/V (`is_head_major`).

    Same contract as `kernels.reference.paged_attention_reference`, for a decode step: every
    sequence has exactly one new token.
    """
    if not meta.is_decode or not is_head_major(k_cache, v_cache):
        raise ValueError("decode_attention_cpu takes decode steps over head-major pools")
    k_tiles, v_tiles = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (NB, H, bs, D)
    n_head, bs, head_dim = k_tiles.shape[1:]
    plan = meta.plan("cpu_decode", lambda: _make_plan(meta, bs, n_head))
    if plan.stale is not None:
        v_tiles.view(-1, head_dim).index_fill_(0, plan.stale, 0)
    if plan.run is not None:
        keys, values = (t[plan.run[0] : plan.run[1]] for t in (k_tiles, v_tiles))
    else:
        keys, values = k_tiles[plan.blocks], v_tiles[plan.blocks]  # (R, H, bs, D)
    n_rows = keys.shape[0]
    batch, width = plan.seq_rows.shape
    scale = sm_scale if sm_scale is not None else head_dim**-0.5
    q_rows = (q * scale).index_select(0, plan.row_seq).view(n_rows * n_head, 1, head_dim)
    scores = torch.bmm(q_rows, keys.reshape(n_rows * n_head, bs, head_dim).transpose(1, 2))
    scores = scores.view(n_rows, n_head, bs).masked_fill_(plan.masked, float("-inf"))
    # one softmax per sequence and head over all its keys, laid out in table order
    by_seq = _by_sequence(scores, plan, float("-inf"))  # (B, nb, H, bs)
    flat = by_seq.transpose(1, 2).reshape(batch, n_head, width * bs)
    probs = torch.softmax(flat.float(), dim=-1).view(batch, n_head, width, bs)
    row_probs = probs.transpose(1, 2).reshape(batch * width, n_head, bs)
    row_probs = row_probs.index_select(0, plan.row_place)  # (R, H, bs)
    out = torch.bmm(
        row_probs.to(values.dtype).view(n_rows * n_head, 1, bs),
        values.reshape(n_rows * n_head, bs, head_dim),
    ).view(n_rows, n_head, head_dim)  # (R, H, D): each block's share of its sequence's output
    return _by_sequence(out, plan, 0.0).sum(1).to(q.dtype)  # (B, H, D), summed in table order


def _by_sequence(rows: torch.Tensor, plan: _Plan, pad: float) -> torch.Tensor:
    """(R, ...) -> (B, nb, ...): each sequence's rows in block-table order, `pad` past its end."""
    if plan.padded:
        rows = torch.cat([rows, rows.new_full((1, *rows.shape[1:]), pad)])
    return rows.index_select(0, plan.seq_rows.view(-1)).view(*plan.seq_rows.shape, *rows.shape[1:])
