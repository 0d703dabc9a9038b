"""Inference-only linear layers whose weights oneDNN has laid out for its own matrix kernels.

PyTorch's default CPU matrix product (MKL) is slow on this project's AMD development box: for
the 8-32 rows of a batched decode step it reaches about half of what oneDNN's kernels reach with
a weight reordered once, ahead of time, into oneDNN's blocked layout. For one row, bound by
reading the weights, oneDNN and the per-thread slabs of `PackedLinear` come out about even for a
layer's matrices. `python bench/cpu_parts.py` measures each against the other.

A row's result does not depend on how many rows are multiplied with it, up to the `PLANNED_ROWS`
a decode batch has: where oneDNN multiplies few rows with another kernel than many (one row of a
wide input), such inputs are padded with copies of their first row up to the fewest rows that
compute as many do (`min_rows`, measured per layer when it is built), so a sequence gets the
same logits alone and in a batch. Past `PLANNED_ROWS` oneDNN may take yet another kernel
(bfloat16 with AMX: from 33 rows on); `keep_rows_alike` measures that per layer
(`alike_rows`) and makes such products go in chunks of `alike_rows` rows (batch invariance for prefills too,
at 2-3x the time of those products).

The reordered weight is an opaque oneDNN tensor: it cannot be sliced, saved or trained. It exists
for fp32 and bf16 (fp16 needs CPU features the development box lacks); `OneDnnLinear.supports`
says whether this build and CPU can make one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

PLANNED_ROWS = 32  # the batch size oneDNN picks its weight layout for (a full decode batch)
ROW_COUNTS = (1, 2, 4, 8)  # what `min_rows` may be
PROBE_ROWS = 16  # random rows `min_rows` is measured on (a multiple of each of ROW_COUNTS)


ACTIVATIONS = {"none": ("none", ""), "relu": ("relu", ""), "gelu_tanh": ("gelu", "tanh")}


class OneDnnLinear(nn.Module):
    """The `nn.Linear` it is built from, then `activation`; the weight in oneDNN's layout.

    The activation runs inside oneDNN's kernel, on the output while it is still in cache.
    `min_rows`: inputs of fewer rows are padded to it, so each row comes out as among many rows.
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
        self.min_rows = _fewest_rows_computed_as_many(self, linear.weight.dtype)
        self.planned_rows = planned_rows
        # products of more rows go in chunks of this many (None: whole); `keep_rows_alike` sets
        # it where oneDNN computes them otherwise
        self.alike_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out); a row's result does not depend on the row count."""
        if x.numel() < self.min_rows * x.shape[-1] and x.numel():
            rows = x.reshape(-1, self.in_features)  # (M, in), 0 < M < min_rows
            m = rows.shape[0]
            padded = torch.cat((rows, rows[:1].expand(self.min_rows - m, -1)))  # (min_rows, in)
            return self._product(padded)[:m].view(*x.shape[:-1], self.out_features)
        if self.alike_rows is not None and x.numel() > self.alike_rows * x.shape[-1]:
            rows = x.reshape(-1, self.in_features)  # (M, in), M > alike_rows
            out = torch.cat([self(chunk) for chunk in rows.split(self.alike_rows)])  # (M, out)
            return out.view(*x.shape[:-1], self.out_features)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
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


def keep_rows_alike(model: nn.Module) -> None:
    """Make every oneDNN product of `model` compute each row as it would among `PLANNED_ROWS`
    rows whatever the row count (batch invariance past a decode batch: a prefill's rows); only
    layers measured to need it chunk their products."""
    for module in model.modules():
        if isinstance(module, OneDnnLinear):
            module.alike_rows = _most_rows_computed_alike(module, module.planned_rows)


@torch.no_grad()
def _most_rows_computed_alike(layer: OneDnnLinear, planned_rows: int) -> int | None:
    """None where a product of more rows than `planned_rows` computes each row as a product of
    `planned_rows` rows does (probed on 2 * planned_rows + 1 rows), else `planned_rows`."""
    x = _probe_rows(layer, layer.weight.dtype, 2 * planned_rows + 1, seed=1)
    whole = layer._product(x)  # (rows, out)
    parts = torch.cat([layer._product(chunk) for chunk in x.split(planned_rows)])
    return None if torch.equal(whole, parts) else planned_rows


def _probe_rows(layer: OneDnnLinear, dtype: torch.dtype, rows: int, seed: int) -> torch.Tensor:
    """(rows, in) random rows of the layer's dtype whose values spread over 16 binades (8 in
    float16, which overflows beyond), so that another order of float32 sums moves the outputs
    by far more than a bfloat16 output's rounding hides."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, layer.in_features, generator=gen)
    binades = 8 if dtype == torch.float16 else 16  # float16 overflows at 65504
    return (normal * 2.0 ** torch.randint(0, binades, normal.shape, generator=gen)).to(dtype)


@torch.no_grad()
def _fewest_rows_computed_as_many(layer: OneDnnLinear, dtype: torch.dtype) -> int:
    """The fewest rows `layer` must multiply at once for each row to come out to the bit as it
    does among many rows: the first of ROW_COUNTS that does, or 1 if none does (padding would not
    help then).

    For few rows of a wide input oneDNN takes other kernels, which sum in another order (here: one
    row of 1536 input channels and more, in float32 and in bfloat16); which shapes, row counts and
    thread counts do so is oneDNN's choice, so it is measured once per layer: PROBE_ROWS random
    rows multiplied in groups of each size against all of them at once. The rows' values spread
    over 16 binades (8 in float16, which overflows beyond), so that another order of float32
    sums moves the outputs by far more than a bfloat16 output's rounding hides (with plain normal
    rows a bfloat16 layer that switches kernels showed no difference in 16 rows of 512 outputs;
    with these, many).
    """
    x = _probe_rows(layer, dtype, PROBE_ROWS, seed=0)  # (R, in)
    many = layer._product(x)  # (R, out)
    for rows in ROW_COUNTS:
        if all(
            torch.equal(layer._product(x[i : i + rows]), many[i : i + rows])
            for i in range(0, PROBE_ROWS, rows)
        ):
            return rows
    return 1
