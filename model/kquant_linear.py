"""A linear layer with a GGUF file's Q5_K or Q6_K weights, held as the file stores them.

The matrix is the file's super-blocks (`model.gguf.kquant_blocks`), each output row's one after
another: 6.5625 bits a weight for Q6_K, 5.5 for Q5_K, the file's bytes and no more. Its products
are the file's dequantized weights times the inputs in float32 (up to the order of the sums):

- few rows (decoding): the compiled `kquant_matmul` (kernels/cpu/kquant_matmul.cpp, where
  `kernels.cpu.native` builds), which decodes each output row's blocks on the fly inside the dot
  products, 4 input rows (2 on AVX2) sharing a decoding, output rows shared out among threads; a
  row's result is the same whatever the batch;
- from `many_rows` rows on (prefill): the weights decoded to float32 `CHUNK_ELEMENTS` at a time
  (the compiled `kquant_dequantize`) and multiplied by a float32 matrix product
  (`kernels.cpu.products.product_nt`), which reuses each weight across the rows. `many_rows =
  None` keeps the first kernel at every row count (batch invariance: `model.quantize.
  keep_int8_kernel`);
- where the compiled kernels are not built (`GPTSERVE_NATIVE=0`, no compiler), PyTorch decodes the
  weights (`model.gguf.kquant_blocks.dequantize`) and multiplies them so at every row count: the
  same values, much slower per decoded token (`model.gguf.quantized` loads int8 rows instead
  there; `bench/gguf_kquant.py` measures both).

Inference only: the buffers are not trainable.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.cpu.native import native_ops
from gptserve.kernels.cpu.products import product_nt
from gptserve.model.gguf.kquant_blocks import KIND_CODES, dequantize, row_bytes

# from this many rows on, decode the weights to float32 and use a float32 product
MANY_ROWS = 16
CHUNK_ELEMENTS = 1 << 22  # weights decoded at a time on the many-row path (16 MiB of float32)


class KQuantLinear(nn.Module):
    """(..., in) -> (..., out) with Q5_K or Q6_K weights (`kind`), `blocks` being the file's bytes
    (out, in / 256 * bytes a super-block) uint8. `dtype` is that of the outputs and bias; the
    products run in float32. `compiled` chooses the kernels (default: the compiled ones where they
    build). Buffer: `blocks`."""

    def __init__(
        self,
        blocks: torch.Tensor,
        kind: str,
        in_features: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        compiled: bool | None = None,
    ) -> None:
        super().__init__()
        width = row_bytes(kind, in_features)
        if blocks.dim() != 2 or blocks.shape[1] != width or blocks.dtype != torch.uint8:
            raise ValueError(f"{kind} blocks of {in_features} inputs are (out, {width}) uint8")
        if compiled and _compiled_ops() is None:
            raise ValueError("the compiled K-quant kernels are not built here")
        self.compiled = _compiled_ops() is not None if compiled is None else compiled
        self.kind, self.code = kind, KIND_CODES[kind]
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.dtype = dtype
        self.many_rows: int | None = MANY_ROWS
        self.register_buffer("blocks", blocks.contiguous())  # (out, in / 256 * block bytes)
        self.bias = None
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(dtype).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, in)
        blocks = self._buffers["blocks"]
        few = self.many_rows is None or rows.shape[0] < self.many_rows
        if self.compiled and few:
            y = _compiled_ops().kquant_matmul(rows, blocks, self.code)  # (M, out) float32
        else:
            y = self._decoded_product(rows.float(), blocks)
        if self.bias is not None:
            y = torch.add(self.bias, y)  # in the bias's dtype: the add is the cast back
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def weight_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of the weights, decoded: (rows, in) float32, the file's values."""
        blocks = self._buffers["blocks"][start:stop]
        if self.compiled:
            return _compiled_ops().kquant_dequantize(blocks, self.code, self.in_features)
        return dequantize(blocks, self.kind)

    def _decoded_product(self, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """(M, in) float32 -> (M, out) float32: the weights decoded a chunk of rows at a time."""
        step = max(1, CHUNK_ELEMENTS // self.in_features)
        if step >= self.out_features:
            return product_nt(rows, self.weight_rows())
        y = rows.new_empty(rows.shape[0], self.out_features)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            y[:, start:stop] = product_nt(rows, self.weight_rows(start, stop))
        return y

    def extra_repr(self) -> str:
        kernel = "compiled" if self.compiled else "PyTorch's"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.kind} as the file stores it, {kernel} kernels"
        )


def kquant_compiled() -> bool:
    """Whether the compiled K-quant kernels run here."""
    return _compiled_ops() is not None


@functools.cache
def _compiled_ops() -> Any | None:
    """The compiled CPU kernels, or None where they do not build."""
    return native_ops()
