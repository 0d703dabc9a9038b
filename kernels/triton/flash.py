"""Fused attention in Triton: forward with an online softmax, backward for dQ, dK and dV.

Layout: q (B, H, Tq, D), k and v (B, H_kv, Tk, D), any strides (the model hands in transposed
views). H is a multiple of H_kv: with grouped-query attention (`kernels.gqa`) query head h reads
key/value head h // GROUP, a compile-time constant (group 1 compiles to plain multi-head
attention). One program owns BLOCK_M queries of one (batch, head) and walks over key blocks with
the online softmax of `kernels.triton.softmax`. The causal mask is bottom-right aligned (query i sees keys
0 .. i + Tk - Tq). Each loop over tiles runs in two passes: tiles wholly below the diagonal with
no mask, and the tiles that touch it with one; tiles wholly above it are never visited. With a
sliding window (WINDOWED, `kernels.window`: query position p sees keys p - WINDOW < j <= p) the
tiles wholly before the block's first window are never visited either, and every tile visited
takes the mask.

The forward stores the log-sum-exp of every row (base 2, scores pre-multiplied by log2(e)) so the
backward can rebuild the probabilities without a second softmax pass:
  preprocess: delta = rowsum(dO * O)
  dK, dV:     one program per key block of a KV head, looping over the query blocks that can
              see it, of each of the GROUP query heads that read it (their sum, no atomics)
  dQ:         one program per query block, looping over the key blocks it sees
The last two are one kernel launched twice (DQ_PASS). Separate dQ programs instead of atomics:
deterministic, and no fp32 dQ scratch buffer, at the price of computing Q K^T twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from gptserve.kernels.triton.softmax import (
    LOG2E,
    dot_precision,
    softmax_finish,
    softmax_init,
    softmax_update,
)
from gptserve.kernels.window import check_window

Config = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, num_warps, num_stages


@triton.jit
def _tile(ptr, rows, cols, stride_r, stride_c):
    """Pointers to ptr[rows, cols]: (len(rows), len(cols))."""
    return ptr + rows[:, None] * stride_r + cols[None, :] * stride_c


@triton.jit
def _program_head(H):
    """(batch * H + head, batch, head) of this program's grid axis 0, all int64."""
    bh = tl.program_id(0).to(tl.int64)
    return bh, bh // H, bh % H


