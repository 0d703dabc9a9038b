"""Sliding-window checkpoints saved by transformers (Mistral's `sliding_window`, Qwen2's
`use_sliding_window` with `max_window_layers`) load with their windows and give its logits, and
transformers really applies the windows (its logits without them differ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gptserve.model import load_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
CASES = {
    "mistral-w8": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8), (8, 8)),
    "mistral-w1": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=1), (1, 1)),
    "qwen2-w6-from-layer-1": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=6, max_window_layers=1), (None, 6)),
}  # fmt: skip


def make_windowed(kind: str, path: Path, attn: str = "eager"):
    """A tiny random transformers model of `kind`, saved to `path`, and its expected windows."""
    config_cls, model_cls, extra, windows = CASES[kind]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(path)
    return model, windows


def _unwindowed(path: Path, model_cls: str, attn: str):
    """The same weights with every window taken off, as transformers loads them."""
    config = json.loads((path / "config.json").read_text())
    config.update(sliding_window=None, use_sliding_window=False)
    config.pop("layer_types", None)
    plain = path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    (plain / "model.safetensors").symlink_to(path / "model.safetensors")
    cls = getattr(transformers, model_cls)
    return cls.from_pretrained(plain, attn_implementation=attn).eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_windowed_logits_match_transformers(kind: str, attn: str, tmp_path: Path) -> None:
    ref, windows = make_windowed(kind, tmp_path, attn)
    ours = load_checkpoint(tmp_path)
    assert ours.config.layer_windows() == windows
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(idx).logits
        assert (ours(idx) - expected).abs().max().item() < 1e-4
        plain = _unwindowed(tmp_path, CASES[kind][1], attn)(idx).logits
    assert (plain - expected)[:, 20:].abs().max().item() > 1e-3  # the window is applied
