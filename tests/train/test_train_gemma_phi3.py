"""train.py --init-from a Gemma 3 or Phi-3 directory saved by transformers: the loss falls, the
output keeps the family's config, loads with the trained weights and generates through the engine
as the server loads it (CPU wing, paged KV cache, sliding window of 8) as the full forward does;
--resume continues it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, load_checkpoint
from gptserve.training import cli as train
from gptserve.training.checkpointing import STATE_FILE

from tests.train.test_train_llama import BOS, EOS, _byte_level_tokenizer, losses

transformers = pytest.importorskip("transformers")

WINDOW = 8
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_local_base_freq=10_000.0, rope_theta=100_000.0, final_logit_softcapping=30.0,
    )),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}  # fmt: skip


def save_family(kind: str, path: Path, text: Path) -> Path:
    tok = _byte_level_tokenizer(text)
    config_cls, model_cls, extra = FAMILIES[kind]
    config = getattr(transformers, config_cls)(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, sliding_window=WINDOW, bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(EOS), **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_fine_tune_then_serve(kind: str, text: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    source = save_family(kind, tmp_path / "source", text)
    out = tmp_path / "out"
    argv = ["--data", str(text), "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    argv += ["--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "2", "--block-size", "32"]
    argv += ["--eval-interval", "10", "--eval-iters", "2", "--log-interval", "1"]
    argv += ["--init-from", str(source), "--max-steps", "20", "--sample-tokens", "4"]
    code = train.main(argv)
    assert code == 0, capsys.readouterr().err

    loss = losses(out)
    assert np.mean(loss[-5:]) < loss[0] - 0.5  # about ln(400) = 6.0 at the start
    source_config = load_checkpoint(source).config
    saved = ModelConfig.from_json(out / "config.json")
    assert saved == source_config  # the family's fields, the window included
    assert WINDOW in saved.layer_windows()

    # the served weights are the trained ones
    state = torch.load(out / STATE_FILE, weights_only=True)
    trained = GPT(ModelConfig.from_dict(state["config"])).eval()
    trained.load_state_dict(state["model"])
    loaded = load_for_inference(out, device="cpu")
    ids = loaded.tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?")
    assert len(ids) > WINDOW
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(out)(torch.tensor([ids])), trained(torch.tensor([ids])), rtol=0, atol=0)  # fmt: skip

    # and generate through the engine as the full forward does, past the window
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(kv_block_size=8))
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    got: list[int] = []
    while engine.has_work():
        got += [t for ev in engine.step() for t in ev.token_ids]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(trained(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(ids) :]

    # --resume continues the run from its own files
    assert train.main(["--out", str(out), "--resume", "--max-steps", "24"]) == 0
    assert len(losses(out)) == 24 and ModelConfig.from_json(out / "config.json") == saved
