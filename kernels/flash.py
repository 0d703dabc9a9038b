"""Fused attention in Triton: forward with an online softmax, backward for dQ, dK and dV.

Layout: q (B, H, Tq, D), k and v (B, H, Tk, D), any strides (the model hands in transposed
views). One program owns BLOCK_M queries of one (batch, head) and walks over key blocks, keeping
a running max `m`, a running denominator `l` and an fp32 accumulator. The causal mask is
bottom-right aligned (query i sees keys 0 .. i + Tk - Tq); key blocks entirely above the diagonal
are never visited (the loop bound stops before them), and blocks entirely below it run without
a mask.

The forward stores the log-sum-exp of every row (base 2, scores pre-multiplied by log2(e)) so the
backward can rebuild the probabilities without a second softmax pass:
  preprocess: delta = rowsum(dO * O)
  dK, dV:     one program per key block, looping over the query blocks that can see it
  dQ:         one program per query block, looping over the key blocks it sees
Two backward kernels instead of one with atomics: deterministic, and no fp32 dQ scratch buffer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The running max starts finite: a row whose first tiles are fully masked then gets
# exp2(-inf - NEG_BIG) = 0 instead of exp2(-inf - -inf) = NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    offs_n,
    offs_d,
    q_pos,
    lo,
    hi,
    TK,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        kn = start_n + offs_n  # (BLOCK_N,)
        kv_ok = kn < TK
        if EVEN_D:
            kt_mask = kv_ok[None, :]
            v_mask = kv_ok[:, None]
        else:
            kt_mask = kv_ok[None, :] & (offs_d[:, None] < HEAD_DIM)
            v_mask = kv_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        kt = tl.load(
            K + offs_d[:, None] * stride_kd + kn[None, :] * stride_kt, mask=kt_mask, other=0.0
        )  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            ok = kv_ok[None, :]
            if CAUSAL:
                ok = ok & (kn[None, :] <= q_pos[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + kn[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=v_mask, other=0.0
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    H,
    TQ,
    TK,
    qk_scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(1)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        pid_m = tl.num_programs(1) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < TQ
    if EVEN_D:
        q_mask = row_ok[:, None]
    else:
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        Q + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0
    )  # (BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    shift = TK - TQ  # bottom-right alignment: query row i sits at key position i + shift
    q_pos = offs_m + shift
    full_tk = (TK // BLOCK_N) * BLOCK_N  # keys in whole blocks
    if CAUSAL:
        # blocks whose every key is <= the first query's position need no mask
        n_full = tl.minimum(tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N, full_tk)
        # nothing beyond the last real query's position is visited at all
        hi = tl.minimum(TK, tl.minimum(start_m + BLOCK_M, TQ) + shift)
    else:
        n_full = full_tk
        hi = TK
    acc, l_i, m_i = _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        K,
        V,
        stride_kt,
        stride_kd,
        stride_vt,
        stride_vd,
        offs_n,
        offs_d,
        q_pos,
        0,
        n_full,
        TK,
        qk_scale,
        False,
        CAUSAL,
        EVEN_D,
        HEAD_DIM,
        BLOCK_N,
        DOT_PREC,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        K,
        V,
        stride_kt,
        stride_kd,
        stride_vt,
        stride_vd,
        offs_n,
        offs_d,
        q_pos,
        n_full,
        hi,
        TK,
        qk_scale,
        True,
        CAUSAL,
        EVEN_D,
        HEAD_DIM,
        BLOCK_N,
        DOT_PREC,
    )
    # rows that saw no key at all (only possible when causal and TQ > TK) give 0, not NaN
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    # +inf for rows without keys: the backward's exp2(s - lse) is then 0 for them
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("inf"))
    tl.store(LSE + bh.to(tl.int64) * TQ + offs_m, lse, mask=row_ok)
    tl.store(
        O + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
        out.to(O.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit
def _bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    stride_db,
    stride_dh,
    stride_dt,
    stride_dd,
    H,
    TQ,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(1) * BLOCK_M
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < TQ) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        O
        + b * stride_ob
        + h * stride_oh
        + offs_m[:, None] * stride_ot
        + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO
        + b * stride_db
        + h * stride_dh
        + offs_m[:, None] * stride_dt
        + offs_d[None, :] * stride_dd,
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA + bh.to(tl.int64) * TQ + offs_m, delta, mask=offs_m < TQ)


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    stride_qt,
    stride_qd,
    stride_dt,
    stride_dd,
    offs_n,
    offs_m0,
    offs_d,
    d_ok,
    lo,
    hi,
    TQ,
    shift,
    qk_scale,
    CAUSAL_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < TQ
        qd_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(
            Q + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=qd_mask, other=0.0
        )  # (BLOCK_M, BLOCK_D)
        do = tl.load(
            DO + offs_m[:, None] * stride_dt + offs_d[None, :] * stride_dd, mask=qd_mask, other=0.0
        )
        lse = tl.load(LSE + offs_m, mask=m_ok, other=0.0)  # (BLOCK_M,)
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (BLOCK_N, BLOCK_M)
        pt = tl.exp2(st - lse[None, :])  # P^T
        if CAUSAL_MASK:
            pt = tl.where(offs_n[:, None] <= offs_m[None, :] + shift, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_db,
    stride_dh,
    stride_dt,
    stride_dd,
    H,
    TQ,
    TK,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    start_n = tl.program_id(1) * BLOCK_N
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_db + h * stride_dh
    row0 = bh.to(tl.int64) * TQ
    LSE += row0
    DELTA += row0

    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < TK
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(
        K + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
    )  # (BLOCK_N, BLOCK_D)
    v = tl.load(
        V + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    shift = TK - TQ
    if CAUSAL:
        # query blocks before `lo` see none of these keys; from `mid` on they see all of them
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_tiles(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            stride_qt,
            stride_qd,
            stride_dt,
            stride_dd,
            offs_n,
            offs_m0,
            offs_d,
            d_ok,
            lo,
            tl.minimum(mid, TQ),
            TQ,
            shift,
            qk_scale,
            True,
            BLOCK_M,
            DOT_PREC,
        )
    else:
        mid = 0
    # keys past TK and queries past TQ need no mask here: their K, V, Q, dO load as 0, so they
    # only touch rows of dK and dV that are never stored
    dk, dv = _dkdv_tiles(
        dk,
        dv,
        k,
        v,
        Q,
        DO,
        LSE,
        DELTA,
        stride_qt,
        stride_qd,
        stride_dt,
        stride_dd,
        offs_n,
        offs_m0,
        offs_d,
        d_ok,
        mid,
        TQ,
        TQ,
        shift,
        qk_scale,
        False,
        BLOCK_M,
        DOT_PREC,
    )
    dk *= sm_scale
    tl.store(
        DK + bh.to(tl.int64) * TK * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + bh.to(tl.int64) * TK * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse,
    delta,
    K,
    V,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    offs_m,
    offs_n0,
    offs_d,
    d_ok,
    lo,
    hi,
    TK,
    shift,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < TK
        kv_mask = n_ok[None, :] & d_ok[:, None]
        kt = tl.load(
            K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt, mask=kv_mask, other=0.0
        )  # (BLOCK_D, BLOCK_N)
        vt = tl.load(
            V + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vt, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            ok = n_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None] + shift)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_db,
    stride_dh,
    stride_dt,
    stride_dd,
    H,
    TQ,
    TK,
    sm_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(1)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        pid_m = tl.num_programs(1) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_db + h * stride_dh
    row0 = bh.to(tl.int64) * TQ

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < TQ
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(
        Q + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=qd_mask, other=0.0
    )  # (BLOCK_M, BLOCK_D)
    do = tl.load(
        DO + offs_m[:, None] * stride_dt + offs_d[None, :] * stride_dd, mask=qd_mask, other=0.0
    )
    lse = tl.load(LSE + row0 + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row0 + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    shift = TK - TQ
    full_tk = (TK // BLOCK_N) * BLOCK_N
    if CAUSAL:  # same split as the forward: unmasked below the diagonal, masked along it
        n_full = tl.minimum(tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N, full_tk)
        hi = tl.minimum(TK, tl.minimum(start_m + BLOCK_M, TQ) + shift)
    else:
        n_full = full_tk
        hi = TK
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse,
        delta,
        K,
        V,
        stride_kt,
        stride_kd,
        stride_vt,
        stride_vd,
        offs_m,
        offs_n0,
        offs_d,
        d_ok,
        0,
        n_full,
        TK,
        shift,
        qk_scale,
        False,
        CAUSAL,
        BLOCK_N,
        DOT_PREC,
    )
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse,
        delta,
        K,
        V,
        stride_kt,
        stride_kd,
        stride_vt,
        stride_vd,
        offs_m,
        offs_n0,
        offs_d,
        d_ok,
        n_full,
        hi,
        TK,
        shift,
        qk_scale,
        True,
        CAUSAL,
        BLOCK_N,
        DOT_PREC,
    )
    dq *= sm_scale
    tl.store(
        DQ + row0 * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=qd_mask,
    )


def _fwd_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward; not yet tuned on a GPU."""
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    if head_dim <= 64:
        return (64, 64, 4, 3) if wide else (128, 64, 4, 3)
    if head_dim <= 128:
        return (64, 32, 4, 2) if wide else (128, 64, 8, 3)
    return (32, 32, 4, 1) if wide else (64, 32, 4, 2)


