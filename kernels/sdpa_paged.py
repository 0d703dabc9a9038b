"""Paged attention on the CPU: gather each sequence's keys and values, then one fused SDPA call.

Same contract as `kernels.reference.paged_attention_reference`; this is the fast path where Triton
does not run. The gathered copy is cleaned where a sequence has no keys, so garbage (even NaN) in
unused pool slots never reaches the output; every query sees at least key 0, so no row is fully
masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    n_tokens, n_head, head_dim = q.shape
    block_size = k_cache.shape[1]
    batch = block_tables.shape[0]
    ctx = context_lens.long()  # (B,)
    q_lens = (query_start[1:] - query_start[:-1]).long()  # (B,)
    n_blocks = -(-int(ctx.max()) // block_size)
    # whole blocks are copied (one memcpy each); table padding is pointed at the sequence's first
    # block, so only slots inside a sequence's own blocks can hold stale data
    tables = block_tables[:, :n_blocks].long()  # (B, nb)
    block_used = torch.arange(n_blocks, device=q.device)[None, :] * block_size < ctx[:, None]
    tables = torch.where(block_used, tables, tables[:, :1]).reshape(-1)
    kv_shape = (batch, n_blocks * block_size, n_head, head_dim)
    keys = k_cache.index_select(0, tables).view(kv_shape)  # (B, Lk, H, D)
    values = v_cache.index_select(0, tables).view(kv_shape)
    kpos = torch.arange(n_blocks * block_size, device=q.device)  # (Lk,)
    key_valid = kpos[None, :] < ctx[:, None]  # (B, Lk)
    stale = (~key_valid).view(-1).nonzero().squeeze(1)
    if len(stale):  # masked scores still meet these values: 0 * NaN would be NaN
        keys.view(-1, n_head, head_dim)[stale] = 0
        values.view(-1, n_head, head_dim)[stale] = 0

    decode = n_tokens == batch  # one new token per sequence: no padding of the queries
    max_q = 1 if decode else int(q_lens.max())
    qi = torch.arange(max_q, device=q.device)  # (Lq,)
    if decode:
        q_pad = q[:, None]  # (B, 1, H, D)
    else:
        q_index = (query_start[:-1].long()[:, None] + qi[None, :]).clamp(max=n_tokens - 1)
        q_pad = q[q_index]  # (B, Lq, H, D)
    qpos = ctx[:, None] - q_lens[:, None] + qi[None, :]  # (B, Lq) absolute positions
    allowed = (kpos[None, None, :] <= qpos[:, :, None]) & key_valid[:, None, :]  # (B, Lq, Lk)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=sm_scale,
    ).transpose(1, 2)  # (B, Lq, H, D)
    if decode:
        return out[:, 0]
    return out[qi[None, :] < q_lens[:, None]]  # (N, H, D)
