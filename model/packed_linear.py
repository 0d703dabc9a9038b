"""Inference-only linear layers laid out so a CPU runs one matrix product on every core.

A decode step multiplies a few rows by each weight matrix, which is bound by reading the weights.
PyTorch's CPU matrix product runs such a product on one thread, so it streams the weights at one
core's bandwidth. `PackedLinear` splits the output columns into `parts` slabs, each stored
(in, width) contiguous, and multiplies them with one `baddbmm`, which gives each thread its own
slab: on the 2-core development box this is 1.4x faster for 1 row and 1.2-1.7x for 8-64 rows
(bench/decode.py, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class PackedLinear(nn.Module):
    """Same function as the `nn.Linear` it is built from; weights (parts, in, width), no autograd."""

    def __init__(self, linear: nn.Linear, parts: int) -> None:
        super().__init__()
        weight = linear.weight.detach()  # (out, in)
        self.out_features, self.in_features = weight.shape
        self.parts = parts
        self.width = -(-self.out_features // parts)
        padded = F.pad(weight, (0, 0, 0, self.width * parts - self.out_features))  # (P*W, in)
        packed = padded.view(parts, self.width, self.in_features).transpose(1, 2)  # (P, in, W)
        self.weight = nn.Parameter(packed.contiguous(), requires_grad=False)
        self.bias = None
        if linear.bias is not None:
            bias = F.pad(linear.bias.detach(), (0, self.width * parts - self.out_features))
            self.bias = nn.Parameter(bias.view(parts, 1, self.width), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        lead = x.shape[:-1]
        rows = x.reshape(1, -1, self.in_features).expand(self.parts, -1, -1)  # (P, N, in)
        if self.bias is None:
            y = torch.bmm(rows, self.weight)  # (P, N, W)
        else:
            y = torch.baddbmm(self.bias, rows, self.weight)
        y = y.transpose(0, 1).reshape(rows.shape[1], self.parts * self.width)  # (N, P*W)
        return y[:, : self.out_features].reshape(*lead, self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (...) of the original (out, in) weight, as (..., in): a tied embedding."""
        return self.weight[index // self.width, :, index % self.width]


class PackedEmbedding(nn.Module):
    """An embedding that reads its table from a tied `PackedLinear`, so it is stored once."""

    def __init__(self, source: PackedLinear) -> None:
        super().__init__()
        self.source = source

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.source.rows(index)


SLAB_BYTES = 32 << 20  # a larger matrix (the vocabulary head) gets more slabs than threads


def slab_count(linear: nn.Linear, threads: int) -> int:
    """Slabs for one matrix: one per thread, times enough that no slab exceeds SLAB_BYTES.

    Measured on 2 threads: the 12 layers' matrices are fastest in 2 slabs; the 154 MB GPT-2 head
    in 8-12 (10-15 % faster than 2 when 32 rows are multiplied).
    """
    weight = linear.weight
    size = weight.numel() * weight.element_size()
    return threads * max(1, -(-size // (threads * SLAB_BYTES)))


def pack_linears(model: nn.Module, threads: int) -> None:
    """Replace every `nn.Linear` in `model` by a `PackedLinear`, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, PackedLinear(module, slab_count(module, threads)))
