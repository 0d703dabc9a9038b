"""CPU prefill attention over a shared cached prefix (cascade), against the reference.

`dtype` comes from conftest.py (fp32 and fp16; bf16 too where CUDA is present).
"""

from __future__ import annotations

import gptserve.kernels.cpu.cascade as prefill_cpu
import gptserve.kernels.cpu.products as cpu_products
import pytest
import torch
from gptserve.kernels.backends import CpuPagedBackend, KVSpec
from gptserve.kernels.cpu.cascade import plan_cascade, prefill_attention_cpu
from gptserve.kernels.cpu.decode import DecodePlan
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.reference import paged_attention_reference
from gptserve.kernels.sdpa_paged import GatherPlan

from tests.kernels.kernel_testing import TOLERANCE, rel_error

BS = 4


def _batch(tables, ctx, q_lens, n_pool, dtype=torch.float32, n_head=2, head_dim=8):
    """Head-major pools of random keys and values, NaN past each sequence's end in its last
    block (as a real pool may be), and the step's queries."""
    gen = torch.Generator().manual_seed(2)
    shape = (n_pool, n_head, BS, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(shape, generator=gen).to(dtype).transpose(1, 2)
    for table, n in zip(tables, ctx):
        if n % BS:
            k[table[-1], n % BS :] = float("nan")
            v[table[-1], n % BS :] = float("nan")
    meta = AttentionMetadata.build(tables, ctx, q_lens, block_size=BS)
    q = torch.randn(meta.num_tokens, n_head, head_dim, generator=gen).to(dtype)
    return q, k, v, meta


CASES = {
    # three sequences continue blocks 2, 0 (cached) with new tokens in blocks of their own
    "one group": ([[2, 0, 5, 6], [2, 0, 1], [2, 0, 3, 7]], [15, 10, 13], [6, 2, 5], 8),
    # the group's prefix is cut where a member's new tokens begin (inside block 0 for the second)
    "cut at new tokens": ([[2, 0, 5], [2, 0, 1], [2, 0, 3]], [12, 9, 11], [1, 4, 3], 8),
    # two groups, and a sequence that shares nothing (its whole context is its own)
    "two groups and a loner": (
        [[0, 1, 2], [0, 1, 3], [4, 5, 6, 7], [4, 5, 8], [9, 10]],
        [12, 11, 14, 10, 7],
        [3, 2, 6, 1, 7],
        12,
    ),
    # members whose tables agree further than the shortest cached part: the minimum wins
    "uneven": ([[3, 1, 4, 5, 6], [3, 1, 4, 2], [3, 1, 7]], [20, 14, 9], [3, 2, 4], 8),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "matmul"])
def test_matches_reference_and_never_reads_garbage(case, onednn, dtype, monkeypatch):
    if not onednn:
        monkeypatch.setattr(prefill_cpu, "onednn_products", lambda: False)
    q, k, v, meta = _batch(*CASES[case], dtype=dtype)
    plan = plan_cascade(meta, BS)
    assert plan.groups  # two or more sequences continue the same cached blocks
    out = prefill_attention_cpu(q, k, v, meta, plan=plan)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < TOLERANCE[dtype]


def test_groups_cover_what_the_members_have_cached_and_nothing_else():
    tables, ctx, q_lens, n_pool = CASES["two groups and a loner"]
    q, k, v, meta = _batch(tables, ctx, q_lens, n_pool)
    plan = plan_cascade(meta, BS)
    # sequences 0, 1: blocks 0 and 1 in common, but sequence 1 has 9 tokens cached (2 blocks);
    # sequences 2, 3: blocks 4, 5 in common, sequence 2 has 8 cached, sequence 3 has 9
    assert [g.blocks.tolist() for g in plan.groups] == [[0, 1], [4, 5]]
    assert [g.rows.tolist() for g in plan.groups] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    assert [s.group for s in plan.seqs] == [0, 0, 1, 1, None]
    assert [s.blocks.tolist() for s in plan.seqs] == [[2], [3], [6, 7], [8], [9, 10]]


def test_a_sequence_that_agrees_only_briefly_is_left_out_of_the_group():
    # three sequences share blocks 0-3; a fourth shares only block 0 (say, a different system
    # prompt that starts alike): with it the group could share one block, without it four
    tables = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 1, 2, 3, 6], [0, 7, 8, 9, 10]]
    q, k, v, meta = _batch(tables, [19, 18, 20, 19], [2, 1, 3, 2], 12)
    plan = plan_cascade(meta, BS)
    assert plan.groups
    assert [g.blocks.tolist() for g in plan.groups] == [[0, 1, 2, 3]]
    assert [s.group for s in plan.seqs] == [0, 0, 0, None]
    out = prefill_attention_cpu(q, k, v, meta, plan=plan)
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < TOLERANCE[torch.float32]


def test_long_runs_of_queries_are_scored_in_slices(monkeypatch):
    monkeypatch.setattr(prefill_cpu, "SCORE_BYTES", 64)  # a few rows at a time
    q, k, v, meta = _batch(*CASES["one group"])
    whole = paged_attention_reference(q, k, v, meta)
    for onednn in (True, False):
        monkeypatch.setattr(prefill_cpu, "onednn_products", lambda on=onednn: on)
        out = prefill_attention_cpu(q, k, v, meta)  # planned afresh, for this call
        assert rel_error(out, whole) < TOLERANCE[torch.float32]


def _cpu_step(q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata):
    """The CPU backend's plan of the step (pools of `k`'s shape), and its attention (decodes in
    PyTorch operations: tests/kernels/test_native_decode.py has the compiled kernel's)."""
    spec = KVSpec(1, k.shape[0], BS, k.shape[2], k.shape[3], k.dtype, k.device)
    backend = CpuPagedBackend(native=False)
    step = backend.plan(meta, spec)
    return step, lambda k, v: backend.attend(q, k, v, step)


def test_no_shared_prefix_leaves_the_step_to_gather_and_sdpa():
    # one sequence alone, and two whose tables start alike but have nothing cached yet
    for tables, ctx, q_lens in (([[0, 1, 2]], [10], [3]), ([[0, 1], [0, 2]], [6, 7], [6, 7])):
        q, k, v, meta = _batch(tables, ctx, q_lens, 4)
        assert not plan_cascade(meta, BS).groups
        step, attend = _cpu_step(q, k, meta)
        out = attend(k, v)
        assert isinstance(step.rest_plan, GatherPlan)
        assert rel_error(out, paged_attention_reference(q, k, v, meta)) < 1e-3


def test_the_dispatch_sends_a_step_with_decodes_and_a_shared_prefix_both_ways():
    tables = [[9, 10], [2, 0, 5], [2, 0, 1]]
    q, k, v, meta = _batch(tables, [6, 11, 10], [1, 3, 2], 12)
    step, attend = _cpu_step(q, k, meta)
    out = attend(k, v)
    assert step.decodes.num_seqs == 1 and step.rest.num_seqs == 2  # the step split in two
    assert isinstance(step.decode, DecodePlan) and step.rest_plan.groups
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < 1e-3


def test_onednn_products_equal_plain_ones():
    a, b = torch.randn(5, 7), torch.randn(3, 7)
    torch.testing.assert_close(cpu_products.product_nt(a, b), a @ b.t())
    torch.testing.assert_close(cpu_products.product_nt(a, b.t().contiguous().t()), a @ b.t())
