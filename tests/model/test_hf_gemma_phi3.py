"""Gemma 3 and Phi-3 (Phi-4-mini's partial rotation too) checkpoints saved by transformers load
with load_checkpoint and give its logits; our own checkpoints of them round-trip; what we do not
run is refused in one line.

The oracle is transformers: tiny random models (norms and all weights random), compared position
by position and over 24 greedy tokens. The Gemma 3 model alternates sliding and global layers
(two rotary bases, linear scaling on the global one), scales queries by query_pre_attn_scalar
and soft-caps its logits; its sequences stay inside the window (the windowing is not tested here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gptserve.model import CheckpointError, ModelConfig, load_checkpoint
from gptserve.model.checkpoint import save_checkpoint
from gptserve.model.config import ConfigError

from tests.model.test_hf_llama import greedy

transformers = pytest.importorskip("transformers")

VOCAB = 256
GEMMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
    sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
    rope_theta=100_000.0, rope_local_base_freq=10_000.0,
    rope_scaling={"rope_type": "linear", "factor": 4.0}, query_pre_attn_scalar=40,
    final_logit_softcapping=2.0,
)  # fmt: skip
PHI3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    sliding_window=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
CASES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA),
    "gemma3-untied-default-rope": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **GEMMA, "tie_word_embeddings": False, "rope_scaling": None,
        "query_pre_attn_scalar": 24, "final_logit_softcapping": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", PHI3),
    # a long-context Phi-3 within its original context (64 of 256 positions)
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {
        **PHI3, "original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.3, 1.9, 2.4, 3.1, 3.3, 3.8, 4.0],
            "long_factor": [4.0, 5.5, 7.0, 8.0, 9.5, 10.0, 11.0, 12.0]}}),
    # Phi-4-mini's partial rotation: the first 12 of each head's 16 channels rotate
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", {**PHI3, "partial_rotary_factor": 0.75}),
    # ... with longrope (as Phi-4-mini ships): short factors for the 12 rotated channels
    "phi4-mini-longrope": ("Phi3Config", "Phi3ForCausalLM", {
        **PHI3, "original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.4, 2.1, 2.9, 3.5, 4.0],
            "long_factor": [4.0, 6.0, 8.0, 9.5, 11.0, 12.0]}}),
}  # fmt: skip


def randomize(model: torch.nn.Module) -> None:
    """Random weights of a size that moves logits, norms around their identity: a mis-mapped
    tensor shows."""
    gemma = "Gemma" in type(model).__name__
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def make(kind: str, path: Path, dtype: torch.dtype = torch.float32, **extra: object):
    config_cls, model_cls, fields = CASES[kind]
    config = getattr(transformers, config_cls)(**{**fields, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    randomize(model)
    model.to(dtype).save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(kind: str, tmp_path: Path) -> None:
    ref = make(kind, tmp_path)
    ours = load_checkpoint(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(idx).logits
        got = ours(idx)
        assert expected.std() > 0.3  # logits that a wrong weight would move
        assert (got - expected).abs().max().item() < 1e-4
        prompt = idx[0, :7].tolist()
        want = greedy(lambda t: ref(t).logits, prompt, 24)
        assert greedy(ours, prompt, 24) == want


def test_gemma3_fields_are_read(tmp_path: Path) -> None:
    make("gemma3", tmp_path)
    c = load_checkpoint(tmp_path).config
    assert (c.norm, c.activation, c.sandwich_norm, c.qk_norm) == (
        "gemma_rmsnorm",
        "geglu",
        True,
        True,
    )
    assert c.embed_scale == 8.0 and c.logit_softcap == 2.0 and c.query_pre_attn_scalar == 40
    assert (c.rope_theta, c.rope_local_theta) == (100_000.0, 10_000.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert c.layer_windows() == (64, None, 64, None) and c.head_dim == 24


def test_gemma3_older_config_keys_give_the_same_model(tmp_path: Path) -> None:
    """Hub configs of Gemma 3 name rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern instead of rope_parameters and layer_types."""
    make("gemma3", tmp_path)
    new = load_checkpoint(tmp_path).config
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(rope_theta=100_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 4.0})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_checkpoint(tmp_path).config == new


def test_bfloat16_gemma3_keeps_its_dtype_and_rounds_as_transformers(tmp_path: Path) -> None:
    ref = make("gemma3", tmp_path, dtype=torch.bfloat16)
    ours = load_checkpoint(tmp_path)
    assert (
        next(ours.parameters()).dtype == torch.bfloat16 and ours.embed_scale.dtype == torch.bfloat16
    )
    idx = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = ref(idx).logits.float(), ours(idx).float()
    # the first position (no attention over others) to the bit: the norms, embedding scale and
    # GeGLU round as transformers'; later ones by the attention kernels' bfloat16 rounding
    assert torch.equal(got[:, 0], expected[:, 0])
    assert (got - expected).abs().max().item() < 0.1  # of logits within 2


def test_gemma3_multimodal_directory_serves_its_text_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration directory: its text_config and language-model weights.
    (transformers' multimodal class applies no final_logit_softcapping, Gemma 3's published
    configs set none: none here.)"""
    text = transformers.Gemma3TextConfig(**{**GEMMA, "final_logit_softcapping": None})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize(ref)
    ref.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    idx = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(idx) - ref(input_ids=idx).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
