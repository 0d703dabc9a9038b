"""The CPU wing: a loaded model's modules swapped for CPU inference layouts, same function."""

import pytest
import torch
from gptserve.model import GPT, save_checkpoint
from gptserve.model.checkpoint import CheckpointError
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import is_optimized_for_cpu, optimize_for_cpu
from gptserve.model.cpu.few_rows_linear import FewRowsLinear
from gptserve.model.cpu.onednn_linear import OneDnnLinear
from gptserve.model.cpu.optimize import FusedMLP
from gptserve.model.quantize import quantize


@pytest.mark.parametrize("tie, activation", [(True, "gelu"), (False, "gelu"), (True, "relu")])
def test_optimized_gpt_gives_the_same_logits_and_stores_a_tied_table_once(tie, activation):
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        vocab_size=101,
        tie_embeddings=tie,
        activation=activation,
    )
    model = GPT(cfg).eval()
    idx = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        before = model(idx)
        n_params = model.num_params()
        head_weight = model.lm_head.weight.clone()
        assert optimize_for_cpu(model, threads=2) is model
        layout = [type(m) for m in model.modules()]
        optimize_for_cpu(model, threads=2)  # a second call changes nothing
        assert [type(m) for m in model.modules()] == layout
        after = model(idx)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    fused = OneDnnLinear.supports(torch.float32)  # c_fc then applies the activation itself
    assert all(isinstance(b.mlp, FusedMLP) == fused for b in model.transformer.h)
    assert is_optimized_for_cpu(model) and not model.training
    for rows in (1, 3):  # one row (single-stream decode) and several
        x = torch.randn(rows, 32)
        torch.testing.assert_close(model.lm_head(x), x @ head_weight.T, rtol=1e-5, atol=1e-5)
    # slabs pad each matrix to a multiple of `parts` columns; only a tied table may be stored
    # twice: in oneDNN's layout for the head and as the embedding's own table (beside the
    # tiles that few rows read, model.cpu.few_rows_linear, a copy of each matrix by design)
    few_rows = [m for m in model.modules() if isinstance(m, FewRowsLinear)]
    tiles = sum(p.numel() for m in few_rows for p in m._parameters.values() if p is not None)
    extra = sum(p.numel() for p in model.parameters()) - n_params - tiles
    head_copy = head_weight.numel() if tie and OneDnnLinear.supports(torch.float32) else 0
    assert head_copy <= extra < head_copy + 2 * 32


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_an_int8_feed_forward_block_takes_its_activation_in_the_product(activation):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=101,
                      activation=activation)  # fmt: skip
    model = quantize(GPT(cfg).eval(), "int8")
    idx = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        before = model(idx)
        optimize_for_cpu(model, threads=2)
        after = model(idx)
    compiled = model.transformer.h[0].mlp.c_fc.q8 is not None  # in tiles: the compiled product
    assert all(isinstance(b.mlp, FusedMLP) == compiled for b in model.transformer.h)
    if compiled:
        name = "gelu_tanh" if activation == "gelu" else "relu"
        assert all(b.mlp.c_fc.activation == name for b in model.transformer.h)
        assert is_optimized_for_cpu(model)
        layout = [type(m) for m in model.modules()]
        optimize_for_cpu(model, threads=2)  # a second call changes nothing
        assert [type(m) for m in model.modules()] == layout
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_the_optimized_float32_head_gives_a_row_the_same_logits_alone_and_in_a_batch():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=256, block_size=16, vocab_size=5000)
    # batch_invariant: oneDNN's kernels at every row count (else one or two rows take the tiles)
    model = optimize_for_cpu(GPT(cfg).eval(), threads=2, batch_invariant=True)
    x = torch.randn(40, 256)
    with torch.no_grad():
        alone = torch.cat([model.lm_head(x[i : i + 1]) for i in range(40)])  # (40, V)
        for rows in (2, 5, 32, 40):  # a decode step's rows, however many sequences sample
            assert torch.equal(model.lm_head(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_optimized_gpt_in_half_precision_matches_the_plain_one(dtype):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101)
    model = GPT(cfg).to(dtype).eval()
    idx = torch.randint(0, 101, (1, 7))
    with torch.no_grad():
        before = model(idx).float()
        optimize_for_cpu(model, threads=2)
        after = model(idx).float()
    torch.testing.assert_close(after, before, rtol=2e-2, atol=2e-2)


def test_an_optimized_model_refuses_to_be_saved(tmp_path):
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101))
    save_checkpoint(model, tmp_path / "plain")  # fine before
    assert not is_optimized_for_cpu(model)
    optimize_for_cpu(model, threads=2)
    with pytest.raises(CheckpointError, match="optimized for CPU inference"):
        save_checkpoint(model, tmp_path / "packed")
    assert not (tmp_path / "packed" / "model.safetensors").exists()


def test_a_model_on_another_device_or_already_optimized_is_returned_unchanged():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101))
    meta = model.to("meta")
    assert optimize_for_cpu(meta) is meta and not is_optimized_for_cpu(meta)


@pytest.mark.skipif(not OneDnnLinear.supports(torch.bfloat16), reason="no oneDNN bf16 here")
def test_a_bfloat16_head_is_onednn_alone_and_a_tied_table_stays_an_embedding():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101)
    model = GPT(cfg).to(torch.bfloat16).eval()
    table = model.transformer.wte
    idx = torch.randint(0, 101, (1, 7))
    with torch.no_grad():
        before = model(idx).float()
        optimize_for_cpu(model, threads=2)
        after = model(idx).float()
    assert isinstance(model.lm_head, OneDnnLinear) and model.transformer.wte is table
    torch.testing.assert_close(after, before, rtol=2e-2, atol=2e-2)
