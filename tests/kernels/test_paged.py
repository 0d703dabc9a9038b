"""Triton paged attention against `paged_attention_reference`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from gptserve.kernels.reference import paged_attention_reference  # noqa: E402
from gptserve.kernels.triton.paged import triton_paged_attention  # noqa: E402

from tests.kernels.kernel_testing import TOLERANCE, paged_batch, rel_error  # noqa: E402


def _check(args, dtype, **kw):
    """args: (q, k_cache, v_cache, meta) from paged_batch."""
    out = triton_paged_attention(*args, **kw)  # (N, H, D)
    ref = paged_attention_reference(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "garbage or a fully masked tile leaked into the output"
    assert rel_error(out, ref) < TOLERANCE[dtype]
    return out


# decode (1 new token), prefill (all tokens new) and extend (some cached, some new) in one launch,
# with contexts from 1 to 150 tokens
MIXED = dict(ctx_lens=[1, 150, 9, 40, 33], q_lens=[1, 1, 9, 17, 33])


@pytest.mark.parametrize("split_size", [None, 16, 48], ids=["one-split", "split16", "split48"])
def test_mixed_decode_and_prefill(split_size, dtype, device):
    args = paged_batch(**MIXED, page_size=8, n_head=2, head_dim=48, dtype=dtype, device=device)
    _check(args, dtype, split_size=split_size, block_n=16)


@pytest.mark.parametrize("page_size", [5, 16, 32], ids=lambda p: f"page{p}")
def test_page_sizes_that_do_not_match_the_tile(page_size, device):
    # page 5 does not divide the 16-key tile; page 32 is larger than it
    args = paged_batch(**MIXED, page_size=page_size, n_head=2, head_dim=80, dtype=torch.float32,
                       device=device, seed=1)  # fmt: skip
    _check(args, torch.float32, split_size=32, block_n=16)


def test_decode_batch_with_long_contexts_split(dtype, device):
    # N == B, max_query_len 1: 10 splits of 32 keys
    args = paged_batch(ctx_lens=[300, 2, 77, 161], q_lens=[1, 1, 1, 1], page_size=16, n_head=2,
                       head_dim=64, dtype=dtype, device=device, seed=2)  # fmt: skip
    _check(args, dtype, split_size=32, block_n=32)


def test_long_prefill_spans_query_blocks(device):
    # 70 new tokens after 30 cached: several query blocks; rows early in the block see no key in
    # later splits, which must give weight 0 in the merge and no NaN
    args = paged_batch(ctx_lens=[100, 3], q_lens=[70, 2], page_size=8, n_head=1, head_dim=16,
                       dtype=torch.float32, device=device, seed=3)  # fmt: skip
    _check(args, torch.float32, split_size=16, block_n=16)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_strided_queries_and_pools(head_major, device):
    # the model passes q as a view of the fused qkv projection, and KVCache stores the pools
    # head-major (each (block, head) one contiguous tile) behind the (blocks, page, H, D) shape
    q, k_cache, v_cache, meta = paged_batch(**MIXED, page_size=8, n_head=2, head_dim=48,
                                            dtype=torch.float32, device=device, seed=4,
                                            head_major=head_major)  # fmt: skip
    qkv = torch.cat([q, torch.randn_like(q), torch.randn_like(q)], dim=1)  # (N, 3H, D)
    q_view = qkv[:, :2]
    assert not q_view.is_contiguous()
    _check((q_view, k_cache, v_cache, meta), torch.float32)


def test_default_split_heuristic_and_scale(device):
    args = paged_batch(ctx_lens=[64, 200], q_lens=[1, 5], page_size=16, n_head=3, head_dim=32,
                       dtype=torch.float32, device=device, seed=5)  # fmt: skip
    out = triton_paged_attention(*args, sm_scale=0.3)
    ref = paged_attention_reference(*args, sm_scale=0.3)
    assert rel_error(out, ref) < 1e-3
