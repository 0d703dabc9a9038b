"""The CPU paged-attention path (gather + SDPA) against `paged_attention_reference`.

`dtype` comes from conftest.py (fp32 and fp16; bf16 too where CUDA is present).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, paged_batch, rel_error

from kernels.reference import paged_attention_reference
from kernels.sdpa_paged import paged_attention_sdpa

CASES = {
    "decode": dict(ctx_lens=[1, 150, 9, 40], q_lens=[1, 1, 1, 1]),
    "mixed": dict(ctx_lens=[1, 150, 9, 40, 33], q_lens=[1, 1, 9, 17, 33]),
    "prefill": dict(ctx_lens=[7, 64], q_lens=[7, 64]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("page_size", [5, 16])
def test_matches_reference_and_never_reads_garbage(case, page_size, dtype):
    args = paged_batch(
        **CASES[case], page_size=page_size, n_head=3, head_dim=40, dtype=dtype, device="cpu"
    )
    out = paged_attention_sdpa(*args)
    ref = paged_attention_reference(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[dtype]
