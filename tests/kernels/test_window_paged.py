"""Sliding-window attention over the paged KV cache: every backend, through `KVPools` (each layer
its window, one plan per window from the trimmed metadata), against the reference.

The pools are NaN wherever no sequence owns a slot (`kernel_testing.paged_batch`); where every
layer is windowed, the table entries of blocks before all of a sequence's windows are pointed at
block 0 (NaN), as the engine leaves them after freeing those blocks: a path that reads them
returns NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
from gptserve.kernels import (
    CpuPagedBackend,
    SdpaGatherBackend,
    TritonBackend,
    paged_attention_reference,
    trim_to_window,
)
from gptserve.kernels.cpu.native import native_ops
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.paged_kv import KVPools
from gptserve.kernels.reference import attention_reference
from gptserve.kernels.window import skipped_blocks

from tests.kernels.kernel_testing import paged_batch, rel_error

BS = 4  # slots per block
# (context lengths, new tokens): decodes only, prefills (one from scratch), decodes then chunks
BATCHES = {
    "decode": ([13, 4, 29, 1], [1, 1, 1, 1]),
    "prefill": ([11, 22], [11, 6]),
    "mixed": ([17, 9, 26], [1, 1, 7]),
}


def _forget_before_windows(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` with the table entries of blocks no new token's window reaches pointed at block 0
    (NaN in `paged_batch`'s pools), as after the engine freed them."""
    tables = meta.block_tables.clone()
    for i, (n, q) in enumerate(zip(meta.seq_lens, meta.query_lens)):
        tables[i, : skipped_blocks(n, q, window, BS)] = 0
    return AttentionMetadata(
        meta.positions, meta.slot_mapping, tables, meta.context_lens, meta.query_start,
        meta.seq_lens, meta.query_lens,
    )  # fmt: skip


def _run(backend, windows, batch, n_head=4, n_kv=2, head_dim=16, qkv_path=False, seed=0):
    """Every layer of pools with `windows` attends the same batch; returns (outputs, references)."""
    ctx, qlens = BATCHES[batch]
    q, k_cache, v_cache, meta = paged_batch(
        ctx, qlens, BS, n_head, head_dim, torch.float32, "cpu", seed=seed, n_kv_head=n_kv
    )
    if all(w is not None for w in windows) and len(set(windows)) == 1:
        meta = _forget_before_windows(meta, windows[0])
    pools = KVPools(
        len(windows), n_kv, head_dim, k_cache.shape[0], BS, backend=backend,
        group=n_head // n_kv, windows=windows,
    )  # fmt: skip
    for layer in range(len(windows)):
        pools.k[layer].copy_(k_cache)
        pools.v[layer].copy_(v_cache)
    blocks, offsets = meta.slot_mapping // BS, meta.slot_mapping % BS
    k_new, v_new = k_cache[blocks, offsets], v_cache[blocks, offsets]  # (N, H_kv, D): as stored
    plan = pools.plan(meta)
    outs = []
    for layer in range(len(windows)):
        if qkv_path:
            assert pools.has_qkv_path(plan, torch.float32, None)
            qkv = torch.cat([q, k_new, v_new], dim=1).flatten(1)  # (N, (H + 2 H_kv) * D)
            outs.append(pools.attend_qkv(layer, qkv, None, plan, n_head))
        else:
            outs.append(pools.attend(layer, q, k_new, v_new, plan))
    refs = [paged_attention_reference(q, k_cache, v_cache, meta, window=w) for w in windows]
    return outs, refs


def _check(outs, refs):
    for out, ref in zip(outs, refs):
        assert torch.isfinite(out).all()
        assert rel_error(out, ref) < 1e-5