@triton.jit
def _query_block(CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query row of this program's block (grid axis 1)."""
    pid_m = tl.program_id(1)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        pid_m = tl.num_programs(1) - 1 - pid_m
    return pid_m * BLOCK_M


@triton.jit
def _key_passes(
    start_m, TQ, TK, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N, WINDOWED: tl.constexpr,
    WINDOW,
):  # fmt: skip
    """(lo, n_full, end) for query rows start_m ..: keys [lo, n_full) need no mask, [n_full, end)
    do, keys before lo are in no row's window."""
    full_tk = (TK // BLOCK_N) * BLOCK_N  # keys in whole blocks
    if WINDOWED:  # causal too: from the first row's window's first key's tile, all masked
        shift = TK - TQ
        lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(TK, tl.minimum(start_m + BLOCK_M, TQ) + shift)
        return lo, lo, end
    if CAUSAL:
        shift = TK - TQ  # bottom-right alignment: query row i sits at key position i + shift
        # blocks whose every key is <= the first query's position need no mask
        n_full = tl.minimum(tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N, full_tk)
        # nothing beyond the last real query's position is visited at all
        end = tl.minimum(TK, tl.minimum(start_m + BLOCK_M, TQ) + shift)
    else:
        n_full = full_tk
        end = TK
    return 0, n_full, end


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    H, TQ, TK, qk_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, GROUP: tl.constexpr, WINDOWED: tl.constexpr,
    WINDOW,
):  # fmt: skip
    start_m = _query_block(CAUSAL, BLOCK_M)
    bh, b, h = _program_head(H)
    kv_h = h // GROUP  # the key/value head this query head reads
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM  # no mask along the head dim
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < TQ
    q_mask = row_ok[:, None] if EVEN_D else row_ok[:, None] & d_ok[None, :]
    Q += b * stride_qb + h * stride_qh
    q = tl.load(_tile(Q, offs_m, offs_d, stride_qt, stride_qd), mask=q_mask, other=0.0)
    # key block 0, transposed (BLOCK_D, BLOCK_N), and value block 0 (BLOCK_N, BLOCK_D)
    kt_ptrs = _tile(K + b * stride_kb + kv_h * stride_kh, offs_d, offs_n, stride_kd, stride_kt)
    v_ptrs = _tile(V + b * stride_vb + kv_h * stride_vh, offs_n, offs_d, stride_vt, stride_vd)
    q_pos = offs_m + TK - TQ  # (BLOCK_M,) key position of each query (bottom-right aligned)
    lo, n_full, end = _key_passes(start_m, TQ, TK, CAUSAL, BLOCK_M, BLOCK_N, WINDOWED, WINDOW)

    acc, l_i, m_i = softmax_init(BLOCK_M, BLOCK_D)
    for MASKED in tl.static_range(2):
        first, last = (n_full, end) if MASKED else (lo, n_full)
        for start_n in range(first, last, BLOCK_N):
            kn = start_n + offs_n  # (BLOCK_N,) key positions
            kv_ok = kn < TK
            kt_mask = kv_ok[None, :] if EVEN_D else kv_ok[None, :] & d_ok[:, None]
            v_mask = kv_ok[:, None] if EVEN_D else kv_ok[:, None] & d_ok[None, :]
            kt = tl.load(kt_ptrs + start_n * stride_kt, mask=kt_mask, other=0.0)
            s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
            if MASKED:
                ok = kv_ok[None, :]
                if CAUSAL:
                    ok = ok & (kn[None, :] <= q_pos[:, None])
                if WINDOWED:
                    ok = ok & (kn[None, :] > q_pos[:, None] - WINDOW)
                s = tl.where(ok, s, float("-inf"))
            v_tile = v_ptrs + start_n * stride_vt
            acc, l_i, m_i = softmax_update(acc, l_i, m_i, s, v_tile, v_mask, DOT_PREC)
    # a row that sees no key at all (causal with TQ > TK) outputs 0, and its LSE is +inf so that
    # the backward's exp2(s - lse) is 0 for it
    out, lse = softmax_finish(acc, l_i, m_i, float("inf"))
    tl.store(LSE + bh * TQ + offs_m, lse, mask=row_ok)
    o_ptrs = _tile(O + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_ot, stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_db, stride_dh, stride_dt, stride_dd,
    H, TQ,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh, b, h = _program_head(H)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < TQ) & (offs_d[None, :] < HEAD_DIM)
    O += b * stride_ob + h * stride_oh
    DO += b * stride_db + h * stride_dh
    o = tl.load(_tile(O, offs_m, offs_d, stride_ot, stride_od), mask=mask, other=0.0)
    do = tl.load(_tile(DO, offs_m, offs_d, stride_dt, stride_dd), mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA + bh * TQ + offs_m, delta, mask=offs_m < TQ)


@triton.jit
def _flash_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_db, stride_dh, stride_dt, stride_dd,
    H, TQ, TK, sm_scale, qk_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, DQ_PASS: tl.constexpr, GROUP: tl.constexpr,
    WINDOWED: tl.constexpr, WINDOW,
):  # fmt: skip
    """dQ of one query block of one query head (DQ_PASS, grid axis 0 over batch * H, axis 1 over
    query blocks) or dK and dV of one key block of one KV head (axis 0 over batch * H // GROUP,
    axis 1 over key blocks), summed over the GROUP query heads that read it. dQ (B, H, TQ, D),
    dK and dV (B, H // GROUP, TK, D) are contiguous; LSE and DELTA are (B * H, TQ)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    shift = TK - TQ  # bottom-right alignment: query row i sits at key position i + shift

    if DQ_PASS:
        bh, b, h = _program_head(H)
        kv_h = h // GROUP
        Q += b * stride_qb + h * stride_qh
        DO += b * stride_db + h * stride_dh
        K += b * stride_kb + kv_h * stride_kh
        V += b * stride_vb + kv_h * stride_vh
        start_m = _query_block(CAUSAL, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) this program's queries
        offs_n = tl.arange(0, BLOCK_N)
        m_ok = offs_m < TQ
        qd_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(_tile(Q, offs_m, offs_d, stride_qt, stride_qd), mask=qd_mask, other=0.0)
        do = tl.load(_tile(DO, offs_m, offs_d, stride_dt, stride_dd), mask=qd_mask, other=0.0)
        lse = tl.load(LSE + bh * TQ + offs_m, mask=m_ok, other=0.0)  # (BLOCK_M,)
        delta = tl.load(DELTA + bh * TQ + offs_m, mask=m_ok, other=0.0)
        # key and value block 0, both transposed: (BLOCK_D, BLOCK_N)
        kt_ptrs = _tile(K, offs_d, offs_n, stride_kd, stride_kt)
        vt_ptrs = _tile(V, offs_d, offs_n, stride_vd, stride_vt)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lo, n_full, end = _key_passes(start_m, TQ, TK, CAUSAL, BLOCK_M, BLOCK_N, WINDOWED, WINDOW)
        for MASKED in tl.static_range(2):  # the forward's passes: unmasked, then the diagonal
            first, last = (n_full, end) if MASKED else (lo, n_full)
            for start_n in range(first, last, BLOCK_N):
                kn = start_n + offs_n  # (BLOCK_N,) key positions
                n_ok = kn < TK
                kv_mask = n_ok[None, :] & d_ok[:, None]
                kt = tl.load(kt_ptrs + start_n * stride_kt, mask=kv_mask, other=0.0)
                vt = tl.load(vt_ptrs + start_n * stride_vt, mask=kv_mask, other=0.0)
                s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
                p = tl.exp2(s - lse[:, None])
                if MASKED:
                    ok = n_ok[None, :]
                    if CAUSAL:
                        ok = ok & (kn[None, :] <= offs_m[:, None] + shift)
                    if WINDOWED:
                        ok = ok & (kn[None, :] > offs_m[:, None] + shift - WINDOW)
                    p = tl.where(ok, p, 0.0)
                dp = tl.dot(do, vt, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PREC)
        dq *= sm_scale
        dq_ptrs = _tile(DQ + bh * TQ * HEAD_DIM, offs_m, offs_d, HEAD_DIM, 1)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=qd_mask)
    else:
        bkv, b, kv_h = _program_head(H // GROUP)
        K += b * stride_kb + kv_h * stride_kh
        V += b * stride_vb + kv_h * stride_vh
        start_n = tl.program_id(1) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) this program's keys
        offs_m = tl.arange(0, BLOCK_M)
        kv_mask = (offs_n < TK)[:, None] & d_ok[None, :]
        k = tl.load(_tile(K, offs_n, offs_d, stride_kt, stride_kd), mask=kv_mask, other=0.0)
        v = tl.load(_tile(V, offs_n, offs_d, stride_vt, stride_vd), mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        # causal: query blocks before `lo` see none of these keys, those in [lo, mid) some of
        # them (the masked pass, first) and those from `mid` on all of them. Keys past TK and
        # queries past TQ need no mask: their K, V, Q, dO load as 0, so they only touch rows of
        # dK and dV that are never stored.
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M if CAUSAL else 0
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
        mid = mid if CAUSAL else 0
        if WINDOWED:  # query rows up to the last one whose window holds the block's last key
            mid = tl.minimum(
                tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift + WINDOW, 0), BLOCK_M) * BLOCK_M,
                tl.cdiv(TQ, BLOCK_M) * BLOCK_M,
            )
        for j in range(GROUP):  # the query heads that read this KV head add up in dk, dv
            h = kv_h * GROUP + j
            bh = b * H + h
            q_head, do_head = Q + b * stride_qb + h * stride_qh, DO + b * stride_db + h * stride_dh
            # query block 0 of this head's Q and dO: (BLOCK_M, BLOCK_D)
            q_ptrs = _tile(q_head, offs_m, offs_d, stride_qt, stride_qd)
            do_ptrs = _tile(do_head, offs_m, offs_d, stride_dt, stride_dd)
            for MASKED in tl.static_range(CAUSAL, -1, -1):  # causal: 1 then 0; otherwise 0 alone
                first, last = (lo, tl.minimum(mid, TQ)) if MASKED else (mid, TQ)
                if WINDOWED and not MASKED:  # every row the window reaches took the mask
                    first, last = TQ, TQ
                for start_m in range(first, last, BLOCK_M):
                    rows = start_m + offs_m  # (BLOCK_M,)
                    m_ok = rows < TQ
                    qd_mask = m_ok[:, None] & d_ok[None, :]
                    q = tl.load(q_ptrs + start_m * stride_qt, mask=qd_mask, other=0.0)
                    do = tl.load(do_ptrs + start_m * stride_dt, mask=qd_mask, other=0.0)
                    lse = tl.load(LSE + bh * TQ + rows, mask=m_ok, other=0.0)  # (BLOCK_M,)
                    delta = tl.load(DELTA + bh * TQ + rows, mask=m_ok, other=0.0)
                    st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (N, M)
                    pt = tl.exp2(st - lse[None, :])  # P^T (BLOCK_N, BLOCK_M)
                    if MASKED:
                        ok = offs_n[:, None] <= rows[None, :] + shift
                        if WINDOWED:
                            ok = ok & (offs_n[:, None] > rows[None, :] + shift - WINDOW)
                        pt = tl.where(ok, pt, 0.0)
                    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
                    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
                    dst = pt * (dpt - delta[None, :])
                    dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
        dk *= sm_scale
        dkv_offsets = _tile(bkv * TK * HEAD_DIM, offs_n, offs_d, HEAD_DIM, 1)  # (BLOCK_N, BLOCK_D)
        tl.store(DK + dkv_offsets, dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + dkv_offsets, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _fwd_config(head_dim: int, dtype: torch.dtype) -> Config:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward; not yet tuned on a GPU."""
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    if head_dim <= 64:
        return (64, 64, 4, 3) if wide else (128, 64, 4, 3)
    if head_dim <= 128:
        return (64, 32, 4, 2) if wide else (128, 64, 8, 3)
    return (32, 32, 4, 1) if wide else (64, 32, 4, 2)


