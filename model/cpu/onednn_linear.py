"""Inference-only linear layers whose weights oneDNN has laid out for its own matrix kernels.

PyTorch's default CPU matrix product (MKL) is slow on this project's AMD development box: for
the 8-32 rows of a batched decode step it reaches about half of what oneDNN's kernels reach with
a weight reordered once, ahead of time, into oneDNN's blocked layout. For one row, bound by
reading the weights, oneDNN and the per-thread slabs of `PackedLinear` come out about even for a
layer's matrices; for the large vocabulary head the slabs stay faster with one row, so the head
keeps both (`RowSwitch`).
`python bench/cpu_parts.py` measures each against the other.

The reordered weight is an opaque oneDNN tensor: it cannot be sliced, saved or trained. It exists
for fp32 and bf16 (fp16 needs CPU features the development box lacks); `OneDnnLinear.supports`
says whether this build and CPU can make one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

PLANNED_ROWS = 32  # the batch size oneDNN picks its weight layout for (a full decode batch)


ACTIVATIONS = {"none": ("none", ""), "relu": ("relu", ""), "gelu_tanh": ("gelu", "tanh")}


class OneDnnLinear(nn.Module):
    """The `nn.Linear` it is built from, then `activation`; the weight in oneDNN's layout.

    The activation runs inside oneDNN's kernel, on the output while it is still in cache.
    """

    def __init__(
        self, linear: nn.Linear, planned_rows: int = PLANNED_ROWS, activation: str = "none"
    ) -> None:
        super().__init__()
        self.attr, self.algorithm = ACTIVATIONS[activation]
        self.out_features, self.in_features = linear.weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), planned_rows)
        self.weight = nn.Parameter(packed, requires_grad=False)  # opaque (out, in)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        return torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, self.attr, [], self.algorithm
        )

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        """Whether oneDNN can reorder and multiply weights of this dtype here."""
        return _probe(dtype)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    if not (dtype.is_floating_point and torch.backends.mkldnn.is_available()):
        return False
    try:  # the ops are private to PyTorch and need CPU support per dtype: try a tiny one
        linear = nn.Linear(8, 8).to(dtype)
        with torch.no_grad():
            got = OneDnnLinear(linear, planned_rows=2)(torch.ones(2, 8, dtype=dtype))
            return torch.allclose(got.float(), linear(torch.ones(2, 8, dtype=dtype)).float(),
                                  rtol=1e-2, atol=1e-2)  # fmt: skip
    except (RuntimeError, AttributeError):
        return False


class RowSwitch(nn.Module):
    """Runs `few` for inputs of fewer than `rows` rows and `many` otherwise (same function)."""

    def __init__(self, few: nn.Module, many: nn.Module, rows: int) -> None:
        super().__init__()
        self.few = few
        self.many = many
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        return self.few(x) if x.numel() < self.rows * x.shape[-1] else self.many(x)
