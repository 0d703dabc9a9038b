"""A training step with the head's products on oneDNN (model.dense_matmul, the default on a CPU)
follows the step with them on torch.mm (MKL, the code before) within float32 rounding: the same
losses, gradient norms and weights over a few AdamW updates, with GPT-2's whole vocabulary."""

from __future__ import annotations

import pytest
import torch
from gptserve.model import GPT, ModelConfig, dense_matmul
from gptserve.training.step import LossModule, make_optimizer, train_step


def run_steps(steps: int = 3) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=64))
    module = LossModule(model)
    optimizer = make_optimizer(model, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(steps):
        w = torch.randint(0, 50257, (2, 33), generator=g)
        loss, norm, applied = train_step(module, optimizer, [(w[:, :-1], w[:, 1:])], 1.0)
        assert applied
        losses.append(loss)
        norms.append(norm)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_onednn_head_steps_as_the_torch_mm_head(monkeypatch: pytest.MonkeyPatch) -> None:
    if not dense_matmul.available():
        pytest.skip("this PyTorch build has no oneDNN")
    fast = run_steps()
    monkeypatch.setattr(dense_matmul, "available", lambda: False)
    before = run_steps()
    assert fast[0] == pytest.approx(before[0], rel=1e-5)  # losses
    assert fast[1] == pytest.approx(before[1], rel=1e-4)  # gradient norms
    assert abs(fast[0][-1] - fast[0][0]) > 1e-3  # the steps did move the weights
    # AdamW divides each gradient by its own running size: where a gradient is near zero its
    # rounding moves the update by a part of lr (6e-4); measured at most 1.6e-5, in 0.006 % of
    # one matrix's elements
    for name, weight in before[2].items():
        torch.testing.assert_close(fast[2][name], weight, rtol=0, atol=1e-4, msg=name)
