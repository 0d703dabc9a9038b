"""Llama-family checkpoints saved by transformers load with load_checkpoint and give its logits.

The oracle is transformers itself: tiny random models of each architecture, saved here (single
file and sharded, float32 and bfloat16), loaded by our loader, compared position by position and
over 32 greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gptserve.model import CheckpointError, load_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
CASES = {
    "llama-gqa-untied": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4)),
    "qwen3-qknorm-headdim": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}  # fmt: skip


def make(kind: str, path: Path, dtype: torch.dtype = torch.float32, **save: object):
    config_cls, model_cls, extra = CASES[kind]
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norms and biases, so a mis-mapped one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    model.to(dtype).save_pretrained(path, **save)
    return model


def greedy(step, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(step(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(kind: str, tmp_path: Path) -> None:
    ref = make(kind, tmp_path)
    ours = load_checkpoint(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(idx).logits
        got = ours(idx)
        assert (got - expected).abs().max().item() < 1e-4
        prompt = idx[0, :7].tolist()
        want = greedy(lambda t: ref(t).logits, prompt, 32)
        assert greedy(ours, prompt, 32) == want


def test_sharded_bfloat16_checkpoint_keeps_its_dtype_or_is_cast(tmp_path: Path) -> None:
    ref = make("qwen2-bias", tmp_path, dtype=torch.bfloat16, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    kept = load_checkpoint(tmp_path)
    assert next(kept.parameters()).dtype == torch.bfloat16
    cast = load_checkpoint(tmp_path, dtype=torch.float32)
    idx = torch.arange(20)[None]
    with torch.no_grad():
        expected = ref.float()(idx).logits
        assert (cast(idx) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["FalconForCausalLM"]}, "supported: GPT2LMHeadModel, LlamaForCausalLM"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_checkpoints_are_refused_in_one_line(
    tmp_path: Path, change: dict, message: str
) -> None:
    make("mistral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)
