"""Inference-only linear layers laid out so a CPU runs one matrix product on every core.

A decode step multiplies a few rows by each weight matrix, which is bound by reading the weights.
PyTorch's CPU matrix product runs such a product on one thread, so it streams the weights at one
core's bandwidth. `PackedLinear` splits the output columns into `parts` slabs and multiplies them
with one `baddbmm`, which gives each thread its own slab.

Slab layout, chosen by measuring both on the 2-core development box: a layer's matrices are faster
with slabs stored (width, in), each output's weights contiguous; the 154 MB vocabulary head with
(in, width) slabs, and it gets more slabs than threads (`slab_count`).

`pack_linear` and `pack_head` take oneDNN's own layout (`model.cpu.onednn_linear`) where it runs,
which is faster for several rows, and these slabs elsewhere; `python bench/cpu_parts.py` measures
them against each other. The slabs' product (MKL's) sums a row in an order that depends on the
number of rows, so where they serve (float16, builds without oneDNN) a sequence's logits alone and
in a batch agree only to rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.model.cpu.few_rows_linear import HEAD_FEW_ROWS, LAYER_FEW_ROWS, FewRowsLinear
from gptserve.model.cpu.onednn_linear import OneDnnLinear


class PackedLinear(nn.Module):
    """Same function as the `nn.Linear` it is built from, weights in slabs; no autograd.

    `weight` is (parts, width, in) when `column_major` is False, else (parts, in, width); the
    output columns are padded to parts * width.
    """

    def __init__(self, linear: nn.Linear, parts: int, column_major: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()  # (out, in)
        self.out_features, self.in_features = weight.shape
        self.parts = parts
        self.column_major = column_major
        self.width = -(-self.out_features // parts)
        padded = F.pad(weight, (0, 0, 0, self.width * parts - self.out_features))  # (P*W, in)
        packed = padded.view(parts, self.width, self.in_features)  # (P, W, in)
        if column_major:
            packed = packed.transpose(1, 2)  # (P, in, W)
        self.weight = nn.Parameter(packed.contiguous(), requires_grad=False)
        self.bias = None
        if linear.bias is not None:
            bias = F.pad(linear.bias.detach(), (0, self.width * parts - self.out_features))
            self.bias = nn.Parameter(bias.view(parts, 1, self.width), requires_grad=False)

    def _slabs(self) -> torch.Tensor:
        """(P, in, W), a view."""
        return self.weight if self.column_major else self.weight.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        lead = x.shape[:-1]
        rows = x.reshape(1, -1, self.in_features).expand(self.parts, -1, -1)  # (P, N, in)
        if self.bias is None:
            y = torch.bmm(rows, self._slabs())  # (P, N, W)
        else:
            y = torch.baddbmm(self.bias, rows, self._slabs())
        y = y.transpose(0, 1).reshape(rows.shape[1], self.parts * self.width)  # (N, P*W)
        return y[:, : self.out_features].reshape(*lead, self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (...) of the original (out, in) weight, as (..., in): a tied embedding."""
        return self._slabs()[index // self.width, :, index % self.width]


class PackedEmbedding(nn.Module):
    """An embedding that reads its table from a tied `PackedLinear`, so it is stored once."""

    def __init__(self, source: PackedLinear) -> None:
        super().__init__()
        self.source = source

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.source.rows(index)


SLAB_BYTES = 16 << 20  # a matrix over threads x this (the vocabulary head) gets more slabs


def slab_count(linear: nn.Linear, threads: int) -> int:
    """Slabs for one matrix: one per thread, times enough that no slab exceeds SLAB_BYTES.

    On 2 threads this gives the 12 layers' matrices (up to 9.4 MB) 2 slabs and the 154 MB GPT-2
    head 10, the counts that measured fastest for them.
    """
    weight = linear.weight
    size = weight.numel() * weight.element_size()
    return threads * max(1, -(-size // (threads * SLAB_BYTES)))


def with_few_rows(
    linear: nn.Linear, many: nn.Module, tiles_ops: Any | None, few_rows: int,
    activation: str = "none",
) -> nn.Module:  # fmt: skip
    """`many` alone, or wrapped so that float32 products of up to `few_rows` rows take the
    compiled tiles (`model.cpu.few_rows_linear`) when `tiles_ops` is given."""
    if tiles_ops is None or linear.weight.dtype != torch.float32:
        return many
    return FewRowsLinear(linear, many, tiles_ops, few_rows, activation)


def pack_linear(linear: nn.Linear, threads: int, tiles_ops: Any | None = None) -> nn.Module:
    """A layer's matrix for CPU inference: oneDNN's layout where it runs here, else slabs;
    with `tiles_ops`, a few float32 rows by the compiled tiles."""
    if OneDnnLinear.supports(linear.weight.dtype):
        many: nn.Module = OneDnnLinear(linear)
    else:
        many = PackedLinear(linear, slab_count(linear, threads))
    return with_few_rows(linear, many, tiles_ops, LAYER_FEW_ROWS)


def pack_head(
    linear: nn.Linear, threads: int, tiles_ops: Any | None = None
) -> tuple[nn.Module, PackedLinear | None]:
    """The output head for CPU inference, and the slabs a tied embedding reads its rows from.

    Where oneDNN runs, the head is oneDNN's alone, in float32 as in bfloat16, and there are no
    slabs (None): a tied embedding keeps its own table. A head that switched to the slabs for
    one row would give a sequence other logits alone than in a batch, and oneDNN streams one row
    as fast here (GPT-2's float32 head: 2.0-2.3 against 2.9-3.1 ms of CPU time a thread, and a
    decode step no slower). Elsewhere the head is slabs. With `tiles_ops`, one or two float32
    rows take the compiled tiles instead (`HEAD_FEW_ROWS`).
    """
    dtype = linear.weight.dtype
    if OneDnnLinear.supports(dtype):
        return with_few_rows(linear, OneDnnLinear(linear), tiles_ops, HEAD_FEW_ROWS), None
    parts = slab_count(linear, threads)
    slabs = PackedLinear(linear, parts, column_major=parts > threads)
    return with_few_rows(linear, slabs, tiles_ops, HEAD_FEW_ROWS), slabs


def pack_linears(model: nn.Module, threads: int, tiles_ops: Any | None = None) -> None:
    """Replace every `nn.Linear` in `model` by its `pack_linear` form, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, pack_linear(module, threads, tiles_ops))
