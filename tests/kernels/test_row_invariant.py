"""`--batch-invariant`'s attention on a CPU (`kernels.cpu.row_invariant`): every new token of a
step (a decode, a prompt chunk's rows, rows over a prefix other sequences of the step share)
gets the same bits as in any other step that holds it (alone, cut into other chunks), compiled
kernel or PyTorch's decode path, and agrees with the reference."""

from __future__ import annotations

import pytest
import torch
from gptserve.kernels.backends import KVSpec, select_attention_backend
from gptserve.kernels.cpu.native import native_ops
from gptserve.kernels.cpu.row_invariant import (
    RowInvariantCpuBackend,
    rows_as_decodes,
    share_free_rounds,
)
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.reference import paged_attention_reference
from gptserve.kernels.window import trim_to_window

from tests.kernels.kernel_testing import TOLERANCE, rel_error

BS, N_HEAD, N_KV, DIM = 16, 4, 2, 32
# (table, context, new tokens): A and C continue one cached block (0), B decodes, D is a whole
# prompt of one block and a bit
SEQS = [([0, 1], 30, 14), ([3], 9, 1), ([0, 2], 25, 9), ([4, 5], 20, 20)]
NATIVE = [
    pytest.param(True, id="compiled", marks=pytest.mark.skipif(native_ops() is None,
                                                                reason="kernels not built")),
    pytest.param(False, id="pytorch"),
]  # fmt: skip


def _pools(dtype: torch.dtype, backend: RowInvariantCpuBackend) -> tuple[torch.Tensor, ...]:
    spec = _spec(dtype)
    k, v = backend.allocate(spec)
    gen = torch.Generator().manual_seed(0)
    k.copy_(torch.randn(k.shape, generator=gen).to(dtype))  # cached tokens (and stale slots)
    v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    return k[0], v[0]  # one layer's


def _spec(dtype: torch.dtype) -> KVSpec:
    return KVSpec(1, 8, BS, N_KV, DIM, dtype, torch.device("cpu"), group=N_HEAD // N_KV)


def _new(seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Sequence `seq`'s new tokens' q (n, H, D), k and v (n, H_kv, D), the same in every step."""
    n = SEQS[seq][2]
    gen = torch.Generator().manual_seed(100 + seq)
    return tuple(torch.randn(n, h, DIM, generator=gen).to(dtype) for h in (N_HEAD, N_KV, N_KV))


def _run(backend, dtype, seqs: list[tuple[int, int]], window: int | None):
    """One step of (sequence, how many of its new tokens) from fresh pools: (rows, H, D) out,
    the pools after it and the step's metadata."""
    k_pool, v_pool = _pools(dtype, backend)
    tables, ctx, lens, qs, ks, vs = [], [], [], [], [], []
    for seq, take in seqs:
        table, n, new = SEQS[seq]
        q, k, v = _new(seq, dtype)
        tables.append(table)
        ctx.append(n - new + take)
        lens.append(take)
        qs.append(q[:take]), ks.append(k[:take]), vs.append(v[:take])
    meta = AttentionMetadata.build(tables, ctx, lens, BS)
    planned = meta if window is None else trim_to_window(meta, window, BS)
    plan = backend.plan(planned, _spec(dtype), window)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    return backend.forward(q, k, v, k_pool, v_pool, plan), k_pool, v_pool, meta, q


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 7], ids=["global", "window7"])
def test_every_token_gets_its_bits_in_any_step(native: bool, kv_dtype, window) -> None:
    dtype = kv_dtype
    backend = RowInvariantCpuBackend(native=native)
    together, k_pool, v_pool, meta, q = _run(backend, dtype, [(i, SEQS[i][2]) for i in range(4)],
                                             window)  # fmt: skip
    ref = paged_attention_reference(q.float(), k_pool.float(), v_pool.float(), meta, window=window)
    assert rel_error(together.float(), ref) < TOLERANCE[dtype]
    starts = meta.query_start.tolist()
    for seq in range(4):
        for take in sorted({1, SEQS[seq][2] // 2 + 1, SEQS[seq][2]}):
            # the sequence alone, its chunk cut after `take` tokens: its last row as in the batch
            alone = _run(backend, dtype, [(seq, take)], window)[0]
            assert torch.equal(alone[-1], together[starts[seq] + take - 1]), (seq, take)


def test_a_step_of_tokens_is_a_step_of_one_token_sequences() -> None:
    meta = AttentionMetadata.build([[0, 1], [3]], [20, 5], [6, 1], BS)
    rows = rows_as_decodes(meta)
    assert rows.is_decode and rows.num_tokens == meta.num_tokens == 7
    assert rows.seq_lens == [15, 16, 17, 18, 19, 20, 5]
    assert rows.context_lens.tolist() == rows.seq_lens
    assert rows.block_tables.tolist() == [[0, 1]] * 6 + [[3, 0]]
    assert torch.equal(rows.slot_mapping, meta.slot_mapping)
    assert torch.equal(rows.positions, meta.positions)
    decodes = AttentionMetadata.build([[0], [3]], [4, 5], [1, 1], BS)
    assert rows_as_decodes(decodes) is decodes


def test_rounds_keep_sequences_that_share_a_block_apart() -> None:
    meta = AttentionMetadata.build([table for table, _, _ in SEQS[:3]], [30, 9, 25], [3, 1, 2], BS)
    # A (rows 0-2) and B (row 3) share nothing; C (rows 4-5) shares block 0 with A
    assert share_free_rounds(meta, BS) == [[0, 3], [1], [2], [4], [5]]


def test_the_flag_selects_it_on_a_cpu_only() -> None:
    assert isinstance(select_attention_backend("cpu", torch.bfloat16, True), RowInvariantCpuBackend)
    assert not isinstance(select_attention_backend("cpu", torch.bfloat16), RowInvariantCpuBackend)
