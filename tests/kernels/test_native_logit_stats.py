"""The compiled per-row argmax and log-sum-exp the sampler reads (`kernels/cpu/logit_stats.cpp`)
against PyTorch's, with masked (-inf) tokens, ties and a row alone or in a batch."""

from __future__ import annotations

import pytest
import torch
from gptserve.engine.sampler import SampleRow, SamplingParams, sample
from gptserve.kernels.cpu import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="GPTSERVE_NATIVE=0")


@pytest.mark.parametrize("width", [1, 15, 16, 50257])
def test_argmax_and_logsumexp_are_pytorchs(width):
    logits = torch.randn(5, width, generator=torch.Generator().manual_seed(width)) * 4
    logits[1, ::3] = float("-inf")  # a grammar's mask
    logits[2] = logits[2].round()  # ties: the first largest wins, as torch.argmax
    best, lse = native.logit_stats_op()(logits)
    assert torch.equal(best, logits.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-6)


def test_a_row_is_the_same_alone_and_in_a_batch():
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0))
    best, lse = native.logit_stats_op()(logits)
    for i in range(9):
        one_best, one_lse = native.logit_stats_op()(logits[i : i + 1].clone())
        assert one_best.item() == best[i].item() and one_lse.item() == lse[i].item()


def test_the_sampler_reports_log_softmax_values():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=4), [1, 2], [], None, None)] * 3
    out = sample(logits, rows)
    log_probs = torch.log_softmax(logits, -1)
    assert out.tokens == logits.argmax(-1).tolist()
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(log_probs[i, out.tokens[i]].item(), abs=1e-5)
        values, ids = log_probs[i].topk(4)
        assert out.top_ids[i] == ids.tolist()
        assert out.top_logprobs[i] == pytest.approx(values.tolist(), abs=1e-5)


def test_a_nan_wins_as_in_torch_argmax():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    logits[0, 123] = float("nan")
    logits[0, 200] = float("nan")
    best, lse = native.logit_stats_op()(logits)
    assert torch.equal(best, logits.argmax(-1))  # 123 for the first row
    assert lse[0].isnan() and not lse[1].isnan()


def test_a_wholly_masked_row_gives_no_number():
    logits = torch.full((1, 8), float("-inf"))
    best, lse = native.logit_stats_op()(logits)
    assert best.item() == 0 and lse.item() == float("-inf")


def test_without_the_log_sum_exp_the_argmax_is_the_same():
    logits = torch.randn(6, 50257, generator=torch.Generator().manual_seed(3)) * 4
    logits[1, ::3] = float("-inf")
    logits[2] = logits[2].round()  # ties
    logits[3, 77] = float("nan")
    logits[4] = float("-inf")  # wholly masked
    best, lse = native.logit_stats_op()(logits, False)
    assert torch.equal(best, logits.argmax(-1)) and torch.equal(
        best, native.logit_stats_op()(logits)[0]
    )
    assert lse.isnan().all()
