"""PEFT's adapter files read into our pieces and written from them, with PEFT itself as oracle.

Adapters are made by `peft` on tiny random transformers models (random B, so every update
shows); our model loads the same directory and merges what `read_peft` returns; the logits must
be PEFT's. Written adapters must load in PEFT with the logits of our model plus the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gptserve.model import load_checkpoint
from gptserve.model.lora.adapter import LoraAdapter, LoraPiece
from gptserve.model.lora.merge import merge_into
from gptserve.model.lora.modules import target_slices
from gptserve.model.lora.peft_format import AdapterError, BaseMismatchError, read_peft, write_peft

from tests.model.lora.hf_models import make_hf, randomize_lora_b, tokens

peft = pytest.importorskip("peft")

CASES = {
    "gpt2-all": ("gpt2", dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                              fan_in_fan_out=True)),
    "gpt2-attn-proj-only": ("gpt2", dict(r=2, lora_alpha=3, target_modules=["attn.c_proj"],
                                         fan_in_fan_out=True)),
    "llama-all-rslora": ("llama", dict(
        r=4, lora_alpha=16, use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )),
    "qwen3-patterns-one-layer": ("qwen3", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=[1],
        rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3},
    )),
}  # fmt: skip


def peft_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def ours_with(base_dir: Path, adapter: LoraAdapter, idx: torch.Tensor) -> torch.Tensor:
    ours = load_checkpoint(base_dir)
    merge_into(ours, adapter)
    with torch.no_grad():
        return ours(idx)


def make_peft(kind: str, lora: dict, tmp_path: Path) -> tuple[Path, Path, torch.nn.Module]:
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    hf = make_hf(kind, base_dir)
    model = peft.get_peft_model(hf, peft.LoraConfig(**lora)).eval()
    randomize_lora_b(model)
    model.save_pretrained(adapter_dir)
    return base_dir, adapter_dir, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_read_peft_gives_peft_logits(case: str, tmp_path: Path) -> None:
    kind, lora = CASES[case]
    base_dir, adapter_dir, model = make_peft(kind, lora, tmp_path)
    idx = tokens()
    expected = peft_logits(model, idx)
    with model.disable_adapter():  # the adapter must matter, or the comparison proves nothing
        assert (peft_logits(model, idx) - expected).abs().max() > 1e-2
    adapter = read_peft(adapter_dir, load_checkpoint(base_dir).config)
    assert adapter.rank == lora["r"] and adapter.alpha == lora["lora_alpha"]
    assert (ours_with(base_dir, adapter, idx) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_written_adapter_loads_in_peft_with_the_same_logits(case: str, tmp_path: Path) -> None:
    kind, lora = CASES[case]
    base_dir, adapter_dir, _ = make_peft(kind, lora, tmp_path)
    config = load_checkpoint(base_dir).config
    adapter = read_peft(adapter_dir, config)
    out = tmp_path / "rewritten"
    write_peft(adapter, out, config, base_name=str(base_dir))
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(base_dir)
    hf = make_hf(kind, tmp_path / "again")  # the same seed: the same base weights
    loaded = peft.PeftModel.from_pretrained(hf, out).eval()
    idx = tokens()
    got = peft_logits(loaded, idx)
    assert (got - ours_with(base_dir, adapter, idx)).abs().max() < 1e-5


def random_adapter(config, targets: tuple[str, ...], rank: int, alpha: float) -> LoraAdapter:
    """Our adapter with a random piece on every slice of `targets` (as training makes them)."""
    gen = torch.Generator().manual_seed(7)
    pieces = {
        layer: [
            LoraPiece(
                a=torch.randn(rank, s.in_features, generator=gen) / s.in_features**0.5,
                b=0.3 * torch.randn(s.rows, rank, generator=gen),
                offset=s.offset,
            )
            for s in slices
        ]
        for layer, slices in target_slices(config, targets).items()
    }
    return LoraAdapter("t", rank, alpha, alpha / rank, pieces)


@pytest.mark.parametrize(
    "kind,targets",
    [("gpt2", ("q", "v", "down")), ("gpt2", ("k",)), ("llama", ("k", "v", "up")),
     ("qwen3", ("q", "o", "gate", "down"))],
)  # fmt: skip
def test_slices_of_fused_layers_write_as_peft_modules(kind, targets, tmp_path: Path) -> None:
    """GPT-2's q and v are slices of PEFT's one c_attn module: written as a rank 2r module with a
    block B (rank_pattern, alpha_pattern keep the scaling); the Llama family's are modules."""
    base_dir = tmp_path / "base"
    make_hf(kind, base_dir)
    config = load_checkpoint(base_dir).config
    adapter = random_adapter(config, targets, rank=3, alpha=6.0)
    write_peft(adapter, tmp_path / "a", config, base_name="tiny")
    written = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    if kind == "gpt2" and {"q", "k", "v"} & set(targets):
        fused = len({"q", "k", "v"} & set(targets))
        assert written["rank_pattern"] == ({"c_attn": 3 * fused} if fused > 1 else {})
    loaded = peft.PeftModel.from_pretrained(make_hf(kind, tmp_path / "hf"), tmp_path / "a").eval()
    idx = tokens()
    expected = ours_with(base_dir, adapter, idx)
    assert (peft_logits(loaded, idx) - expected).abs().max() < 1e-5
    # and read back, whatever rank its modules got, it is the same update
    again = read_peft(tmp_path / "a", config)
    assert (ours_with(base_dir, again, idx) - expected).abs().max() < 1e-5


