"""CPU decode attention over head-major pools, read in place, against the reference.

`dtype` comes from conftest.py (fp32 and fp16; bf16 too where CUDA is present).
"""

from __future__ import annotations

import pytest
import torch
from gptserve.kernels.backends import CpuPagedBackend, KVSpec, SdpaGatherBackend, SdpaGatherPlan
from gptserve.kernels.cpu.cascade import CascadePlan
from gptserve.kernels.cpu.decode import DecodePlan, decode_attention_cpu, is_head_major, plan_decode
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.reference import paged_attention_reference
from gptserve.kernels.sdpa_paged import GatherPlan

from tests.kernels.kernel_testing import TOLERANCE, paged_batch, rel_error

CTX = [1, 150, 9, 40, 16, 17]


@pytest.mark.parametrize("page_size", [5, 16])
@pytest.mark.parametrize("spare", [3, 200], ids=["one-run", "scattered"])
def test_matches_reference_and_never_reads_garbage(page_size, spare, dtype):
    args = paged_batch(CTX, [1] * len(CTX), page_size, n_head=3, head_dim=40, dtype=dtype,
                       device="cpu", spare=spare, head_major=True)  # fmt: skip
    assert args[1].transpose(1, 2).is_contiguous()
    ref = paged_attention_reference(*args)
    plan = plan_decode(args[3], page_size, 3)
    out = decode_attention_cpu(*args, plan=plan)
    # with 200 spare blocks the batch's blocks are spread over a run 2x too long: gathered
    assert (plan.run is None) == (spare == 200)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_slots_past_a_sequence_are_zeroed_and_nothing_else_changes():
    q, k, v, meta = paged_batch([3, 21], [1, 1], 8, n_head=2, head_dim=4, dtype=torch.float32,
                                device="cpu", head_major=True)  # fmt: skip
    tables = meta.block_tables
    k_before, v_before = k.clone(), v.clone()
    decode_attention_cpu(q, k, v, meta)
    assert torch.equal(k.nan_to_num(7), k_before.nan_to_num(7))  # keys are only read
    stale = torch.zeros_like(v, dtype=torch.bool)
    stale[tables[0, 0], 3:] = True  # sequence 0: 3 tokens in its only block
    stale[tables[1, 2], 5:] = True  # sequence 1: 21 tokens, 5 in its third block
    assert (v[stale] == 0).all()
    assert torch.equal(v[~stale].nan_to_num(7), v_before[~stale].nan_to_num(7))


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    one = paged_batch([37], [1], 8, n_head=2, head_dim=16, dtype=torch.float32, device="cpu",
                      head_major=True)  # fmt: skip
    q, k, v, meta = one
    tables = meta.block_tables
    alone = decode_attention_cpu(*one)
    # the same sequence, its blocks elsewhere in a bigger pool, beside two other sequences
    n_pool = 30
    k2 = torch.randn(n_pool, 2, 8, 16).transpose(1, 2)
    v2 = torch.randn(n_pool, 2, 8, 16).transpose(1, 2)
    moved = [11, 3, 25, 7, 20]
    k2[moved], v2[moved] = k[tables[0, :5].long()], v[tables[0, :5].long()]
    # a longer sequence first: the batch pads the shorter ones
    batch_tables = [[0, 1, 2, 4, 5, 13, 14, 15], moved, [6, 8, 9, 10, 12]]
    batch = AttentionMetadata.build(batch_tables, [60, 37, 33], [1, 1, 1], block_size=8)
    batch_q = torch.cat([torch.randn(1, 2, 16), q, torch.randn(1, 2, 16)])
    together = decode_attention_cpu(batch_q, k2, v2, batch)
    assert torch.equal(together[1], alone[0])


def test_refuses_what_it_does_not_cover():
    mixed = paged_batch([5, 9], [1, 3], 4, n_head=2, head_dim=8, dtype=torch.float32,
                        device="cpu", head_major=True)  # fmt: skip
    with pytest.raises(ValueError, match="decode steps over head-major pools"):
        decode_attention_cpu(*mixed)  # a prefill in the batch
    token_major = paged_batch([5, 9], [1, 1], 4, n_head=2, head_dim=8, dtype=torch.float32,
                              device="cpu")  # fmt: skip
    assert not is_head_major(*token_major[1:3])
    with pytest.raises(ValueError, match="decode steps over head-major pools"):
        decode_attention_cpu(*token_major)


