import pytest
import torch
import torch.nn as nn
from gptserve.model.cpu.onednn_linear import OneDnnLinear
from gptserve.model.cpu.packed_linear import PackedLinear, pack_linears


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


def test_slab_count_is_one_per_thread_until_a_slab_would_exceed_the_cap():
    from gptserve.model.cpu.packed_linear import SLAB_BYTES, slab_count

    small = nn.Linear(64, 64)
    assert slab_count(small, 2) == 2
    assert slab_count(small, 3) == 3
    rows = SLAB_BYTES // (4 * 64)  # one cap's worth of fp32 (out, 64) rows
    big = nn.Linear(64, 5 * rows, bias=False)
    assert slab_count(big, 2) == 6  # 5 caps over 2 threads -> 3 slabs per thread