def _bwd_config(head_dim: int, dtype: torch.dtype) -> Config:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the backward kernels."""
    wide = dtype == torch.float32
    if head_dim <= 64:
        return (32, 32, 4, 2) if wide else (64, 64, 4, 2)
    if head_dim <= 128:
        return (32, 32, 4, 1) if wide else (64, 64, 8, 2)
    return (16, 16, 4, 1) if wide else (32, 32, 4, 1)


def _launch_options(
    q: torch.Tensor, k: torch.Tensor, causal: bool, config: Callable[[int, torch.dtype], Config],
    blocks: tuple[int, int] | None, window: int | None = None,
) -> dict:  # fmt: skip
    """The constexprs and launch options of the forward, dK/dV and dQ kernels."""
    head_dim = q.shape[3]
    block_m, block_n, warps, stages = config(head_dim, q.dtype)
    if blocks is not None:
        block_m, block_n = blocks
    return dict(
        CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), DOT_PREC=dot_precision(q.dtype),
        GROUP=q.shape[1] // k.shape[1], num_warps=warps, num_stages=stages,
        WINDOWED=window is not None, WINDOW=window or 0,
    )  # fmt: skip


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, blocks, window):  # noqa: ANN001 - autograd signature
        B, H, TQ, D = q.shape
        TK = k.shape[2]
        opts = _launch_options(q, k, causal, _fwd_config, blocks, window)
        o = torch.empty((B, H, TQ, D), device=q.device, dtype=q.dtype)  # contiguous
        lse = torch.empty((B * H, TQ), device=q.device, dtype=torch.float32)  # base-2 LSE
        grid = (B * H, triton.cdiv(TQ, opts["BLOCK_M"]))  # heads on axis 0: no 65535 limit
        _flash_fwd_kernel[grid](
            q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            H, TQ, TK, sm_scale * LOG2E, **opts,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.sm_scale = sm_scale
        ctx.blocks = blocks
        ctx.window = window
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001 - autograd signature
        q, k, v, o, lse = ctx.saved_tensors
        B, H, TQ, D = q.shape
        H_KV, TK = k.shape[1:3]
        opts = _launch_options(q, k, ctx.causal, _bwd_config, ctx.blocks, ctx.window)
        block_m, block_n = opts["BLOCK_M"], opts["BLOCK_N"]
        delta = torch.empty_like(lse)  # (B * H, TQ) fp32
        _bwd_preprocess_kernel[(B * H, triton.cdiv(TQ, block_m))](
            o, do, delta, *o.stride(), *do.stride(), H, TQ,
            HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=opts["BLOCK_D"],
        )  # fmt: skip
        dq = torch.empty((B, H, TQ, D), device=q.device, dtype=q.dtype)
        dk = torch.empty((B, H_KV, TK, D), device=k.device, dtype=k.dtype)
        dv = torch.empty((B, H_KV, TK, D), device=v.device, dtype=v.dtype)
        args = (q, k, v, do, dq, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride())
        args += (*do.stride(), H, TQ, TK, ctx.sm_scale, ctx.sm_scale * LOG2E)
        # dK, dV: a program per key block of each KV head, summing its group's query heads
        _flash_bwd_kernel[(B * H_KV, triton.cdiv(TK, block_n))](*args, DQ_PASS=False, **opts)
        _flash_bwd_kernel[(B * H, triton.cdiv(TQ, block_m))](*args, DQ_PASS=True, **opts)
        return dq, dk, dv, None, None, None, None


def triton_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    sm_scale: float | None = None, *, enable_gqa: bool = False,
    blocks: tuple[int, int] | None = None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * sm_scale) v with q (B, H, Tq, D), k and v (B, H_kv, Tk, D);
    differentiable. H_kv is H unless `enable_gqa` (as in F.scaled_dot_product_attention): then H
    is a multiple of H_kv and query head h reads KV head h // (H // H_kv).

    Causal masks are bottom-right aligned (the same as the reference when Tq != Tk). Head dims up
    to 256, any lengths, fp16/bf16/fp32 (fp32 math inside). `blocks=(BLOCK_M, BLOCK_N)` overrides
    the tile sizes of every kernel (tests use small tiles to cross many block boundaries).
    `window` (causal only): query position p sees keys p - window < j <= p (`kernels.window`).
    """
    check_window(window, causal)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, H, T, D)")
    heads_ok = (
        q.shape[1] % k.shape[1] == 0 if enable_gqa and k.shape[1] else q.shape[1] == k.shape[1]
    )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or not heads_ok:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k, v must share a dtype")
    if q.shape[3] > 256:
        raise ValueError(f"head dim {q.shape[3]} > 256 is not supported")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttention.apply(q, k, v, causal, float(scale), blocks, window)
