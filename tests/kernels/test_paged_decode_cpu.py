"""CPU decode attention over head-major pools, read in place, against the reference.

`dtype` comes from conftest.py (fp32 and fp16; bf16 too where CUDA is present).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, paged_batch, rel_error

import kernels.paged_decode_cpu as decode_cpu
from kernels.paged_decode_cpu import decode_attention_cpu
from kernels.reference import paged_attention_reference

CTX = [1, 150, 9, 40, 16, 17]


@pytest.fixture(autouse=True)
def fresh_plans():
    decode_cpu.plans.clear()
    yield
    decode_cpu.plans.clear()


@pytest.mark.parametrize("page_size", [5, 16])
@pytest.mark.parametrize("spare", [3, 200], ids=["one-run", "scattered"])
def test_matches_reference_and_never_reads_garbage(page_size, spare, dtype):
    args = paged_batch(CTX, [1] * len(CTX), page_size, n_head=3, head_dim=40, dtype=dtype,
                       device="cpu", spare=spare, head_major=True)  # fmt: skip
    assert args[1].transpose(1, 2).is_contiguous()
    ref = paged_attention_reference(*args)
    out = decode_attention_cpu(*args)
    plan = decode_cpu.plans.plan
    # with 200 spare blocks the batch's blocks are spread over a run 2x too long: gathered
    assert (plan.run is None) == (spare == 200)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_slots_past_a_sequence_are_zeroed_and_nothing_else_changes():
    q, k, v, tables, ctx, starts = paged_batch([3, 21], [1, 1], 8, n_head=2, head_dim=4,
                                               dtype=torch.float32, device="cpu",
                                               head_major=True)  # fmt: skip
    k_before, v_before = k.clone(), v.clone()
    decode_attention_cpu(q, k, v, tables, ctx, starts)
    assert torch.equal(k.nan_to_num(7), k_before.nan_to_num(7))  # keys are only read
    stale = torch.zeros_like(v, dtype=torch.bool)
    stale[tables[0, 0], 3:] = True  # sequence 0: 3 tokens in its only block
    stale[tables[1, 2], 5:] = True  # sequence 1: 21 tokens, 5 in its third block
    assert (v[stale] == 0).all()
    assert torch.equal(v[~stale].nan_to_num(7), v_before[~stale].nan_to_num(7))


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    one = paged_batch([37], [1], 8, n_head=2, head_dim=16, dtype=torch.float32, device="cpu",
                      head_major=True)  # fmt: skip
    q, k, v, tables, ctx, _ = one
    alone = decode_attention_cpu(*one)
    # the same sequence, its blocks elsewhere in a bigger pool, beside two other sequences
    n_pool = 30
    k2 = torch.randn(n_pool, 2, 8, 16).transpose(1, 2)
    v2 = torch.randn(n_pool, 2, 8, 16).transpose(1, 2)
    moved = [11, 3, 25, 7, 20]
    k2[moved], v2[moved] = k[tables[0, :5].long()], v[tables[0, :5].long()]
    batch_tables = torch.tensor(  # a longer sequence first: the batch pads the shorter ones
        [[0, 1, 2, 4, 5, 13, 14, 15], moved + [0] * 3, [6, 8, 9, 10, 12, 0, 0, 0]],
        dtype=torch.int32,
    )
    batch_ctx = torch.tensor([60, 37, 33], dtype=torch.int32)
    batch_q = torch.cat([torch.randn(1, 2, 16), q, torch.randn(1, 2, 16)])
    starts = torch.arange(4, dtype=torch.int32)
    together = decode_attention_cpu(batch_q, k2, v2, batch_tables, batch_ctx, starts)
    assert torch.equal(together[1], alone[0])


def test_declines_what_it_does_not_cover():
    mixed = paged_batch([5, 9], [1, 3], 4, n_head=2, head_dim=8, dtype=torch.float32,
                        device="cpu", head_major=True)  # fmt: skip
    assert decode_attention_cpu(*mixed) is None  # a prefill in the batch
    token_major = paged_batch([5, 9], [1, 1], 4, n_head=2, head_dim=8, dtype=torch.float32,
                              device="cpu")  # fmt: skip
    assert decode_attention_cpu(*token_major) is None


@pytest.mark.parametrize(
    "q_lens, in_place",
    [([1, 1, 1], 3), ([1, 1, 4], 2), ([1, 3, 1], 1), ([3, 1, 1], 0), ([2, 3, 4], 0)],
)
@pytest.mark.parametrize("head_major", [True, False])
def test_the_dispatch_reads_leading_decodes_in_place_and_gathers_the_rest(
    q_lens, in_place, head_major
):
    import kernels
    import kernels.sdpa_paged as sdpa_paged

    sdpa_paged.plans.clear()
    args = paged_batch([5, 9, 13], q_lens, 4, n_head=2, head_dim=8, dtype=torch.float32,
                       device="cpu", head_major=head_major)  # fmt: skip
    out = kernels.paged_attention(*args)
    assert rel_error(out, paged_attention_reference(*args)) < TOLERANCE[torch.float32]
    plan = decode_cpu.plans.plan
    read_in_place = 0 if plan is None or not head_major else plan.seq_rows.shape[0]
    assert read_in_place == (in_place if head_major else 0)
    assert (sdpa_paged.plans.plan is not None) == (in_place < 3 or not head_major)
