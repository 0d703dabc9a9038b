"""The online softmax that the flash forward and the paged kernel share.

A program owns BLOCK_M query rows and folds key tiles, one at a time, into three fp32 running
values: the row max `m`, the denominator `l` and the output accumulator `acc`. Scores come in
already multiplied by sm_scale * log2(e), so everything is in base 2 and the kernels use `exp2`.

The running max starts at -1e30, not -inf: a row whose first tiles are fully masked then gets
exp2(-inf - -1e30) = 0 instead of exp2(-inf - -inf) = NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots would default to TF32 on tensor cores (~1e-3 relative error): keep them exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def softmax_init(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(acc, l, m) before the first tile: (BLOCK_M, BLOCK_D), (BLOCK_M,), (BLOCK_M,)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    return acc, l_i, m_i


@triton.jit
def softmax_update(acc, l_i, m_i, s, v_ptrs, v_mask, DOT_PREC: tl.constexpr):
    """Fold one key tile into (acc, l, m) and return them.

    s: (BLOCK_M, BLOCK_N) scores in log2 units, -inf where masked. The tile's values are loaded
    from v_ptrs (BLOCK_N, BLOCK_D) once the probabilities are known; masked loads read 0, so
    garbage in unused cache slots never reaches the sum.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N); masked entries are exactly 0
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def softmax_finish(acc, l_i, m_i, EMPTY_LSE: tl.constexpr):
    """(out (BLOCK_M, BLOCK_D) fp32, lse (BLOCK_M,) base 2); rows that saw no key: 0, EMPTY_LSE."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), EMPTY_LSE)
    return out, lse
