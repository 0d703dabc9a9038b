"""GGUF writing (`model.gguf.writer`): what it writes reads back as the same model through our
loader; what no supported architecture holds is refused by name. The whole export, with
adapters, tokenizers and llama.cpp, is tests/test_export.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.model import GPT, ModelConfig, load_checkpoint
from gptserve.model.gguf.checkpoint import unpermute_rows
from gptserve.model.gguf.vocab import gpt2_vocab
from gptserve.model.gguf.writer import (
    GGUFWriteError,
    architecture,
    permute_rows,
    write_gpt2_gguf,
    write_model_gguf,
)

gguf = pytest.importorskip("gguf")

LLAMA = dict(
    vocab_size=50257, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
    intermediate_size=96, bias=False, pos_encoding="rotary", norm="rmsnorm",
    activation="swiglu", tie_embeddings=False, rope_theta=500000.0,
)  # fmt: skip


def random_gpt(seed: int = 0, **fields: object) -> GPT:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**fields)).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0: a mix-up would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_permute_rows_is_the_inverse_of_the_readers_order() -> None:
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)  # 8 heads of 6 rows
    assert np.array_equal(unpermute_rows(permute_rows(w, 8), 8), w)
    assert not np.array_equal(permute_rows(w, 8), w)


@pytest.mark.parametrize("shape", ["gpt2", "gpt2-untied", "llama"])
def test_f32_file_loads_back_as_the_same_model(shape: str, tmp_path: Path) -> None:
    fields = {"gpt2": dict(n_layer=2, n_head=4, n_embd=64, block_size=64),
              "gpt2-untied": dict(n_layer=2, n_head=4, n_embd=64, block_size=64,
                                  tie_embeddings=False),
              "llama": LLAMA}[shape]  # fmt: skip
    model = random_gpt(**fields)
    path = write_model_gguf(tmp_path / "m.gguf", model, "f32", gpt2_vocab())
    back = load_checkpoint(path)
    assert back.config.tie_embeddings == model.config.tie_embeddings
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), rtol=0, atol=1e-5)


def test_the_benchmarks_gpt2_writer_is_this_one(tmp_path: Path) -> None:
    model = random_gpt(n_layer=1, n_head=2, n_embd=32, block_size=32)
    path = write_gpt2_gguf(tmp_path / "b.gguf", model, "bf16")
    assert tensor_types(path)["blk.0.attn_qkv.weight"] == "BF16"
    assert load_checkpoint(path).config.n_embd == 32


def test_q8_0_keeps_rows_that_are_not_whole_blocks_in_f16(tmp_path: Path) -> None:
    model = random_gpt(n_layer=1, n_head=2, n_embd=48, block_size=32)  # 48 columns: 1.5 blocks
    types = tensor_types(write_model_gguf(tmp_path / "q.gguf", model, "q8_0", gpt2_vocab()))
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # 192 columns
    assert types["blk.0.attn_qkv.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_llama3_rotary_rescaling_is_written_as_rope_freqs(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    model = random_gpt(**{**LLAMA, "rope_scaling": scaling})
    path = write_model_gguf(tmp_path / "r.gguf", model, "f32", gpt2_vocab())
    assert "rope_freqs.weight" in tensor_types(path)
    back = load_checkpoint(path)
    torch.testing.assert_close(back.rope_inv_freq, model.rope_inv_freq)
    plain = write_model_gguf(tmp_path / "p.gguf", random_gpt(**LLAMA), "f32", gpt2_vocab())
    assert "rope_freqs.weight" not in tensor_types(plain)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(norm_position="post"), "norm_position"),
        (dict(activation="relu"), "activation"),
        ({**LLAMA, "qk_norm": True}, "qk_norm"),
        ({**LLAMA, "qkv_bias": True}, "attn_bias"),
        ({**LLAMA, "activation": "geglu"}, "activation"),
        ({**LLAMA, "logit_softcap": 30.0}, "logit_softcap"),
    ],
)
def test_what_no_architecture_holds_is_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(GGUFWriteError, match=message):
        architecture(ModelConfig(**{"n_layer": 1, "n_head": 2, "n_embd": 32, **change}))


def test_a_vocabulary_larger_than_the_model_is_refused(tmp_path: Path) -> None:
    model = random_gpt(vocab_size=1000, n_layer=1, n_head=2, n_embd=32, block_size=32)
    with pytest.raises(ValueError, match="50257 tokens"):
        write_model_gguf(tmp_path / "v.gguf", model, "f32", gpt2_vocab())
    assert not (tmp_path / "v.gguf").exists()
