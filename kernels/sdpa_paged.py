"""Paged attention on the CPU: gather each sequence's keys and values, then one fused SDPA call.

Same contract as `kernels.reference.paged_attention_reference`; this is the fast path where Triton
does not run. The gathered copy is cleaned where a sequence has no keys, so garbage (even NaN) in
unused pool slots never reaches the output; every query sees at least key 0, so no row is fully
masked.

Everything that depends only on the batch layout (which blocks to copy, the mask, the stale slots)
is a `_Plan`, built once per model step and reused by every layer: the layers of one step pass the
very same block-table, length and offset tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class _Plan:
    inputs: tuple[torch.Tensor, ...]  # (block_tables, context_lens, query_start), kept alive
    versions: tuple[int, ...]  # their in-place modification counters when the plan was built
    block_size: int
    n_tokens: int
    blocks: torch.Tensor  # (B * nb,) pool blocks to copy, sequence after sequence
    kv_shape: tuple[int, int, int, int]  # (B, Lk, H, D) of the gathered copy
    stale: torch.Tensor | None  # (S,) gathered slots past a sequence's length, or None
    mask: torch.Tensor  # (B, 1, Lq, Lk) True where a query may see a key
    q_index: torch.Tensor | None  # (B, Lq) packed query rows per sequence; None for decode
    out_rows: torch.Tensor | None  # (B, Lq) True for real (unpadded) query rows


_last_plan: _Plan | None = None


def _matches(
    plan: _Plan | None, inputs: tuple[torch.Tensor, ...], q: torch.Tensor, block_size: int
) -> bool:
    return (
        plan is not None
        and all(a is b for a, b in zip(plan.inputs, inputs))
        and plan.versions == tuple(t._version for t in inputs)
        and plan.block_size == block_size
        and plan.n_tokens == q.shape[0]
        and plan.kv_shape[2:] == q.shape[1:]
    )


def _make_plan(
    inputs: tuple[torch.Tensor, ...], block_size: int, n_tokens: int, n_head: int, head_dim: int
) -> _Plan:
    block_tables, context_lens, query_start = inputs
    device = block_tables.device
    batch = block_tables.shape[0]
    ctx = context_lens.long()  # (B,)
    q_lens = (query_start[1:] - query_start[:-1]).long()  # (B,)
    n_blocks = -(-int(ctx.max()) // block_size)
    # whole blocks are copied (one memcpy each); table padding is pointed at the sequence's first
    # block, so only slots inside a sequence's own blocks can hold stale data
    tables = block_tables[:, :n_blocks].long()  # (B, nb)
    block_used = torch.arange(n_blocks, device=device)[None, :] * block_size < ctx[:, None]
    blocks = torch.where(block_used, tables, tables[:, :1]).reshape(-1)
    kpos = torch.arange(n_blocks * block_size, device=device)  # (Lk,)
    key_valid = kpos[None, :] < ctx[:, None]  # (B, Lk)
    stale = (~key_valid).view(-1).nonzero().squeeze(1)

    decode = n_tokens == batch  # one new token per sequence: no padding of the queries
    max_q = 1 if decode else int(q_lens.max())
    qi = torch.arange(max_q, device=device)  # (Lq,)
    q_index = out_rows = None
    if not decode:
        q_index = (query_start[:-1].long()[:, None] + qi[None, :]).clamp(max=n_tokens - 1)
        out_rows = qi[None, :] < q_lens[:, None]
    qpos = ctx[:, None] - q_lens[:, None] + qi[None, :]  # (B, Lq) absolute positions
    allowed = (kpos[None, None, :] <= qpos[:, :, None]) & key_valid[:, None, :]  # (B, Lq, Lk)
    return _Plan(
        inputs=inputs,
        versions=tuple(t._version for t in inputs),
        block_size=block_size,
        n_tokens=n_tokens,
        blocks=blocks,
        kv_shape=(batch, n_blocks * block_size, n_head, head_dim),
        stale=stale if len(stale) else None,
        mask=allowed[:, None],
        q_index=q_index,
        out_rows=out_rows,
    )


def paged_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """(N, H, D) new tokens against paged K/V; returns (N, H, D)."""
    global _last_plan
    n_tokens, n_head, head_dim = q.shape
    block_size = k_cache.shape[1]
    inputs = (block_tables, context_lens, query_start)
    plan = _last_plan
    if not _matches(plan, inputs, q, block_size):
        plan = _last_plan = _make_plan(inputs, block_size, n_tokens, n_head, head_dim)
    keys = k_cache.index_select(0, plan.blocks).view(plan.kv_shape)  # (B, Lk, H, D)
    values = v_cache.index_select(0, plan.blocks).view(plan.kv_shape)
    if plan.stale is not None:  # masked scores still meet these values: 0 * NaN would be NaN
        keys.view(-1, n_head, head_dim)[plan.stale] = 0
        values.view(-1, n_head, head_dim)[plan.stale] = 0
    q_pad = q[:, None] if plan.q_index is None else q[plan.q_index]  # (B, Lq, H, D)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=plan.mask,
        scale=sm_scale,
    ).transpose(1, 2)  # (B, Lq, H, D)
    if plan.out_rows is None:
        return out[:, 0]
    return out[plan.out_rows]  # (N, H, D)
