"""Triton flash attention (forward and backward) against the PyTorch reference and SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from gptserve.kernels.reference import attention_reference  # noqa: E402
from gptserve.kernels.triton.flash import triton_flash_attention  # noqa: E402

from tests.kernels.kernel_testing import TOLERANCE, rel_error  # noqa: E402

# (B, H, T, D, causal, blocks): blocks=None uses the tuned tiles, small tiles cross many
# block boundaries with the interpreter's few programs; BLOCK_M != BLOCK_N puts fully masked
# tiles next to the diagonal.
CASES = [
    pytest.param(1, 2, 1, 16, True, None, id="T1-d16"),
    pytest.param(2, 2, 37, 48, True, None, id="T37-d48-below-one-block"),
    pytest.param(1, 2, 100, 80, True, (32, 16), id="T100-d80-tiles32x16"),
    pytest.param(2, 1, 77, 64, False, (16, 32), id="T77-d64-noncausal-tiles16x32"),
    pytest.param(1, 2, 130, 48, True, (64, 64), id="T130-d48-tiles64"),
    pytest.param(1, 1, 50, 48, False, None, id="T50-d48-noncausal"),
]


def _inputs(B, H, T, D, dtype, device, Tk=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Tk = T if Tk is None else Tk
    q = torch.randn(B, H, T, D, generator=gen).to(device, dtype)
    k = torch.randn(B, H, Tk, D, generator=gen).to(device, dtype)
    v = torch.randn(B, H, Tk, D, generator=gen).to(device, dtype)
    return q, k, v


@pytest.mark.parametrize("B,H,T,D,causal,blocks", CASES)
def test_forward_matches_reference_and_sdpa(B, H, T, D, causal, blocks, dtype, device):
    q, k, v = _inputs(B, H, T, D, dtype, device)
    out = triton_flash_attention(q, k, v, causal=causal, blocks=blocks)  # (B, H, T, D)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = attention_reference(q, k, v, causal=causal).float()
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert rel_error(out, ref) < TOLERANCE[dtype]
    assert rel_error(out, sdpa) < TOLERANCE[dtype]


@pytest.mark.parametrize("B,H,T,D,causal,blocks", CASES)
def test_backward_matches_reference_autograd(B, H, T, D, causal, blocks, dtype, device):
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, T, D, dtype, device))
    out = triton_flash_attention(q, k, v, causal=causal, blocks=blocks)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q32, k32, v32, causal=causal)
    rq, rk, rv = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert got.dtype == dtype
        if T == 1 and name != "dv":  # one key: the softmax is constant, dq = dk = 0 (rounding)
            assert got.float().abs().max() < 1e-3
            continue
        assert rel_error(got, want) < 2 * TOLERANCE[dtype], name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("Tk", [53, 33])
def test_different_query_and_key_lengths(causal, Tk, device):
    # cross-attention shapes; causal is bottom-right aligned, as in the reference. With Tk - Tq
    # = 14 and 16-wide tiles the diagonal's first key sits one row before a tile boundary: an
    # off-by-one in where the unmasked tiles start shows up as a wrong gradient or output.
    q, k, v = _inputs(2, 2, 19, 48, torch.float32, device, Tk=Tk)
    for t in (q, k, v):
        t.requires_grad_()
    out = triton_flash_attention(q, k, v, causal=causal, blocks=(16, 16))
    ref = attention_reference(q, k, v, causal=causal)
    assert rel_error(out, ref) < 1e-3
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out)
    for g, w in zip(got, want):
        assert rel_error(g, w) < 2e-3


def test_queries_before_the_first_key_give_zero(device):
    # causal with Tq > Tk: bottom-right alignment leaves the first Tq - Tk queries no key at all.
    # The kernel defines their output as 0 (the reference's softmax gives NaN there); every
    # other row must match, and no NaN may appear anywhere.
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 40, 16, torch.float32, device, Tk=24))
    # 32-row tiles: rows 0..15 share a tile with rows that do see keys, so they meet masked tiles
    out = triton_flash_attention(q, k, v, causal=True, blocks=(32, 16))
    assert torch.isfinite(out).all()
    assert out[:, :, :16].abs().max() == 0
    # the other 24 rows are ordinary causal attention over the 24 keys
    ref = attention_reference(q[:, :, 16:], k, v, causal=True)
    assert rel_error(out[:, :, 16:], ref) < 1e-3
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dq[:, :, :16].abs().max() == 0
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad_out[:, :, 16:])
    assert rel_error(dq[:, :, 16:], rq[:, :, 16:]) < 2e-3
    assert rel_error(dk, rk) < 2e-3
    assert rel_error(dv, rv) < 2e-3


def test_strided_views_like_the_model(device):
    # the model hands in (B, T, H, D) slices of one qkv tensor transposed to (B, H, T, D)
    B, T, H, D = 2, 45, 3, 32
    qkv = torch.randn(B, T, 3, H, D, generator=torch.Generator().manual_seed(2)).to(device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D), strided
    assert not q.is_contiguous()
    out = triton_flash_attention(q, k, v, causal=True, blocks=(16, 16))
    assert rel_error(out, attention_reference(q, k, v)) < 1e-3


@pytest.mark.parametrize("D", [128, 256])
def test_large_head_dims(D, device):
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 24, D, torch.float32, device))
    out = triton_flash_attention(q, k, v, causal=True)
    ref = attention_reference(q, k, v)
    assert rel_error(out, ref) < 1e-3
    grad_out = torch.randn_like(out)
    for g, w in zip(
        torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)
    ):
        assert rel_error(g, w) < 2e-3


def test_large_scores_stay_finite(device):
    # scores in the hundreds: the online softmax must rescale, not overflow
    q, k, v = _inputs(1, 2, 70, 16, torch.float32, device)
    q = q * 30.0
    out = triton_flash_attention(q, k, v, causal=True, sm_scale=0.5, blocks=(16, 16))
    ref = attention_reference(q, k, v, causal=True, sm_scale=0.5)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < 1e-3


def test_rejects_bad_shapes(device):
    q, k, v = _inputs(1, 2, 8, 16, torch.float32, device)
    with pytest.raises(ValueError):
        triton_flash_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError):
        triton_flash_attention(q[0], k[0], v[0])
