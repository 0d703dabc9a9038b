"""Plain PyTorch attention: the oracle every attention path is tested against.

Written for clarity, not speed (the CPU paths are `kernels.sdpa_paged` and
`kernels.cpu.decode`). Both functions compute in fp32 and return the input dtype.

Keys and values may have fewer heads than the queries (grouped-query attention): H_q must be a
multiple of H_kv, and query head h reads key/value head h // (H_q // H_kv), as SDPA's
`enable_gqa` does (`kernels.gqa`).
"""

from __future__ import annotations

import math

import torch
from gptserve.kernels.gqa import kv_group
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.window import check_window


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    sm_scale: float | None = None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale) v with q (B, H, Tq, D), k and v (B, H_kv, Tk, D); causal masks
    are bottom-right aligned. `window` (causal only): query i (at key position p) sees the keys
    j with p - window < j <= p, Hugging Face's `sliding_window`; None: every earlier key."""
    check_window(window, causal)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = kv_group(q.shape[-3], k.shape[-3])
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)  # (B, H, Tk, D)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if causal:
        tq, tk = q.shape[-2], k.shape[-2]
        qpos = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
        kpos = torch.arange(tk, device=q.device)[None, :]
        hidden = kpos > qpos
        if window is not None:
            hidden = hidden | (kpos <= qpos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    sm_scale: float | None = None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of packed new tokens against each sequence's paged keys and values.

    q: (N, H, D), the new tokens of B sequences one after another.
    k_cache, v_cache: (num_blocks, block_size, H_kv, D), one layer's pools (new tokens already
        written); query head h reads key/value head h // (H // H_kv).
    meta: the step's block tables, context lengths and query offsets (`AttentionMetadata`).
    The causal mask is bottom-right aligned: query i of a sequence with L tokens and n new ones
    sits at position L - n + i and sees keys 0 .. L - n + i.
    Returns (N, H, D).
    """
    n_tokens, n_head, head_dim = q.shape
    block_size = k_cache.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    device = q.device
    block_tables, query_start = meta.block_tables, meta.query_start
    q_lens = (query_start[1:] - query_start[:-1]).long()  # (B,)
    ctx = meta.context_lens.long()  # (B,)
    max_q = int(q_lens.max())
    n_blocks = max(1, -(-int(ctx.max()) // block_size))
    tables = block_tables[:, :n_blocks].long()  # (B, nb)
    group = kv_group(n_head, k_cache.shape[2])
    # gather each sequence's keys and values, each KV head repeated for its group: (B, Lk, H, D)
    keys = k_cache[tables].flatten(1, 2).repeat_interleave(group, dim=2).float()
    values = v_cache[tables].flatten(1, 2).repeat_interleave(group, dim=2).float()
    kpos = torch.arange(n_blocks * block_size, device=device)  # (Lk,)
    key_valid = kpos[None, :] < ctx[:, None]  # (B, Lk)
    qi = torch.arange(max_q, device=device)  # (Lq,)
    q_valid = qi[None, :] < q_lens[:, None]  # (B, Lq)
    q_index = (query_start[:-1].long()[:, None] + qi[None, :]).clamp(max=n_tokens - 1)
    q_pad = q[q_index].float()  # (B, Lq, H, D)
    qpos = ctx[:, None] - q_lens[:, None] + qi[None, :]  # (B, Lq) absolute positions

    scores = torch.einsum("bqhd,bkhd->bhqk", q_pad, keys) * scale  # (B, H, Lq, Lk)
    allowed = (kpos[None, None, :] <= qpos[:, :, None]) & key_valid[:, None, :]  # (B, Lq, Lk)
    if window is not None:
        allowed = allowed & (kpos[None, None, :] > qpos[:, :, None] - window)
    # slots no query sees may hold anything (even NaN): zero them so 0 * garbage cannot poison
    # the sum
    seen = (allowed & q_valid[:, :, None]).any(1)  # (B, Lk)
    values = values.masked_fill(~seen[:, :, None, None], 0.0)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)  # (B, Lq, H, D)
    return out[q_valid].to(q.dtype)  # (N, H, D)