def _bwd_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the backward kernels."""
    wide = dtype == torch.float32
    if head_dim <= 64:
        return (32, 32, 4, 2) if wide else (64, 64, 4, 2)
    if head_dim <= 128:
        return (32, 32, 4, 1) if wide else (64, 64, 8, 2)
    return (16, 16, 4, 1) if wide else (32, 32, 4, 1)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to TF32 on tensor cores (~1e-3 relative error); keep them exact
    return "ieee" if dtype == torch.float32 else "tf32"


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, blocks):  # noqa: ANN001 - autograd signature
        B, H, TQ, D = q.shape
        TK = k.shape[2]
        block_m, block_n, warps, stages = _fwd_config(D, q.dtype)
        if blocks is not None:
            block_m, block_n = blocks
        block_d = max(16, triton.next_power_of_2(D))
        o = torch.empty((B, H, TQ, D), device=q.device, dtype=q.dtype)  # contiguous
        lse = torch.empty((B * H, TQ), device=q.device, dtype=torch.float32)  # base-2 LSE
        grid = (B * H, triton.cdiv(TQ, block_m))  # heads on axis 0: no 65535 limit
        _flash_fwd_kernel[grid](
            q,
            k,
            v,
            o,
            lse,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *o.stride(),
            H,
            TQ,
            TK,
            sm_scale * LOG2E,
            CAUSAL=causal,
            HEAD_DIM=D,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DOT_PREC=_dot_precision(q.dtype),
            num_warps=warps,
            num_stages=stages,
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.sm_scale = sm_scale
        ctx.blocks = blocks
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001 - autograd signature
        q, k, v, o, lse = ctx.saved_tensors
        B, H, TQ, D = q.shape
        TK = k.shape[2]
        block_m, block_n, warps, stages = _bwd_config(D, q.dtype)
        if ctx.blocks is not None:
            block_m, block_n = ctx.blocks
        block_d = max(16, triton.next_power_of_2(D))
        delta = torch.empty_like(lse)  # (B * H, TQ) fp32
        _bwd_preprocess_kernel[(B * H, triton.cdiv(TQ, block_m))](
            o,
            do,
            delta,
            *o.stride(),
            *do.stride(),
            H,
            TQ,
            HEAD_DIM=D,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
        )
        dq = torch.empty((B, H, TQ, D), device=q.device, dtype=q.dtype)
        dk = torch.empty((B, H, TK, D), device=k.device, dtype=k.dtype)
        dv = torch.empty((B, H, TK, D), device=v.device, dtype=v.dtype)
        common = dict(
            CAUSAL=ctx.causal,
            HEAD_DIM=D,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DOT_PREC=_dot_precision(q.dtype),
            num_warps=warps,
            num_stages=stages,
        )
        strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
        scales = (H, TQ, TK, ctx.sm_scale, ctx.sm_scale * LOG2E)
        _bwd_dkdv_kernel[(B * H, triton.cdiv(TK, block_n))](
            q, k, v, do, dk, dv, lse, delta, *strides, *scales, **common
        )
        _bwd_dq_kernel[(B * H, triton.cdiv(TQ, block_m))](
            q, k, v, do, dq, lse, delta, *strides, *scales, **common
        )
        return dq, dk, dv, None, None, None


def triton_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    *,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v with q (B, H, Tq, D), k and v (B, H, Tk, D); differentiable.

    Causal masks are bottom-right aligned (the same as the reference when Tq != Tk). Head dims up
    to 256, any lengths, fp16/bf16/fp32 (fp32 math inside). `blocks=(BLOCK_M, BLOCK_N)` overrides
    the tile sizes of every kernel (tests use small tiles to cross many block boundaries).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, H, T, D)")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k, v must share a dtype")
    if q.shape[3] > 256:
        raise ValueError(f"head dim {q.shape[3]} > 256 is not supported")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttention.apply(q, k, v, causal, float(scale), blocks)