def test_a_piece_over_part_of_the_layers_and_across_modules(tmp_path: Path) -> None:
    """One piece over q|k rows of layer 0 only: written as q_proj and k_proj of that layer."""
    base_dir = tmp_path / "base"
    make_hf("llama", base_dir)
    config = load_checkpoint(base_dir).config
    q_rows, kv_rows = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    gen = torch.Generator().manual_seed(5)
    piece = LoraPiece(
        a=torch.randn(2, config.n_embd, generator=gen),
        b=0.2 * torch.randn(q_rows + kv_rows, 2, generator=gen),
    )
    adapter = LoraAdapter("x", 2, 4.0, 2.0, {"transformer.h.0.attn.c_attn": [piece]})
    write_peft(adapter, tmp_path / "a", config, base_name=None)
    written = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == [
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.q_proj",
    ]
    loaded = peft.PeftModel.from_pretrained(make_hf("llama", tmp_path / "hf"), tmp_path / "a")
    idx = tokens()
    assert (peft_logits(loaded.eval(), idx) - ours_with(base_dir, adapter, idx)).abs().max() < 1e-5


REFUSED = {
    "dora": (dict(target_modules=["q_proj"], use_dora=True), "DoRA"),
    "modules_to_save": (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    "embedding": (dict(target_modules=["embed_tokens"]), "embedding"),
    "lm_head": (dict(target_modules=["lm_head"]), "output head"),
    "lora_bias": (dict(target_modules=["q_proj"], lora_bias=True), "lora_bias"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_we_cannot_apply_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    lora, words = REFUSED[case]
    base_dir, adapter_dir, _ = make_peft("llama", dict(r=2, **lora), tmp_path)
    with pytest.raises(AdapterError, match=words) as info:
        read_peft(adapter_dir, load_checkpoint(base_dir).config)
    assert "\n" not in str(info.value)


def test_an_adapter_for_another_architecture_or_size_is_refused(tmp_path: Path) -> None:
    base_dir, adapter_dir, _ = make_peft("llama", dict(r=2, target_modules=["q_proj"]), tmp_path)
    make_hf("gpt2", tmp_path / "gpt2")
    with pytest.raises(BaseMismatchError, match="q_proj.* no module of a GPT-2-shaped model"):
        read_peft(adapter_dir, load_checkpoint(tmp_path / "gpt2").config)
    config = load_checkpoint(base_dir).config
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    cfg["target_modules"] = ["fc1"]
    (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(BaseMismatchError, match="'fc1' is no module"):
        read_peft(adapter_dir, config)
    from dataclasses import replace

    with pytest.raises(BaseMismatchError, match="do not fit"):
        cfg["target_modules"] = ["q_proj"]
        (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))
        read_peft(adapter_dir, replace(config, n_embd=64, head_size=None))
    with pytest.raises(AdapterError, match="no adapter_config.json") as info:
        read_peft(tmp_path, config)
    assert not isinstance(info.value, BaseMismatchError)  # not a mismatch: no adapter at all


def test_a_geglu_model_is_named_and_sliced_as_the_llama_family() -> None:
    """Gemma 3's gated MLP: c_fc holds the gate, then up; its modules have Llama's names."""
    from gptserve.model import ModelConfig
    from gptserve.model.lora.modules import hf_modules

    gemma = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, intermediate_size=48,
                        bias=False, pos_encoding="rotary", norm="gemma_rmsnorm",
                        activation="geglu")  # fmt: skip
    assert "mlp.up_proj" in hf_modules(gemma)
    (gate,), (up,) = (
        target_slices(gemma, (t,))["transformer.h.0.mlp.c_fc"] for t in ("gate", "up")
    )
    assert (gate.offset, gate.rows) == (0, 48) and (up.offset, up.rows) == (48, 48)