def test_paged_reference_is_attention_per_sequence():
    """The paged reference with a window equals the dense reference on each sequence's keys."""
    ctx, qlens = BATCHES["mixed"]
    q, k_cache, v_cache, meta = paged_batch(ctx, qlens, BS, 4, 8, torch.float32, "cpu", n_kv_head=2)
    for window in (1, 3, 6):
        got = paged_attention_reference(q, k_cache, v_cache, meta, window=window)
        start = 0
        for i, (n, m) in enumerate(zip(ctx, qlens)):
            table = meta.block_tables[i].long()
            pos = torch.arange(n)
            keys = k_cache[table[pos // BS], pos % BS].permute(1, 0, 2)[None]  # (1, H_kv, n, D)
            values = v_cache[table[pos // BS], pos % BS].permute(1, 0, 2)[None]
            queries = q[start : start + m].permute(1, 0, 2)[None]  # (1, H, m, D)
            want = attention_reference(queries, keys, values, window=window)[0].permute(1, 0, 2)
            assert torch.allclose(got[start : start + m], want, atol=1e-5)
            start += m


def test_trim_to_window_drops_only_unseen_blocks():
    ctx, qlens = BATCHES["mixed"]
    _, _, _, meta = paged_batch(ctx, qlens, BS, 2, 8, torch.float32, "cpu")
    trimmed = trim_to_window(meta, 5, BS)
    for i, (n, m) in enumerate(zip(ctx, qlens)):
        skip = max(0, n - m - 5 + 1) // BS  # first new token at n - m sees keys from n - m - 4
        assert trimmed.seq_lens[i] == n - skip * BS
        kept = -(-trimmed.seq_lens[i] // BS)
        assert (
            trimmed.block_tables[i, :kept].tolist()
            == meta.block_tables[i, skip : skip + kept].tolist()
        )
    assert trim_to_window(meta, 1000, BS) is meta


WINDOWS = {
    "w1": (1, 1),
    "w3-under-block": (3, 3),
    "w9-spans-blocks": (9, 9),
    "mixed-global": (None, 6, None),
    "two-windows": (2, 7),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("windows", list(WINDOWS.values()), ids=list(WINDOWS))
@pytest.mark.parametrize(
    "backend",
    [CpuPagedBackend, lambda: CpuPagedBackend(native=False), SdpaGatherBackend],
    ids=["cpu", "cpu-pytorch", "sdpa"],
)
def test_cpu_and_sdpa_backends(backend, windows, batch):
    _check(*_run(backend(), windows, batch))


@pytest.mark.parametrize("windows", [(1, 1), (3, 3), (9, 9), (None, 5)], ids=str)
def test_native_qkv_path(windows):
    if native_ops() is None:
        pytest.skip("the CPU kernels are not built here")
    _check(*_run(CpuPagedBackend(), windows, "decode", qkv_path=True))


def test_cascade_prefill_with_a_shared_prefix():
    """Sequences continuing one cached prefix: the global layer may take the cascade, the
    windowed one must not score the shared blocks unmasked."""
    n_head, head_dim = 2, 8
    gen = torch.Generator().manual_seed(3)
    shared = [1, 2, 3]  # 12 cached tokens in common
    tables = [shared + [4, 5], shared + [6, 7]]
    ctx, qlens = [19, 17], [7, 5]
    k_cache = torch.randn(8, BS, n_head, head_dim, generator=gen)
    v_cache = torch.randn(8, BS, n_head, head_dim, generator=gen)
    meta = AttentionMetadata.build(tables, ctx, qlens, BS)
    q = torch.randn(meta.num_tokens, n_head, head_dim, generator=gen)
    pools = KVPools(2, n_head, head_dim, 8, BS, backend=CpuPagedBackend(), windows=(None, 5))
    for layer in range(2):
        pools.k[layer].copy_(k_cache)
        pools.v[layer].copy_(v_cache)
    blocks, offsets = meta.slot_mapping // BS, meta.slot_mapping % BS
    plan = pools.plan(meta)
    for layer, window in enumerate((None, 5)):
        out = pools.attend(layer, q, k_cache[blocks, offsets], v_cache[blocks, offsets], plan)
        ref = paged_attention_reference(q, k_cache, v_cache, meta, window=window)
        assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("windows", [(1, 1), (6, 6), (None, 3)], ids=str)
def test_triton_backend(windows, batch):
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")
    _check(*_run(TritonBackend(), windows, batch, n_head=2, n_kv=1, head_dim=16))


def test_window_over_the_whole_context_is_global():
    outs, _ = _run(SdpaGatherBackend(), (None, 1000), "mixed")
    assert torch.equal(outs[0], outs[1]) or rel_error(outs[1], outs[0]) < 1e-6
    assert math.isfinite(float(outs[1].sum()))
