"""A linear layer with int4 weights in groups of 32, multiplied by PyTorch's int4 CPU kernel.

`Int4Linear` holds the matrix as `torch.ops.aten._convert_weight_to_int4pack_for_cpu` packs it
and multiplies with `torch.ops.aten._weight_int4pack_mm_for_cpu`, which computes each weight of
a group of 32 input channels as `(code - 8) * scale + zero` (`model.gguf_blocks.Int4Groups`,
which GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly, and a Q8_0 block is as two groups fed the same
inputs: `input_copies`). What the kernel needs in PyTorch 2.13:

- codes as an (out, in) int32 matrix of values 0..15, out a multiple of 16 (zero rows pad it);
  the packed layout depends on the CPU's instruction set, so it is opaque here (never unpacked);
- scales and zeros as one (in / 32, out, 2) tensor in the inputs' dtype;
- inputs in bfloat16: float32 and float16 inputs run a scalar loop, about 50x slower on an AVX-512
  CPU, so the products always take bfloat16 inputs (as `model.quantize.Int8Linear` does) and the
  scales and zeros are rounded to bfloat16 (a relative 2^-9, far below a 4-bit step).

The kernel stays ahead of a float32 product at every batch size measured (1 to 256 rows), so
prefill uses it too. Inference only: the buffers are not trainable.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from model.gguf_blocks import GROUP, Int4Groups

ROW_MULTIPLE = 16  # output channels the packing takes at a time
PACK_ROWS = 4096  # rows packed at a time (a multiple of the packing's blocks of 32 or 64 rows)


def int4_supported() -> bool:
    """Whether this PyTorch has the int4 CPU kernel."""
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        aten, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4Linear(nn.Module):
    """(..., in) -> (..., out) with int4 weights and a scale and zero point per group of 32.

    `weight` is the packed (out padded, width / 2) uint8 matrix and `scales_and_zeros` the
    (width / 32, out padded, 2) table in `op_dtype`; both are buffers. The codes' width is
    `input_copies` times `in_features`: with 2, each group of 32 inputs feeds two consecutive
    groups of weights, which add up (a Q8_0 block as its high and low nibbles). `dtype` is that of
    the inputs, outputs and bias.
    """

    def __init__(
        self,
        groups: Int4Groups,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        op_dtype: torch.dtype = torch.bfloat16,
        input_copies: int = 1,
    ) -> None:
        super().__init__()
        self.out_features, width = groups.codes.shape
        if width % (GROUP * input_copies):
            raise ValueError(f"int4 rows need a multiple of {GROUP} inputs, got {width}")
        self.in_features, self.input_copies = width // input_copies, input_copies
        self.dtype, self.op_dtype = dtype, op_dtype
        self.out_dtype: torch.dtype | None = None  # None: `dtype`
        self.pad = -self.out_features % ROW_MULTIPLE
        scales = torch.from_numpy(groups.scales)  # (out, width / 32)
        zeros = torch.from_numpy(groups.zeros)
        table = torch.stack([scales.t(), zeros.t()], dim=-1)  # (width / 32, out, 2)
        if self.pad:
            table = nn.functional.pad(table, (0, 0, 0, self.pad))  # (width / 32, out + pad, 2)
        self.register_buffer("weight", _pack(groups.codes, self.pad))  # (out + pad, width / 2)
        self.register_buffer("scales_and_zeros", table.to(op_dtype).contiguous())
        self.bias = None
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(dtype).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, in)
        rows = rows.to(self.op_dtype)
        if self.input_copies > 1:  # (M, in / 32, copies, 32): each group once per weight group
            blocks = rows.reshape(-1, self.in_features // GROUP, 1, GROUP)
            rows = blocks.expand(-1, -1, self.input_copies, -1).reshape(rows.shape[0], -1)
        if not rows.is_contiguous():
            rows = rows.contiguous()  # (M, copies * in)
        buffers = self._buffers  # a dict read: `self.weight` goes through Module.__getattr__
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, buffers["weight"], GROUP, buffers["scales_and_zeros"]
        )  # (M, out + pad) in op_dtype
        if self.pad:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = torch.add(self.bias, y)  # in the bias's dtype: the add is the cast back
        want = self.out_dtype or self.dtype
        if y.dtype != want:
            y = y.to(want)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        copies = f" x{self.input_copies}" if self.input_copies > 1 else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP}{copies}"
        )


def _pack(codes: np.ndarray, pad: int) -> torch.Tensor:
    """(out, width) uint8 codes -> the kernel's packed (out + pad, width / 2) uint8, converted
    `PACK_ROWS` rows at a time: the packing takes int32 codes, 8x the packed bytes."""
    rows = codes.shape[0]
    packed = []
    for start in range(0, rows, PACK_ROWS):
        chunk = torch.from_numpy(codes[start : start + PACK_ROWS]).to(torch.int32)
        if start + PACK_ROWS >= rows and pad:
            chunk = nn.functional.pad(chunk, (0, 0, 0, pad))  # zero rows to a multiple of 16
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, 2))
    return packed[0] if len(packed) == 1 else torch.cat(packed)
