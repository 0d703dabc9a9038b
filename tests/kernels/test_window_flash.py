"""Sliding-window attention in the full (training) forward: the reference against a per-query
loop over each window, `flash_attention`'s fallback and the Triton flash kernel (forward and
backward) against the reference."""

from __future__ import annotations

import math

import pytest
import torch
from gptserve.kernels import flash_attention
from gptserve.kernels.reference import attention_reference

from tests.kernels.kernel_testing import TOLERANCE, rel_error


def _inputs(B, H, H_kv, T, D, seed=0, Tk=None):
    gen = torch.Generator().manual_seed(seed)
    Tk = T if Tk is None else Tk
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, H_kv, Tk, D, generator=gen)
    v = torch.randn(B, H_kv, Tk, D, generator=gen)
    return q, k, v


def _per_query(q, k, v, window):
    """Each query's softmax over the keys of its window alone, sliced out one query at a time."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    shift = k.shape[2] - T
    out = torch.empty_like(q)
    for t in range(T):
        p = t + shift
        keys = slice(max(0, p - window + 1), p + 1)  # p - window < j <= p
        for h in range(H):
            kk, vv = k[:, h // group, keys], v[:, h // group, keys]  # (B, w, D)
            w = torch.softmax(q[:, h, t, None] @ kk.transpose(1, 2) / math.sqrt(D), -1)
            out[:, h, t] = (w @ vv)[:, 0]
    return out


@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_reference_window_is_each_querys_last_keys(window, heads):
    q, k, v = _inputs(2, *heads, 19, 8)
    got = attention_reference(q, k, v, window=window)
    assert torch.allclose(got, _per_query(q, k, v, window), atol=1e-5)
    if window < 19:  # the window changes the answer
        assert not torch.allclose(got, attention_reference(q, k, v), atol=1e-3)


def test_reference_window_bottom_right_aligned():
    q, k, v = _inputs(1, 2, 2, 5, 8, Tk=12)  # 5 new queries after 7 cached keys
    assert torch.allclose(attention_reference(q, k, v, window=4), _per_query(q, k, v, 4), atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_flash_attention_fallback_window(window):
    q, k, v = _inputs(2, 4, 2, 23, 16)
    got = flash_attention(q, k, v, window=window)
    assert torch.allclose(got, attention_reference(q, k, v, window=window), atol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_window_is_refused(bad):
    q, k, v = _inputs(1, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=bad)
    with pytest.raises(ValueError, match="window"):
        attention_reference(q, k, v, window=bad)


def test_window_needs_causal():
    q, k, v = _inputs(1, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="causal"):
        flash_attention(q, k, v, causal=False, window=2)


# (H, H_kv, T, D, window, blocks): windows of one key, inside one tile, spanning tiles
TRITON_CASES = [
    pytest.param(2, 2, 21, 16, 1, (16, 16), id="w1"),
    pytest.param(2, 1, 37, 16, 5, (16, 16), id="w5-gqa"),
    pytest.param(2, 2, 45, 16, 20, (16, 8), id="w20-tiles16x8"),
    pytest.param(1, 1, 30, 32, 100, (16, 16), id="w-past-T"),
]


@pytest.mark.parametrize("H,H_kv,T,D,window,blocks", TRITON_CASES)
def test_triton_flash_window_forward_backward(H, H_kv, T, D, window, blocks, dtype, device):
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")
    from gptserve.kernels.triton.flash import triton_flash_attention

    q, k, v = (t.to(device, dtype).requires_grad_() for t in _inputs(1, H, H_kv, T, D))
    out = triton_flash_attention(
        q, k, v, enable_gqa=H != H_kv, blocks=blocks, window=window
    )  # (1, H, T, D)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q32, k32, v32, window=window)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    assert rel_error(out, ref) < TOLERANCE[dtype]
    for got, expect in zip(grads, want):  # window 1: dq is 0 (one key), so no relative error
        diff = float((got.float() - expect).abs().max())
        assert diff < 2 * TOLERANCE[dtype] * max(1.0, float(expect.abs().max()))
