"""The model's layers take their windows from the config (`ModelConfig.layer_windows`)."""

from __future__ import annotations

import torch
from gptserve.kernels.reference import attention_reference
from gptserve.model import GPT, ModelConfig


def _config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64, block_size=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
        pos_encoding="rotary", norm="rmsnorm", activation="swiglu", bias=False,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_each_layer_gets_its_window():
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    model = GPT(_config(sliding_window=4, layer_types=kinds))
    assert [b.attn.window for b in model.transformer.h] == [4, None, 4]
    assert [b.attn.window for b in GPT(_config(sliding_window=6)).transformer.h] == [6, 6, 6]
    assert [b.attn.window for b in GPT(_config()).transformer.h] == [None] * 3


def test_full_forward_applies_the_window(monkeypatch):
    """A windowed model's logits equal the same weights' run through the reference with the
    window, and differ from a run without it past the window."""
    torch.manual_seed(0)
    model = GPT(_config(sliding_window=4)).eval()
    plain = GPT(_config()).eval()
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        got = model(idx)
        unwindowed = plain(idx)
        for block in plain.transformer.h:  # the same model through the reference, window 4
            block.attn.window = 4
        monkeypatch.setattr(
            "gptserve.model.gpt.flash_attention",
            lambda q, k, v, causal=True, window=None: attention_reference(q, k, v, window=window),
        )
        want = plain(idx)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got[:, :4], unwindowed[:, :4], atol=1e-5)  # within the window: same
    assert not torch.allclose(got[:, 8:], unwindowed[:, 8:], atol=1e-3)
