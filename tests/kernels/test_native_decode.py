"""The compiled CPU decode kernel (`kernels.cpu.native`) against the reference: its writes, its
attention (grouped-query, shared blocks, every dtype), its batch invariance and its fallback."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from gptserve.kernels.backends import CpuPagedBackend, KVSpec
from gptserve.kernels.cpu import native
from gptserve.kernels.metadata import AttentionMetadata, KVWrite
from gptserve.kernels.reference import paged_attention_reference
from gptserve.model.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq

from tests.kernels.kernel_testing import TOLERANCE, paged_batch, rel_error

# a host that runs the tests has a C++ compiler; only GPTSERVE_NATIVE=0 turns the kernel off
pytestmark = pytest.mark.skipif(not native.enabled(), reason="GPTSERVE_NATIVE=0")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_it_builds_on_this_host():
    assert native.paged_decode_op() is not None


def _step(q, k_new, v_new, k, v, meta: AttentionMetadata, n_decode: int) -> torch.Tensor:
    at = KVWrite.of(meta, k.shape[1])
    op = native.paged_decode_op()
    scale = q.shape[-1] ** -0.5
    return op(q, k_new, v_new, k, v, at.block, at.offset, meta.block_tables, meta.context_lens,
              n_decode, scale)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_head, n_kv_head, head_dim", [(3, 3, 40), (9, 3, 64), (4, 1, 16)])
@pytest.mark.parametrize("page_size, spare", [(5, 3), (16, 200)])
def test_writes_then_attends_like_the_reference(kv_dtype, n_head, n_kv_head, head_dim, page_size,
                                                spare):  # fmt: skip
    ctx = [1, 150, 9, 40, 16, 17]
    q, k, v, meta = paged_batch(ctx, [1] * len(ctx), page_size, n_head=n_head, head_dim=head_dim,
                                dtype=kv_dtype, device="cpu", spare=spare, head_major=True,
                                n_kv_head=n_kv_head)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    k_new, v_new = (torch.randn(len(ctx), n_kv_head, head_dim, generator=gen).to(kv_dtype)
                    for _ in range(2))  # fmt: skip
    at = KVWrite.of(meta, page_size)
    expect_k, expect_v = k.clone(), v.clone()
    expect_k[at.block, at.offset] = k_new
    expect_v[at.block, at.offset] = v_new
    out = _step(q, k_new, v_new, k, v, meta, len(ctx))
    # the new keys and values are where the step said, and nothing else in the pools moved
    assert torch.equal(k.nan_to_num(7), expect_k.nan_to_num(7))
    assert torch.equal(v.nan_to_num(7), expect_v.nan_to_num(7))
    ref = paged_attention_reference(q.float(), expect_k.float(), expect_v.float(), meta)
    assert out.shape == q.shape and out.dtype == kv_dtype
    assert torch.isfinite(out).all()  # NaN past every context and in the padding is never read
    assert rel_error(out, ref) < TOLERANCE[kv_dtype]


def test_sequences_sharing_blocks_match_the_reference():
    # three sequences over one cached prefix (blocks 2 and 0), each with a last block of its own
    tables, ctx = [[2, 0, 5], [2, 0, 1], [2, 3]], [11, 10, 6]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(8, 2, 4, 8, generator=gen).transpose(1, 2)  # head-major (8, 4, 2, 8)
    v = torch.randn(8, 2, 4, 8, generator=gen).transpose(1, 2)
    meta = AttentionMetadata.build(tables, ctx, [1, 1, 1], block_size=4)
    q = torch.randn(3, 4, 8, generator=gen)  # 4 query heads over 2 KV heads
    at = KVWrite.of(meta, 4)
    k_new, v_new = k[at.block, at.offset].clone(), v[at.block, at.offset].clone()
    out = _step(q, k_new, v_new, k, v, meta, 3)
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=str)
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(kv_dtype):
    q, k, v, meta = paged_batch([37], [1], 8, n_head=4, head_dim=32, dtype=kv_dtype, device="cpu",
                                head_major=True, n_kv_head=2)  # fmt: skip
    at = KVWrite.of(meta, 8)
    k_new, v_new = k[at.block, at.offset].clone(), v[at.block, at.offset].clone()
    alone = _step(q, k_new, v_new, k, v, meta, 1)
    # the same sequence, its blocks elsewhere in a bigger pool, after two other sequences
    n_pool, mine = 30, [20, 3, 11, 27, 8]
    big_k = torch.randn(n_pool, 2, 8, 32).to(kv_dtype).transpose(1, 2)
    big_v = torch.randn(n_pool, 2, 8, 32).to(kv_dtype).transpose(1, 2)
    for new, old in zip(mine, meta.block_tables[0].tolist()):
        big_k[new], big_v[new] = k[old], v[old]
    others = [[0, 1, 2, 4], [5, 6]]
    both = AttentionMetadata.build([*others, mine], [29, 12, 37], [1, 1, 1], block_size=8)
    q3 = torch.cat([torch.randn(2, 4, 32).to(kv_dtype), q])
    at3 = KVWrite.of(both, 8)
    k3, v3 = big_k[at3.block, at3.offset].clone(), big_v[at3.block, at3.offset].clone()
    together = _step(q3, k3, v3, big_k, big_v, both, 3)
    assert torch.equal(together[2], alone[0])


@pytest.mark.parametrize("head_dim", [64, 40])  # whole vectors (the tiled loops) or not
def test_the_split_of_heads_among_threads_leaves_the_bits_alone(head_dim):
    # one sequence alone takes its heads a few at a time, eight take every head in one task;
    # each sequence's bits are the same either way, on one thread or two
    ctx = [70, 33, 16, 91, 5, 48, 64, 17]
    q, k, v, meta = paged_batch(ctx, [1] * 8, 16, n_head=8, head_dim=head_dim,
                                dtype=torch.float32, device="cpu", head_major=True,
                                n_kv_head=4)  # fmt: skip
    at = KVWrite.of(meta, 16)
    k_new, v_new = k[at.block, at.offset].clone(), v[at.block, at.offset].clone()
    op, scale = native.paged_decode_op(), head_dim**-0.5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = _step(q, k_new, v_new, k, v, meta, 8)
        for threads_alone in (1, 2):
            torch.set_num_threads(threads_alone)
            for i in range(8):
                one = slice(i, i + 1)
                alone = op(q[one], k_new[one], v_new[one], k, v, at.block[one], at.offset[one],
                           meta.block_tables[one].contiguous(), meta.context_lens[one], 1,
                           scale)  # fmt: skip
                assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)
    want = paged_attention_reference(q, k, v, meta)
    assert rel_error(together, want) < TOLERANCE[torch.float32]


def test_the_backend_takes_the_decodes_and_leaves_the_rest_to_pytorch():
    # two decodes, then a prefill of 4 new tokens: one call writes all 6 and attends the two
    q, k, v, meta = paged_batch([5, 9, 13], [1, 1, 4], 4, n_head=2, head_dim=8,
                                dtype=torch.float32, device="cpu", head_major=True)  # fmt: skip
    at = KVWrite.of(meta, 4)
    k_new, v_new = k[at.block, at.offset].clone(), v[at.block, at.offset].clone()
    backend = CpuPagedBackend()
    step = backend.plan(meta, KVSpec(1, k.shape[0], 4, 2, 8, torch.float32, k.device))
    assert step.decode is None and step.decodes.num_seqs == 2  # nothing planned for the kernel
    out = backend.forward(q, k_new, v_new, k, v, step)
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < TOLERANCE[torch.float32]
    python = CpuPagedBackend(native=False)
    assert python.plan(meta, KVSpec(1, k.shape[0], 4, 2, 8, torch.float32, k.device)).decode


def test_off_by_environment_and_a_failed_build_falls_back_with_one_line(
    monkeypatch, caplog, tmp_path
):
    monkeypatch.setenv("GPTSERVE_NATIVE", "0")
    assert native.native_ops.__wrapped__() is None
    monkeypatch.setenv("GPTSERVE_NATIVE", "1")
    # nothing built yet (an empty extension cache), and no compiler to build with
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(
        "torch.utils.cpp_extension._get_build_directory", lambda name, verbose: str(tmp_path)
    )

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: no C++ compiler\nmore detail")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="gptserve.kernels.cpu.native"):
        assert native.native_ops.__wrapped__() is None
    assert "CPU kernels not built (error: no C++ compiler)" in caplog.text


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rotary", [32, 24], ids=["whole", "partial"])  # of each head's 32
def test_the_step_from_the_qkv_product_rotates_writes_and_attends(qkv_dtype, out_dtype, rotary):
    n_head, n_kv, dim, bs = 6, 2, 32, 8
    ctx = [5, 19, 8]
    _, k, v, meta = paged_batch(ctx, [1, 1, 1], bs, n_head=n_head, head_dim=dim,
                                dtype=torch.float32, device="cpu", head_major=True,
                                n_kv_head=n_kv)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, (n_head + 2 * n_kv) * dim, generator=gen).to(qkv_dtype)
    inv_freq = rotary_inv_freq(rotary, 10000.0)
    cos, sin = rotary_cos_sin(meta.positions, inv_freq, torch.float32)  # (N, 1, R) each
    # what the model computes without the kernel: split, rotate, write, attend
    heads = qkv.float().view(3, n_head + 2 * n_kv, dim)
    qk = apply_rotary(heads[:, : n_head + n_kv], cos, sin)
    q, k_new, v_new = qk[:, :n_head], qk[:, n_head:], heads[:, n_head + n_kv :]
    at = KVWrite.of(meta, bs)
    want_k, want_v = k.clone(), v.clone()
    want_k[at.block, at.offset], want_v[at.block, at.offset] = k_new, v_new
    ref = paged_attention_reference(q, want_k, want_v, meta)
    out = native.native_ops().paged_decode_qkv(
        qkv, cos.view(3, rotary), sin.view(3, rotary), k, v, at.block, at.offset,
        meta.block_tables, meta.context_lens, n_head, dim**-0.5, out_dtype,
    )  # fmt: skip
    # the rotated keys are PyTorch's to the bit (two products rounded, then added; a partial
    # rotation's last channels as they were)
    assert torch.equal(k.nan_to_num(7), want_k.nan_to_num(7))
    assert torch.equal(v.nan_to_num(7), want_v.nan_to_num(7))
    assert out.shape == (3, n_head, dim) and out.dtype == out_dtype
    assert rel_error(out, ref) < TOLERANCE[out_dtype]


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])  # whole vectors (the widening loops) or not
def test_a_float32_step_over_a_narrower_cache_rounds_the_writes_and_nothing_else(
    pool_dtype, head_dim
):
    # a float32 model over a float16/bfloat16 KV cache (--kv-cache-dtype): the new keys and
    # values are stored rounded to the pool's dtype as PyTorch's `to` rounds them, the query
    # stays float32, and the attention is the float32 attention over the rounded cache
    n_head, n_kv, bs = 6, 2, 8
    ctx = [5, 70, 8, 33]
    _, k32, v32, meta = paged_batch(ctx, [1] * 4, bs, n_head=n_head, head_dim=head_dim,
                                    dtype=torch.float32, device="cpu", head_major=True,
                                    n_kv_head=n_kv)  # fmt: skip
    k, v = k32.to(pool_dtype), v32.to(pool_dtype)  # (the same head-major layout)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, (n_head + 2 * n_kv) * head_dim, generator=gen)
    inv_freq = rotary_inv_freq(head_dim, 10000.0)
    cos, sin = rotary_cos_sin(meta.positions, inv_freq, torch.float32)  # (N, 1, D) each
    heads = qkv.view(4, n_head + 2 * n_kv, head_dim)
    qk = apply_rotary(heads[:, : n_head + n_kv], cos, sin)
    q, k_new, v_new = qk[:, :n_head], qk[:, n_head:], heads[:, n_head + n_kv :]
    at = KVWrite.of(meta, bs)
    want_k, want_v = k.clone(), v.clone()
    want_k[at.block, at.offset] = k_new.to(pool_dtype)
    want_v[at.block, at.offset] = v_new.to(pool_dtype)
    ops, scale = native.native_ops(), head_dim**-0.5
    out = ops.paged_decode_qkv(
        qkv, cos.view(4, head_dim), sin.view(4, head_dim), k, v, at.block, at.offset,
        meta.block_tables, meta.context_lens, n_head, scale, torch.float32,
    )  # fmt: skip
    assert torch.equal(k.nan_to_num(7), want_k.nan_to_num(7))
    assert torch.equal(v.nan_to_num(7), want_v.nan_to_num(7))
    ref = paged_attention_reference(q, want_k.float(), want_v.float(), meta)
    assert out.dtype == torch.float32 and rel_error(out, ref) < TOLERANCE[torch.float32]
    # each sequence alone, the rest of the pool as the batch left it: the same bits
    for i in range(4):
        one = slice(i, i + 1)
        k_again, v_again = want_k.clone(), want_v.clone()
        alone = ops.paged_decode_qkv(
            qkv[one], cos.view(4, head_dim)[one], sin.view(4, head_dim)[one], k_again, v_again,
            at.block[one], at.offset[one], meta.block_tables[one].contiguous(),
            meta.context_lens[one], n_head, scale, torch.float32,
        )  # fmt: skip
        assert torch.equal(alone[0], out[i])


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paged_decode_takes_float32_over_a_narrower_cache_with_the_one_call_bits(pool_dtype):
    # a step that also prefills goes through `paged_decode` with q, k, v as the model made them
    n_head, n_kv, dim, bs = 4, 2, 64, 8
    _, k32, v32, meta = paged_batch([5, 40, 17], [1, 1, 1], bs, n_head=n_head, head_dim=dim,
                                    dtype=torch.float32, device="cpu", head_major=True,
                                    n_kv_head=n_kv)  # fmt: skip
    qkv = torch.randn(3, (n_head + 2 * n_kv) * dim, generator=torch.Generator().manual_seed(4))
    heads = qkv.view(3, n_head + 2 * n_kv, dim)
    q, k_new, v_new = heads[:, :n_head], heads[:, n_head : n_head + n_kv], heads[:, n_head + n_kv :]
    at = KVWrite.of(meta, bs)
    pools = [(k32.to(pool_dtype), v32.to(pool_dtype)) for _ in range(2)]
    one_call = native.native_ops().paged_decode_qkv(
        qkv, None, None, *pools[0], at.block, at.offset, meta.block_tables, meta.context_lens,
        n_head, dim**-0.5, torch.float32,
    )  # fmt: skip
    split = _step(q.contiguous(), k_new.contiguous(), v_new.contiguous(), *pools[1], meta, 3)
    assert split.dtype == torch.float32 and torch.equal(split, one_call)
    assert all(torch.equal(a.nan_to_num(7), b.nan_to_num(7)) for a, b in zip(*pools))
    with pytest.raises(RuntimeError, match="one dtype"):  # any other mix is refused
        _step(q.to(torch.bfloat16), k_new.to(torch.bfloat16), v_new.to(torch.bfloat16),
              k32.to(torch.float16), v32.to(torch.float16), meta, 3)  # fmt: skip


def test_the_step_without_rotary_positions_takes_q_and_k_as_they_are():
    n_head, n_kv, dim, bs = 4, 4, 16, 8  # GPT-2's shape: no rotation, every head its keys
    _, k, v, meta = paged_batch([5, 12], [1, 1], bs, n_head=n_head, head_dim=dim,
                                dtype=torch.float32, device="cpu", head_major=True,
                                n_kv_head=n_kv)  # fmt: skip
    qkv = torch.randn(2, (n_head + 2 * n_kv) * dim, generator=torch.Generator().manual_seed(3))
    heads = qkv.view(2, n_head + 2 * n_kv, dim)
    q, k_new, v_new = heads[:, :n_head], heads[:, n_head : 2 * n_head], heads[:, 2 * n_head :]
    at = KVWrite.of(meta, bs)
    want_k, want_v = k.clone(), v.clone()
    want_k[at.block, at.offset], want_v[at.block, at.offset] = k_new, v_new
    ref = paged_attention_reference(q, want_k, want_v, meta)
    out = native.native_ops().paged_decode_qkv(
        qkv, None, None, k, v, at.block, at.offset, meta.block_tables, meta.context_lens,
        n_head, dim**-0.5, torch.float32,
    )  # fmt: skip
    assert torch.equal(k.nan_to_num(7), want_k.nan_to_num(7))
    assert torch.equal(v.nan_to_num(7), want_v.nan_to_num(7))
    assert rel_error(out, ref) < TOLERANCE[torch.float32]
    with pytest.raises(RuntimeError, match="together"):
        native.native_ops().paged_decode_qkv(
            qkv, None, torch.zeros(2, dim), k, v, at.block, at.offset, meta.block_tables,
            meta.context_lens, n_head, dim**-0.5, torch.float32,
        )  # fmt: skip
    for width in (dim + 2, 5):  # wider than a head, or odd: refused
        with pytest.raises(RuntimeError, match="R even and at most D"):
            native.native_ops().paged_decode_qkv(
                qkv, torch.ones(2, width), torch.zeros(2, width), k, v, at.block, at.offset,
                meta.block_tables, meta.context_lens, n_head, dim**-0.5, torch.float32,
            )  # fmt: skip


def test_metadata_pointing_outside_the_pool_is_refused_not_read():
    q, k, v, meta = paged_batch([9], [1], 4, n_head=2, head_dim=16, dtype=torch.float32,
                                device="cpu", head_major=True)  # fmt: skip
    at = KVWrite.of(meta, 4)
    k_new, v_new = k[at.block, at.offset].clone(), v[at.block, at.offset].clone()
    op = native.native_ops().paged_decode
    bad_table = meta.block_tables.clone()
    bad_table[0, 1] = k.shape[0] + 5
    with pytest.raises(RuntimeError, match="past the pool"):
        op(q, k_new, v_new, k, v, at.block, at.offset, bad_table, meta.context_lens, 1, 0.25)
    too_long = meta.context_lens + 100
    with pytest.raises(RuntimeError, match="outside its block table"):
        op(q, k_new, v_new, k, v, at.block, at.offset, meta.block_tables, too_long, 1, 0.25)
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k_new, v_new, k, v, at.block + 1000, at.offset, meta.block_tables,
           meta.context_lens, 1, 0.25)  # fmt: skip


def test_tensors_that_do_not_fit_the_pools_are_refused_before_anything_is_written():
    q, k, v, meta = paged_batch([9], [1], 4, n_head=2, head_dim=16, dtype=torch.float32,
                                device="cpu", head_major=True)  # fmt: skip
    at = KVWrite.of(meta, 4)
    k_new = k[at.block, at.offset].clone()
    k_before = k.clone()
    op = native.native_ops().paged_decode
    wide_v = torch.randn(1, 2, 32)  # a head twice the pool's
    with pytest.raises(RuntimeError, match="must fit each other and the pools"):
        op(q, k_new, wide_v, k, v, at.block, at.offset, meta.block_tables, meta.context_lens,
           1, 0.25)  # fmt: skip
    with pytest.raises(RuntimeError, match="outside its block table"):
        op(q, k_new, k_new, k, v, at.block, at.offset, meta.block_tables,
           meta.context_lens + 100, 1, 0.25)  # fmt: skip
    assert torch.equal(k.nan_to_num(7), k_before.nan_to_num(7))  # refused before the write


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(tmp_path)
    assert lock.exists()  # another process may be building right now
    old = lock.stat().st_mtime - 3600
    os.utime(lock, (old, old))
    native._clear_stale_lock(tmp_path)  # its builder was killed an hour ago
    assert not lock.exists()
