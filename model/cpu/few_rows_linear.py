"""Float32 products of a few rows by the compiled tiled kernel, of more by the layer it wraps.

A single-stream decode step multiplies one row by every matrix, which is bound by reading the
weights. oneDNN's kernels read GPT-2's layer matrices at 29-42 GB/s for one row on the 2-core
development box, where `kernels/cpu/f32_matmul.cpp`, reading each matrix as tiles of 32 output
columns stored one after another, reaches 42-56 GB/s: GPT-2's layer matrices 1.28-1.39x faster
for 1-2 rows and 1.07-1.09x for 4-8, with AVX-512 and with AVX2 alike. From 16 rows on the
products are bound by arithmetic, where oneDNN's kernels are ahead with AVX-512 (0.91x) and about
even with AVX2 (1.05x). So the tiles serve up to `LAYER_FEW_ROWS` rows and the wrapped layer
(oneDNN's, `model.cpu.onednn_linear`) serves more; the vocabulary head, whose product oneDNN
streams nearly as fast (1.05-1.22x for 1-2 rows, 0.85-1.02x from 4), takes the tiles up to
`HEAD_FEW_ROWS` rows (`python bench/cpu_parts.py --parts f32` measures each).

The cost is a second copy of the matrices (the tiles beside oneDNN's layout) and bitwise batch
invariance: a row is computed by another kernel alone than among many, so a sequence's logits
agree with its logits in a batch to rounding, and a speculative step's verified rows with plain
decoding's too (a near-tie can flip a greedy token). `optimize_for_cpu(model, batch_invariant=True)`
(the server's `--batch-invariant`) does not install these layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.model.activations import KERNEL_CODES

LAYER_FEW_ROWS = 8  # a layer's matrices: the tiles win for 1-8 rows (AVX-512 and AVX2)
HEAD_FEW_ROWS = 2  # the vocabulary head: for 1-2 rows
TILE = 32  # output columns a tile holds (kTile in f32_matmul.cpp)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (tiles, in, TILE): each tile's columns for one input after another, the
    last tile padded with zero columns."""
    out_features, in_features = weight.shape
    tiles = -(-out_features // TILE)
    padded = F.pad(weight.float(), (0, 0, 0, tiles * TILE - out_features))  # (tiles*TILE, in)
    return padded.view(tiles, TILE, in_features).transpose(1, 2).contiguous()


def compiled_tiles(ops: Any | None) -> bool:
    """Whether `ops` (`kernels.cpu.native.native_ops()`) has the tiled product with vector
    instructions (a build without them would be slower than oneDNN)."""
    return ops is not None and ops.f32_lanes() > 1


class FewRowsLinear(nn.Module):
    """`linear`, then `activation`: up to `few_rows` rows by the compiled tiled product, more by
    `many`, a module that computes the same function (the layer `linear` was packed into)."""

    def __init__(
        self, linear: nn.Linear, many: nn.Module, ops: Any, few_rows: int,
        activation: str = "none",
    ) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.many, self.few_rows, self.op = many, few_rows, ops.f32_matmul
        self.activation = KERNEL_CODES[activation]
        self.tiles = nn.Parameter(pack_tiles(linear.weight.detach()), requires_grad=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out). Called 49 times a GPT-2 decode step: dict reads, not
        Module.__getattr__ (see model.gpt._submodules)."""
        if x.numel() > self.few_rows * self.in_features or x.dtype != torch.float32:
            return self._modules["many"].forward(x)
        params = self._parameters
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, in), M <= few_rows
        y = self.op(rows, params["tiles"], params.get("bias"), self.out_features, self.activation)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)  # (..., out)
