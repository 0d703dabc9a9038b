"""model.dense_matmul: float32 products on oneDNN's kernels equal torch.mm's within float32
rounding, whatever the operands' strides; other dtypes go to torch.mm itself."""

from __future__ import annotations

import pytest
import torch
from gptserve.model import dense_matmul


def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_matmul_is_the_product_for_every_layout(a_t: bool, b_t: bool) -> None:
    a, b = operands(37, 300, 129)
    a = a.t().contiguous().t() if a_t else a  # the same values, column-major
    b = b.t().contiguous().t() if b_t else b
    got = dense_matmul.matmul(a, b)
    assert got.shape == (37, 129) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.mm(a, b), rtol=1e-5, atol=1e-4)


def test_matmul_runs_on_onednn_where_this_build_has_it() -> None:
    # PyTorch's CPU wheels carry oneDNN: the fast path is the one tested above, not the fallback
    assert dense_matmul.available() == torch.backends.mkldnn.is_available()


def test_other_dtypes_are_torch_mm() -> None:
    a, b = operands(8, 16, 4)
    a, b = a.bfloat16(), b.bfloat16()
    assert torch.equal(dense_matmul.matmul(a, b), torch.mm(a, b))
