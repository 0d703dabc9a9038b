"""The CPU paged-attention path (gather + SDPA) against `paged_attention_reference`.

`dtype` comes from conftest.py (fp32 and fp16; bf16 too where CUDA is present).
"""

from __future__ import annotations

import dataclasses

import gptserve.kernels.sdpa_paged as sdpa_paged
import pytest
import torch
from gptserve.kernels.backends import KVSpec, SdpaGatherBackend
from gptserve.kernels.reference import paged_attention_reference
from gptserve.kernels.sdpa_paged import paged_attention_sdpa

from tests.kernels.kernel_testing import TOLERANCE, paged_batch, rel_error

CASES = {
    "decode": dict(ctx_lens=[1, 150, 9, 40], q_lens=[1, 1, 1, 1]),
    "mixed": dict(ctx_lens=[1, 150, 9, 40, 33], q_lens=[1, 1, 9, 17, 33]),
    "prefill": dict(ctx_lens=[7, 64], q_lens=[7, 64]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("page_size", [5, 16])
@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups-of-1"])
def test_matches_reference_and_never_reads_garbage(case, page_size, grouped, dtype, monkeypatch):
    if grouped:  # every sequence its own group: the per-group slicing and concatenation
        monkeypatch.setattr(sdpa_paged, "GROUP_BYTES", 1)
    args = paged_batch(
        **CASES[case], page_size=page_size, n_head=3, head_dim=40, dtype=dtype, device="cpu"
    )
    out = paged_attention_sdpa(*args)
    ref = paged_attention_reference(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_a_group_copies_only_its_own_longest_context(dtype, monkeypatch):
    """A short prompt beside a long one is gathered and attended at its own length (a deep
    prompt's chunk must not make every other sequence of the step attend to its depth); groups
    of two or three sequences, sized by what their copy takes, still match the reference."""
    block_bytes = 2 * 16 * 3 * 40 * dtype.itemsize  # K + V of one 16-slot block
    monkeypatch.setattr(sdpa_paged, "GROUP_BYTES", 20 * block_bytes)
    case = dict(ctx_lens=[300, 12, 30, 40, 290], q_lens=[8, 12, 30, 1, 5])
    args = paged_batch(**case, page_size=16, n_head=3, head_dim=40, dtype=dtype, device="cpu")
    meta = args[3]
    plan = sdpa_paged.plan_gather(meta, 16, 3, 40, dtype.itemsize)
    assert [(g.first, g.last, g.n_keys) for g in plan.groups] == [
        (0, 1, 304), (1, 4, 48), (4, 5, 304),
    ]  # fmt: skip
    assert plan.groups[1].mask.shape == (3, 1, 30, 48)  # its own longest query and context
    out = paged_attention_sdpa(*args, plan=plan)
    ref = paged_attention_reference(*args)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_layers_of_one_step_share_a_plan_and_the_next_step_gets_its_own():
    q, k_cache, v_cache, meta = paged_batch(
        **CASES["mixed"], page_size=5, n_head=2, head_dim=8, dtype=torch.float32, device="cpu"
    )
    backend = SdpaGatherBackend()
    spec = KVSpec(1, k_cache.shape[0], 5, 2, 8, torch.float32, k_cache.device)
    step = backend.plan(meta, spec)
    plan = step.gather
    first = backend.attend(q, k_cache, v_cache, step)
    assert rel_error(first, paged_attention_reference(q, k_cache, v_cache, meta)) < 1e-3
    # another layer of the same step: the same plan, other pools and queries
    k2, v2 = k_cache * 2, v_cache + 1
    out = backend.attend(q * 3, k2, v2, step)
    assert step.gather is plan
    ref = paged_attention_reference(q * 3, k2, v2, meta)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]
    # the next step (new metadata, equal values) plans for itself; the first step's plan is kept
    again = backend.plan(dataclasses.replace(meta), spec)
    assert again.gather is not plan and step.gather is plan
    assert torch.equal(backend.attend(q, k_cache, v_cache, again), first)


def test_inputs_made_in_inference_mode_work():
    with torch.inference_mode():
        args = paged_batch(
            **CASES["mixed"], page_size=5, n_head=2, head_dim=8, dtype=torch.float32, device="cpu"
        )
        first = paged_attention_sdpa(*args)
        again = paged_attention_sdpa(*args)
    ref = paged_attention_reference(*args)
    assert rel_error(first, ref) < TOLERANCE[torch.float32]
    assert torch.equal(first, again)