def test_our_checkpoint_of_each_family_round_trips(kind: str, tmp_path: Path) -> None:
    make(kind, tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf")
    save_checkpoint(model, tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["format"] == "gptserve" and ModelConfig.from_dict(saved) == model.config
    again = load_checkpoint(tmp_path / "ours")
    idx = torch.arange(30)[None]
    with torch.no_grad():
        assert torch.equal(again(idx), model(idx))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(embed_scale=0.0), "embed_scale must be a positive number"),
        (dict(logit_softcap="30"), "logit_softcap must be a positive number"),
        (dict(query_pre_attn_scalar=32, qk_norm=False), "query_pre_attn_scalar needs qk_norm"),
        (dict(norm="rmsnorm"), "query_pre_attn_scalar needs qk_norm and norm 'gemma_rmsnorm'"),
        (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0]}), "short_factor must"),
        (dict(rope_local_theta=1e4, layer_types=None), "rope_local_theta needs"),
        (dict(norm="gemma"), "norm must be one of"),
        (dict(activation="gelu_gated"), "activation must be one of"),
        (dict(rope_scaling={"rope_type": "yarn"}), "rope_scaling type 'yarn' is not supported"),
    ],
)
def test_new_config_fields_are_validated(change: dict, message: str, tmp_path: Path) -> None:
    make("gemma3", tmp_path)
    fields = load_checkpoint(tmp_path).config.to_dict()
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**fields, **change})


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ("phi3", {"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1 of head_dim 16"),
        ("phi3", {"partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number"),
        ("phi3", {"rope_scaling": {"rope_type": "longrope", "long_factor": [2.0] * 8}},
         "longrope rope_scaling needs short_factor"),
        ("phi3", {"architectures": ["Phi4MMForCausalLM"]},
         "supported: GPT2LMHeadModel, .*Phi3ForCausalLM, Gemma3ForCausalLM"),
    ],
)  # fmt: skip
def test_unsupported_checkpoints_are_refused_in_one_line(
    kind: str, change: dict, message: str, tmp_path: Path
) -> None:
    make(kind, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    if kind == "phi3" and "rope_scaling" in change:
        raw.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
def test_sequences_past_a_small_window_match_transformers(kind: str, tmp_path: Path) -> None:
    """Window 8 over 40 tokens (Gemma 3: sliding and global layers alternate; Phi-3: every
    layer windowed); transformers must really window: its logits past the window differ from
    the same weights' without one."""
    ref = make(kind, tmp_path / "w", sliding_window=8)
    wide = make(kind, tmp_path / "wide", sliding_window=200)  # the same weights, no window
    ours = load_checkpoint(tmp_path / "w")
    assert {w for w in ours.config.layer_windows()} == ({8, None} if kind == "gemma3" else {8})
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(idx).logits
        assert (expected[:, 12:] - wide(idx).logits[:, 12:]).abs().max() > 0.1
        assert (ours(idx) - expected).abs().max().item() < 1e-4
        prompt = idx[0, :5].tolist()
        assert greedy(ours, prompt, 24) == greedy(lambda t: ref(t).logits, prompt, 24)


@pytest.mark.parametrize("kind", ["phi4-mini", "phi4-mini-longrope"])
def test_phi4_mini_rotates_part_of_each_head_as_transformers(kind: str, tmp_path: Path) -> None:
    """partial_rotary_factor 0.75 of 16 channels: 12 rotate (their frequencies over 12), 4 pass
    through; transformers must really rotate part only: the same weights rotated whole differ."""
    ref = make(kind, tmp_path / "part")
    whole = make("phi3", tmp_path / "whole")  # the same weights (same seed and shapes)
    ours = load_checkpoint(tmp_path / "part")
    assert (ours.config.rotary_dim, ours.config.rope_dim, ours.config.head_dim) == (12, 12, 16)
    assert ours.rope_inv_freq.shape == (6,)
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = ref(idx).logits
        assert (expected[:, 1:] - whole(idx).logits[:, 1:]).abs().max() > 0.1
        assert (ours(idx) - expected).abs().max().item() < 1e-4
    save_checkpoint(ours, tmp_path / "ours")  # our own checkpoint keeps the rotary dim
    assert load_checkpoint(tmp_path / "ours").config == ours.config


def test_a_rotary_dim_is_validated() -> None:
    base = dict(n_embd=64, n_head=4, pos_encoding="rotary")
    assert ModelConfig(**base, rotary_dim=12).rope_dim == 12
    assert ModelConfig(**base).rope_dim == 16
    for bad in (11, 18, 0):
        with pytest.raises(ConfigError, match="rotary_dim must be"):
            ModelConfig(**base, rotary_dim=bad)
    with pytest.raises(ConfigError, match="rotary_dim must be"):
        ModelConfig(n_embd=64, n_head=4, rotary_dim=12)  # learned positions: nothing rotates


def test_phi3_longrope_serves_its_original_context_as_transformers(tmp_path: Path) -> None:
    """Within 64 tokens transformers rotates a longrope Phi-3 by its short factors and scales
    cos and sin by the attention factor; the context is capped there (the long factors, past
    it, are not implemented)."""
    ref = make("phi3-longrope", tmp_path)
    ours = load_checkpoint(tmp_path)
    assert ours.config.block_size == 64 and ours.rope_factor > 1.1
    idx = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max().item() < 1e-4
