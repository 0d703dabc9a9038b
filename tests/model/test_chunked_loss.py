"""GPT.loss computes the head and the cross-entropy in row chunks (model.chunked_loss): its loss and
every parameter's gradient must be those of the plain computation over the whole batch's logits,
`F.cross_entropy(model(idx).float(), targets, ignore_index=-1)`, within float32 rounding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.model import GPT, ModelConfig
from gptserve.model.chunked_loss import head_loss
from gptserve.training.lora import inject_lora


def gpt2(vocab_size: int = 50257, **fields: object) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64,
                           **fields))  # fmt: skip


def llama(**fields: object) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(
        vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=64, intermediate_size=96,
        bias=False, tie_embeddings=False, pos_encoding="rotary", norm="rmsnorm",
        activation="swiglu", **fields,
    ))  # fmt: skip


def batch(vocab: int, ignored: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (3, 20), generator=g)
    targets = torch.randint(0, vocab, (3, 20), generator=g)
    if ignored:  # a chat batch's prompt and padding positions
        targets[0, :5] = -1
        targets[2, 12:] = -1
    return idx, targets


def plain_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1),
                           ignore_index=-1)  # fmt: skip


def chunked_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    return head_loss(model, model._final_norm(model.hidden(idx)), targets, -1, chunk_rows=rows)


def loss_and_grads(
    model: nn.Module, compute: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(model: GPT, rows: int, atol: float = 1e-6, rtol: float = 1e-4,
                autocast: bool = False) -> None:  # fmt: skip
    idx, targets = batch(model.config.vocab_size)
    ctx = torch.autocast("cpu", torch.bfloat16, enabled=autocast)
    with ctx:
        want, want_grads = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
    with ctx:
        got, got_grads = loss_and_grads(model, lambda: chunked_loss(model, idx, targets, rows))
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("rows", [7, 60, 4096])  # many chunks (a short last one), one, one large
def test_gpt2_tied_loss_and_every_gradient_are_the_plain_ones(rows: int) -> None:
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_same(model, rows)


def test_the_default_chunking_through_model_loss() -> None:
    model = gpt2()
    idx, targets = batch(50257)
    want, want_grads = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
    got, got_grads = loss_and_grads(model, lambda: model.loss(idx, targets))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_untied_head_with_a_logit_softcap() -> None:
    assert_same(llama(logit_softcap=3.0), rows=11)


def test_a_frozen_head_under_lora_gives_the_adapter_the_plain_gradients() -> None:
    model = gpt2(vocab_size=500)
    inject_lora(model, ("q", "v", "up"), rank=4, alpha=8.0, dropout=0.0)
    with torch.no_grad():  # B starts at zero: give the pairs some effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    assert not model.lm_head.weight.requires_grad
    assert_same(model, rows=9)


def test_bfloat16_autocast_matches_the_plain_autocast_loss() -> None:
    assert_same(gpt2(vocab_size=1000), rows=13, autocast=True, atol=2e-3, rtol=2e-2)


class BiasedHead(nn.Module):
    """Not a plain nn.Linear: the chunks are recomputed in backward instead (checkpoint)."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_any_other_head_is_chunked_with_checkpointing() -> None:
    model = gpt2(vocab_size=700, tie_embeddings=False)
    model.lm_head = BiasedHead(nn.Linear(64, 700, bias=True))
    assert_same(model, rows=8)


def test_without_gradients_and_with_every_target_ignored() -> None:
    model = gpt2(vocab_size=400)
    idx, targets = batch(400)
    with torch.no_grad():
        torch.testing.assert_close(chunked_loss(model, idx, targets, 5),
                                   plain_loss(model, idx, targets), rtol=1e-5, atol=1e-6)  # fmt: skip
    none = torch.full_like(targets, -1)
    assert torch.isnan(chunked_loss(model, idx, none, 5)) and torch.isnan(model.loss(idx, none))