@pytest.mark.parametrize(
    "q_lens, in_place",
    [([1, 1, 1], 3), ([1, 1, 4], 2), ([1, 3, 1], 1), ([3, 1, 1], 0), ([2, 3, 4], 0)],
)
@pytest.mark.parametrize("head_major", [True, False])
def test_the_dispatch_reads_leading_decodes_in_place_and_gathers_the_rest(
    q_lens, in_place, head_major
):
    args = paged_batch([5, 9, 13], q_lens, 4, n_head=2, head_dim=8, dtype=torch.float32,
                       device="cpu", head_major=head_major)  # fmt: skip
    q, k, v, meta = args
    # the backend that lays the pools out so: head-major is the CPU's (its PyTorch decode path
    # here; tests/kernels/test_native_decode.py has the compiled one), token-major SDPA's
    backend = CpuPagedBackend(native=False) if head_major else SdpaGatherBackend()
    step = backend.plan(meta, KVSpec(1, k.shape[0], 4, 2, 8, torch.float32, k.device))
    out = backend.attend(q, k, v, step)
    assert rel_error(out, paged_attention_reference(*args)) < TOLERANCE[torch.float32]
    assert meta.num_decodes == in_place
    plans = _plans_by_path(step)
    read_in_place = plans["cpu_decode"].seq_rows.shape[0] if "cpu_decode" in plans else 0
    assert read_in_place == (in_place if head_major else 0)
    assert ("sdpa_gather" in plans) == (in_place < 3 or not head_major)


def _plans_by_path(step) -> dict:
    """A step's typed plan, as its paths' plans: in place ("cpu_decode"), cascade
    ("cpu_prefill") and gather + SDPA ("sdpa_gather")."""
    if isinstance(step, SdpaGatherPlan):
        return {"sdpa_gather": step.gather}
    names = {DecodePlan: "cpu_decode", CascadePlan: "cpu_prefill", GatherPlan: "sdpa_gather"}
    return {names[type(p)]: p for p in (step.decode, step.rest_plan) if p is not None}


def _shared_prefix_batch(tables, ctx, n_pool, dtype=torch.float32):
    """Head-major pools full of random keys and values; the last block of each sequence is NaN
    past its length, as a real pool may be."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(n_pool, 2, 4, 8, generator=gen, dtype=dtype).transpose(1, 2)
    v = torch.randn(n_pool, 2, 4, 8, generator=gen, dtype=dtype).transpose(1, 2)
    for table, n in zip(tables, ctx):
        if n % 4:
            k[table[-1], n % 4 :] = float("nan")
            v[table[-1], n % 4 :] = float("nan")
    meta = AttentionMetadata.build(tables, ctx, [1] * len(tables), block_size=4)
    return torch.randn(len(tables), 2, 8, generator=gen, dtype=dtype), k, v, meta


@pytest.mark.parametrize(
    "tables, ctx, n_pool, shared_in_place",
    [
        # three sequences over one cached prefix (blocks 2 and 0), each with a last block of its own
        ([[2, 0, 5], [2, 0, 1], [2, 3]], [11, 10, 6], 8, True),
        # blocks held by 4, 3 and 2 sequences, a sequence holding nothing shared, a hole (block 6)
        ([[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5], [0, 7], [8, 9]], [14, 13, 9, 5, 6], 10, True),
        # shared blocks far apart in a big pool: the shared run is gathered
        ([[1, 60, 3], [1, 60, 4], [1, 5]], [12, 10, 7], 64, False),
    ],
)
def test_sequences_sharing_blocks_read_them_in_place_and_match_the_reference(
    tables, ctx, n_pool, shared_in_place, dtype
):
    q, k, v, meta = _shared_prefix_batch(tables, ctx, n_pool, dtype)
    ref = paged_attention_reference(q, k, v, meta)
    plan = plan_decode(meta, 4, 2)
    out = decode_attention_cpu(q, k, v, meta, plan=plan)
    assert plan.shared is not None
    assert (plan.shared.run is not None) == shared_in_place
    holders = [sum(b in t[: -(-n // 4)] for t, n in zip(tables, ctx)) for b in range(n_pool)]
    assert plan.shared.width == max(holders) - 1
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_a_shared_prefix_gives_each_holder_what_it_gets_alone():
    tables, ctx = [[0, 1, 2], [0, 1, 3], [0, 1, 4]], [10, 12, 9]
    q, k, v, meta = _shared_prefix_batch(tables, ctx, 5)
    together = decode_attention_cpu(q, k, v, meta)
    for i in range(3):
        alone = AttentionMetadata.build([tables[i]], [ctx[i]], [1], block_size=4)
        torch.testing.assert_close(
            together[i], decode_attention_cpu(q[i : i + 1], k, v, alone)[0], atol=1e-6, rtol=0
        )


def test_a_shared_last_block_is_refused():
    # sequence 1's newest key would sit in a block sequence 0 reads too: KVCache never builds this
    q, k, v, meta = _shared_prefix_batch([[0, 1], [0, 1]], [6, 7], 2)
    with pytest.raises(ValueError, match="last block is shared"):
        decode_attention_cpu(q, k, v, meta)
