"""Constants and helpers the kernel tests share (imported by conftest.py and the tests)."""

from __future__ import annotations

import os
import random

import torch
from gptserve.kernels.metadata import AttentionMetadata

ON_CUDA = os.environ.get("GPTSERVE_TRITON_CUDA") == "1" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# max |error| / max |reference|, per dtype of the inputs
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32; NaN anywhere makes it NaN."""
    actual, expected = actual.detach().float(), expected.detach().float()
    diff = (actual - expected).abs().max()
    return float(diff / expected.abs().max().clamp_min(1e-6))


def paged_batch(
    ctx_lens, q_lens, page_size, n_head, head_dim, dtype, device, seed=0, spare=3,
    head_major=False, n_kv_head=None,
):  # fmt: skip
    """(q (N, H, D), k_cache, v_cache, AttentionMetadata) for sequences in shuffled pool blocks.

    The pools hold `n_kv_head` heads (grouped-query attention), n_head unless given.

    The pools are full of NaN except the slots the sequences own. Tables are padded with block 0,
    which nobody owns: a kernel that reads past a context, or through a padding entry, without
    masking the load picks up NaN. `spare` more blocks are owned by nobody. `head_major` stores
    the pools as the CPU and Triton backends do: each (block, head) a contiguous (page_size, head_dim)
    tile, seen through the same (blocks, page, H, D) shape.
    """
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in ctx_lens]
    num_blocks = sum(pages) + spare
    order = list(range(1, num_blocks))  # block 0 stays garbage and pads the tables
    random.Random(seed).shuffle(order)
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    shape = (num_blocks, page_size, n_kv_head, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    tables = []
    for n, n_pages in zip(ctx_lens, pages):
        blocks, order = order[:n_pages], order[n_pages:]
        for pos in range(n):
            k_cache[blocks[pos // page_size], pos % page_size] = torch.randn(
                n_kv_head, head_dim, generator=gen
            )
            v_cache[blocks[pos // page_size], pos % page_size] = torch.randn(
                n_kv_head, head_dim, generator=gen
            )
        tables.append(blocks)
    width = max(len(t) for t in tables) + 1  # wider than needed, padded with block 0
    padded = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata.build(padded, ctx_lens, q_lens, page_size, device)
    q = torch.randn(meta.num_tokens, n_head, head_dim, generator=gen)
    if head_major:
        k_cache, v_cache = (
            t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k_cache, v_cache)
        )
    q, k_cache, v_cache = (t.to(device, dtype) for t in (q, k_cache, v_cache))
    return q, k_cache, v_cache, meta
