"""Paged attention in Triton: new tokens against keys and values read through block tables.

Contract: `kernels.reference.paged_attention_reference` (packed queries (N, H, D), pools
(num_blocks, block_size, H_kv, D), the step's `AttentionMetadata`; bottom-right causal).
With grouped-query attention (H_kv < H, `kernels.gqa`) the program of query head h reads KV head
h // GROUP; GROUP is a compile-time constant, so group 1 compiles to the plain kernel.

One program owns BLOCK_M new tokens of one sequence, one head and one split of the context. It
walks its keys BLOCK_N at a time; each key's pool block comes from the block table, so a tile may
span several (shuffled) pool blocks and the pool's block size need not divide BLOCK_N.

Split-K (flash-decoding): a decode step has one query per sequence, so one program per
(sequence, head) leaves most of a big GPU idle when the batch is small and contexts are long.
The context is cut into splits of `split_size` keys; each program writes its normalised partial
output and its log-sum-exp, and a merge kernel combines the splits. With one split the kernel
writes the final output directly.

A sliding window (`kernels.window`: position p sees keys p - window < j <= p) starts each
program's walk at its first row's window, so blocks before it are never read, and masks the keys
before each row's own window.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from gptserve.kernels.gqa import kv_group
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.triton.softmax import (
    LOG2E,
    dot_precision,
    softmax_finish,
    softmax_init,
    softmax_update,
)
from gptserve.kernels.window import check_window

NO_WINDOW = 1 << 30  # the kernel's window for a global layer: wider than any context


@triton.jit
def _paged_attn_kernel(
    Q, KC, VC, TABLES, CTX_LENS, Q_START, OUT, LSE,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb,
    stride_os, stride_on, stride_oh, stride_od,
    stride_ls, stride_ln, stride_lh,
    qk_scale, page_size, split_size, n_qblocks, WINDOW,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, WRITE_LSE: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # the query head
    kv_h = h // GROUP  # the key/value head it reads
    split = tl.program_id(2)
    seq = pid // n_qblocks
    m0 = (pid % n_qblocks) * BLOCK_M  # first query row of this program within the sequence

    q_start = tl.load(Q_START + seq)
    q_len = tl.load(Q_START + seq + 1) - q_start
    ctx = tl.load(CTX_LENS + seq)

    offs_m = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows within the sequence's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < q_len
    qd_mask = m_ok[:, None] & d_ok[None, :]
    rows = (q_start + offs_m).to(tl.int64)  # (BLOCK_M,) rows in the packed batch
    q_ptrs = Q + rows[:, None] * stride_qn + h * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=qd_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    q_pos = ctx - q_len + offs_m  # absolute position of each query: it sees keys 0 .. q_pos

    # keys this program may need: up to the last real query's position, within its split
    kv_end = ctx - q_len + tl.minimum(m0 + BLOCK_M, q_len)
    kv_end = tl.where(m0 < q_len, kv_end, 0)
    lo = split * split_size
    hi = tl.minimum(kv_end, lo + split_size)
    lo = tl.maximum(lo, ctx - q_len + m0 - WINDOW + 1)  # the first row's window's first key

    acc, l_i, m_i = softmax_init(BLOCK_M, BLOCK_D)
    table = TABLES + seq.to(tl.int64) * stride_tb
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n  # (BLOCK_N,) key positions in the sequence
        k_ok = kpos < hi
        block = tl.load(table + kpos // page_size, mask=k_ok, other=0).to(tl.int64)
        slot = (kpos % page_size).to(tl.int64)
        k_row = block * stride_kb + slot * stride_ks + kv_h * stride_kh  # (BLOCK_N,)
        v_row = block * stride_vb + slot * stride_vs + kv_h * stride_vh
        # masked loads read 0: pool slots past the context may hold garbage (even NaN)
        kt_ptrs = KC + k_row[None, :] + offs_d[:, None] * stride_kd  # (BLOCK_D, BLOCK_N)
        kt = tl.load(kt_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        seen = (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(k_ok[None, :] & seen, s, float("-inf"))
        v_ptrs = VC + v_row[:, None] + offs_d[None, :] * stride_vd  # (BLOCK_N, BLOCK_D)
        v_mask = k_ok[:, None] & d_ok[None, :]
        acc, l_i, m_i = softmax_update(acc, l_i, m_i, s, v_ptrs, v_mask, DOT_PREC)

    # a row with no key in this split: output 0 and LSE -inf, so the merge gives it no weight
    out, lse = softmax_finish(acc, l_i, m_i, float("-inf"))
    split64 = split.to(tl.int64)
    OUT += split64 * stride_os + h * stride_oh
    out_ptrs = OUT + rows[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=qd_mask)
    if WRITE_LSE:
        tl.store(LSE + split64 * stride_ls + rows * stride_ln + h * stride_lh, lse, mask=m_ok)


@triton.jit
def _merge_splits_kernel(
    PART, LSE, OUT, n_splits,
    stride_ps, stride_pn, stride_ph, stride_pd,
    stride_ls, stride_ln, stride_lh,
    stride_on, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < HEAD_DIM
    lse_ptrs = LSE + offs_s * stride_ls + n * stride_ln + h * stride_lh
    lse = tl.load(lse_ptrs, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))  # (BLOCK_S,)
    part_ptrs = PART + n * stride_pn + h * stride_ph
    part_ptrs += offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd  # (BLOCK_S, BLOCK_D)
    part = tl.load(part_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # (BLOCK_D,)
    out_ptrs = OUT + n * stride_on + h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(programs: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, none shorter than 256 keys."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device)
    want = triton.cdiv(2 * sms, max(programs, 1))
    longest = triton.cdiv(max_ctx, max(256, block_n))
    return max(1, min(want, longest, 64))


def _query_tile(max_query_len: int) -> int:
    """BLOCK_M: 16 rows up to 16 new tokens a sequence, else the next power of two up to 64."""
    return 16 if max_query_len <= 16 else min(64, triton.next_power_of_2(max_query_len))


def default_split_size(
    meta: AttentionMetadata, n_head: int, page_size: int, device: torch.device, block_n: int = 64
) -> int:
    """Keys per split for a step (the split-K heuristic of `_num_splits`), from the host-side
    lengths and the table width, which bounds every context without a read back from the device."""
    max_ctx = meta.block_tables.shape[1] * page_size
    programs = meta.num_seqs * triton.cdiv(meta.max_query_len, _query_tile(meta.max_query_len))
    return triton.cdiv(max_ctx, _num_splits(programs * n_head, max_ctx, block_n, device))


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    sm_scale: float | None = None,
    *,
    split_size: int | None = None,
    block_n: int = 64,
    window: int | None = None,
) -> torch.Tensor:
    """Paged attention, same contract as `paged_attention_reference`; returns (N, H, D).

    The pools may hold fewer heads than q (H a multiple of their H_kv): query head h reads KV
    head h // (H // H_kv).

    Reads meta.block_tables, meta.context_lens and meta.query_start on the device and
    meta.max_query_len on the host, so nothing is read back. Every sequence must have at least one
    new token. split_size (keys per split, rounded up to a multiple of block_n) overrides the
    split-K heuristic. `window`: each query sees only its last `window` keys (give it the
    metadata trimmed to the window, `kernels.window.trim_to_window`, to plan no split before it).
    """
    check_window(window)
    n_tokens, n_head, head_dim = q.shape
    page_size, n_kv_head = k_cache.shape[1:3]
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"pools {tuple(k_cache.shape)} do not match queries {tuple(q.shape)}")
    group = kv_group(n_head, n_kv_head)
    if head_dim > 256:
        raise ValueError(f"head dim {head_dim} > 256 is not supported")
    out = torch.empty((n_tokens, n_head, head_dim), device=q.device, dtype=q.dtype)
    if n_tokens == 0:
        return out
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    block_m = _query_tile(meta.max_query_len)
    block_d = max(16, triton.next_power_of_2(head_dim))
    n_qblocks = triton.cdiv(meta.max_query_len, block_m)
    tables = meta.block_tables
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    max_ctx = tables.shape[1] * page_size
    if split_size is None:
        split_size = default_split_size(meta, n_head, page_size, q.device, block_n)
    split_size = triton.cdiv(max(split_size, 1), block_n) * block_n
    splits = triton.cdiv(max_ctx, split_size)

    if splits == 1:  # the kernel writes the output itself and no LSE
        part, lse = out, out
        part_strides, lse_strides = (0, *out.stride()), (0, 0, 0)
    else:  # (splits, N, H, D) partial outputs and (splits, N, H) LSEs for the merge, fp32
        part = q.new_empty((splits, n_tokens, n_head, head_dim), dtype=torch.float32)
        lse = q.new_empty((splits, n_tokens, n_head), dtype=torch.float32)
        part_strides, lse_strides = part.stride(), lse.stride()
    lens, starts = meta.context_lens.to(torch.int32), meta.query_start.to(torch.int32)
    _paged_attn_kernel[(meta.num_seqs * n_qblocks, n_head, splits)](
        q, k_cache, v_cache, tables, lens, starts, part, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), tables.stride(0),
        *part_strides, *lse_strides,
        scale * LOG2E, page_size, split_size, n_qblocks, window or NO_WINDOW,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PREC=dot_precision(q.dtype), WRITE_LSE=splits > 1, GROUP=group,
        num_warps=4 if block_d <= 64 else 8, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(n_tokens, n_head)](
            part, lse, out, splits, *part.stride(), *lse.stride(), *out.stride(),
            HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
        )  # fmt: skip
    return out
