"""Float32 matrix products on the CPU through oneDNN, where this build and CPU run them.

PyTorch's float32 `matmul` on the CPU goes to MKL, which on the development box's AMD cores runs
at about half the rate oneDNN reaches (about 180 against 360 GFLOP/s for the (302, 64) x
(64, 1024) score products of 12 heads; `python bench/cpu_parts.py --parts prefill`). `product_nt` multiplies through oneDNN's linear kernel, taking the
second operand as a plain (row-major or strided) weight; `onednn_products()` says whether it can.
"""

from __future__ import annotations

import functools

import torch


def product_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, K) x (N, K) -> (M, N): `a @ b.T`, through oneDNN where `onednn_products()` holds."""
    if onednn_products():
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return a @ b.t()


@functools.cache
def onednn_products() -> bool:
    """Whether oneDNN's float32 linear kernel runs here (a private PyTorch op: probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        a, b = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3)
        got = torch.ops.mkldnn._linear_pointwise(a, b.t().contiguous().t(), None, "none", [], "")
        return torch.equal(got, a @ b.t())
    except (RuntimeError, AttributeError):
        return False
