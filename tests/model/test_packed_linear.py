import pytest
import torch
import torch.nn as nn

from model import GPT
from model.config import ModelConfig
from model.onednn_linear import OneDnnLinear
from model.packed_linear import PackedLinear, pack_linears


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("column_major", [False, True])
def test_packed_linear_computes_what_the_linear_computes(parts, bias, column_major):
    torch.manual_seed(parts)
    linear = nn.Linear(24, 37, bias=bias)  # 37 columns do not split evenly: padding is cut off
    packed = PackedLinear(linear, parts, column_major)
    for shape in [(1, 24), (5, 24), (2, 3, 24)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-6)
    width = -(-37 // parts)
    assert packed.weight.shape == ((parts, 24, width) if column_major else (parts, width, 24))
    assert not packed.weight.requires_grad


@pytest.mark.parametrize("column_major", [False, True])
def test_rows_read_the_original_weight_rows(column_major):
    linear = nn.Linear(8, 11, bias=False)
    packed = PackedLinear(linear, 3, column_major)
    index = torch.tensor([[0, 3], [10, 4]])
    torch.testing.assert_close(packed.rows(index), linear.weight.detach()[index])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_linears_replaces_nested_linears(dtype):
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 2))).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    before = model(x)
    pack_linears(model, 2)
    kind = OneDnnLinear if OneDnnLinear.supports(dtype) else PackedLinear
    assert isinstance(model[0], kind) and isinstance(model[2][0], kind)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(model(x), before, rtol=tol, atol=tol)


@pytest.mark.parametrize("tie, activation", [(True, "gelu"), (False, "gelu"), (True, "relu")])
def test_packed_gpt_gives_the_same_logits_and_stores_a_tied_table_once(tie, activation):
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
        model.pack_for_cpu_inference(threads=2)
        model.pack_for_cpu_inference(threads=2)  # a second call changes nothing
        after = model(idx)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    fused = OneDnnLinear.supports(torch.float32)  # c_fc then applies the activation itself
    assert all(b.mlp.fused_activation == fused for b in model.transformer.h)
    for rows in (1, 3):  # the head's two forms: slabs for one row, oneDNN for more
        x = torch.randn(rows, 32)
        torch.testing.assert_close(model.lm_head(x), x @ head_weight.T, rtol=1e-5, atol=1e-5)
    # slabs pad each matrix to a multiple of `parts` columns; only the head may be stored twice
    extra = sum(p.numel() for p in model.parameters()) - n_params
    head_copy = head_weight.numel() if OneDnnLinear.supports(torch.float32) else 0
    assert head_copy <= extra < head_copy + 2 * 32


def test_slab_count_is_one_per_thread_until_a_slab_would_exceed_the_cap():
    from model.packed_linear import SLAB_BYTES, slab_count

    small = nn.Linear(64, 64)
    assert slab_count(small, 2) == 2
    assert slab_count(small, 3) == 3
    rows = SLAB_BYTES // (4 * 64)  # one cap's worth of fp32 (out, 64) rows
    big = nn.Linear(64, 5 * rows, bias=False)
    assert slab_count(big, 2) == 6  # 5 caps over 2 threads -> 3 slabs per thread


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_gpt_in_half_precision_matches_the_unpacked_one(dtype):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101)
    model = GPT(cfg).to(dtype).eval()
    idx = torch.randint(0, 101, (1, 7))
    with torch.no_grad():
        before = model(idx).float()
        model.pack_for_cpu_inference(threads=2)
        after = model(idx).float()
    torch.testing.assert_close(after, before, rtol=2e-2, atol=2e-2)


def test_a_packed_model_refuses_to_be_saved(tmp_path):
    from model import save_checkpoint
    from model.checkpoint import CheckpointError

    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=101))
    save_checkpoint(model, tmp_path / "plain")  # fine before packing
    model.pack_for_cpu_inference(threads=2)
    with pytest.raises(CheckpointError, match="packed for CPU inference"):
        save_checkpoint(model, tmp_path / "packed")
    assert not (tmp_path / "packed" / "model.safetensors").exists()
