"""Checkpoint round trip and clear errors for broken directories."""

import json

import pytest
import torch
from gptserve.model import (
    GPT,
    CheckpointError,
    ConfigError,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
)


def _tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8, **kw))


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip(tmp_path, tied):
    model = _tiny(tie_embeddings=tied)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == model.config
    idx = torch.randint(0, 50, (1, 10))
    torch.testing.assert_close(loaded(idx), model(idx))
    half = load_checkpoint(tmp_path, dtype=torch.float16)
    assert next(half.parameters()).dtype == torch.float16


def test_config_json_round_trip(tmp_path):
    cfg = ModelConfig(n_layer=3, pos_encoding="sinusoidal", activation="relu", norm_position="post")
    cfg.to_json(tmp_path / "c.json")
    assert ModelConfig.from_json(tmp_path / "c.json") == cfg


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"n_embd": 10, "n_head": 3}, "divisible"),
        ({"pos_encoding": "alibi"}, "pos_encoding"),
        ({"n_layer": 0}, "n_layer"),
        ({"dropout": 1.5}, "dropout"),
    ],
)
def test_inconsistent_config_is_one_line_error(kw, msg):
    with pytest.raises(ConfigError, match=msg) as err:
        ModelConfig(**kw)
    assert "\n" not in str(err.value)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_weights(tmp_path):
    _tiny().config.to_json(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path)


def test_truncated_weights(tmp_path):
    save_checkpoint(_tiny(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        load_checkpoint(tmp_path)


def test_weights_that_do_not_match_config(tmp_path):
    save_checkpoint(_tiny(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_embd"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(tmp_path)
    cfg["n_embd"], cfg["n_layer"] = 8, 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path)


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": -1}))
    with pytest.raises(CheckpointError, match="n_layer"):
        load_checkpoint(tmp_path)


def test_hf_bin_refuses_arbitrary_pickles(tmp_path):
    import pickle

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    with pytest.raises(CheckpointError, match="not plain tensors"):
        load_checkpoint(tmp_path)
