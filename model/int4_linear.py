"""A linear layer with int4 weights in groups of 32: each weight `(code - 8) * scale + zero`
(`model.gguf.blocks.Int4Groups`, which GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly, and a Q8_0
block is as two groups fed the same inputs: `input_copies`).

Two kernels multiply it, chosen once when the layer is built:

- the compiled `int4_matmul` (kernels/cpu/int4_matmul.cpp, where `kernels.cpu.native` builds):
  float32 inputs and sums, the matrix in tiles of 32 output columns (`pack_tiles`), a row's
  result the same whatever the batch. For one row both kernels wait on memory and come out about
  even; from 4 rows to 512 it is 1.33-1.43x PyTorch's (`python bench/cpu_parts.py --parts
  int4`), and its float32 inputs and exact scales keep the file's model closer to its float one;
- PyTorch's `aten._weight_int4pack_mm_for_cpu` elsewhere, on the layout
  `aten._convert_weight_to_int4pack_for_cpu` makes (it depends on the CPU's instruction set, so
  it is opaque here). It needs codes as an (out, in) int32 matrix, out a multiple of 16 (zero rows
  pad it), scales and zeros as one (in / 32, out, 2) tensor, and bfloat16 inputs: float32 and
  float16 inputs run a scalar loop, about 50x slower on an AVX-512 CPU, so its products take
  bfloat16 inputs (as `model.quantize.Int8Linear` does) and the scales and zeros are rounded to
  bfloat16 (a relative 2^-9, far below a 4-bit step). It stays ahead of a float32 product at
  every batch size measured, so prefill uses it too.

`Int4Linear.use_int8_activations()` (`--int8-activations`, opt-in) moves a compiled layer to
`int4_q8_matmul` (kernels/cpu/int4_q8_matmul.cpp): the weights times the rows rounded to 8 bits per
block of 32, the codes multiplied byte by byte, as llama.cpp multiplies its Q4 matrices. On AVX2
that is a `maddubs` and an add per 32 weights a row against four 8-lane multiply-adds, which is
what bounds batches there (the default model's 16-row products 21.9 -> 11.0 ms a step);
the answers then depart from the float32 oracle by the rows' rounding (docs/BENCHMARKS.md
measures how far). Its codes lie as (tiles, width / 8, TILE, 4) bytes (`q8_layout`).

Either way the matrix takes its 4 bits a weight and a sixth more (a scale and a zero point a group
in 16 bits each: float16 for the compiled kernel where that is exact, as for GGUF's Q4_0, Q4_1
and Q8_0, float32 where not, as for Q4_K; bfloat16 for PyTorch's). Inference only: the buffers
are not trainable.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from gptserve.kernels.cpu.native import native_ops
from gptserve.model.gguf.blocks import GROUP, Int4Groups

ROW_MULTIPLE = 16  # output channels PyTorch's packing takes at a time
TILE = 32  # output columns of a tile of the compiled kernel's layout
PACK_ROWS = 4096  # rows packed at a time (a multiple of the packing's blocks of 32 or 64 rows)


def int4_supported() -> bool:
    """Whether this PyTorch has the int4 CPU kernel."""
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        aten, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4Linear(nn.Module):
    """(..., in) -> (..., out) with int4 weights and a scale and zero point per group of 32.

    The codes' width is `input_copies` times `in_features`: with 2, each group of 32 inputs feeds
    two consecutive groups of weights, which add up (a Q8_0 block as its high and low nibbles).
    `dtype` is that of the inputs, outputs and bias; `op_dtype` the one the inputs are rounded to
    before the product (default: float32 for the compiled kernel, bfloat16 for PyTorch's).
    `compiled` chooses the kernel (default: the compiled one where it builds). Buffers: `weight`,
    the packed codes, and `scales_and_zeros`, in the chosen kernel's layout (module docstring).
    """

    def __init__(
        self,
        groups: Int4Groups,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        op_dtype: torch.dtype | None = None,
        input_copies: int = 1,
        compiled: bool | None = None,
    ) -> None:
        super().__init__()
        self.out_features, width = groups.codes.shape
        if width % (GROUP * input_copies):
            raise ValueError(f"int4 rows need a multiple of {GROUP} inputs, got {width}")
        self.in_features, self.input_copies = width // input_copies, input_copies
        if compiled and _compiled_matmul() is None:
            raise ValueError("the compiled int4 kernel is not built here")
        self.compiled = _compiled_matmul() is not None if compiled is None else compiled
        self.dtype = dtype
        self.op_dtype = op_dtype or (torch.float32 if self.compiled else torch.bfloat16)
        if self.compiled and self.op_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the compiled int4 kernel takes float32 or bfloat16, not {op_dtype}")
        self.out_dtype: torch.dtype | None = None  # None: `dtype`
        self.int8_activations = False  # `use_int8_activations`
        if self.compiled:
            self.pad = 0
            tiled = pack_tiles(groups)
            self.register_buffer("weight", tiled[0])  # (tiles, width / 2, 32)
            self.register_buffer("scales_and_zeros", tiled[1])  # (tiles, width / 32, 2, 32)
        else:
            self.pad = -self.out_features % ROW_MULTIPLE
            scales = torch.from_numpy(groups.scales)  # (out, width / 32)
            zeros = torch.from_numpy(groups.zeros)
            table = torch.stack([scales.t(), zeros.t()], dim=-1)  # (width / 32, out, 2)
            if self.pad:
                table = nn.functional.pad(table, (0, 0, 0, self.pad))  # (width / 32, out + pad, 2)
            self.register_buffer("weight", _pack(groups.codes, self.pad))  # (out + pad, width / 2)
            self.register_buffer("scales_and_zeros", table.to(self.op_dtype).contiguous())
        self.bias = None
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(dtype).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, in)
        if rows.dtype != self.op_dtype:
            rows = rows.to(self.op_dtype)
        buffers = self._buffers  # a dict read: `self.weight` goes through Module.__getattr__
        want = self.out_dtype or self.dtype
        if self.compiled:
            # float32 out unless the caller takes bfloat16 and no bias is added first
            direct = want if want == torch.bfloat16 and self.bias is None else torch.float32
            matmul = _compiled_q8_matmul() if self.int8_activations else _compiled_matmul()
            y = matmul(
                rows,
                buffers["weight"],
                buffers["scales_and_zeros"],
                self.out_features,
                self.input_copies,
                direct,
            )  # (M, out)
        else:
            y = self._torch_product(rows, buffers)
        if self.bias is not None:
            y = torch.add(self.bias, y)  # in the bias's dtype: the add is the cast back
        if y.dtype != want:
            y = y.to(want)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def use_int8_activations(self) -> None:
        """Multiply from now on with the rows rounded to 8 bits per block of 32
        (`int4_q8_matmul`), the codes moved to its layout in place; compiled layers only."""
        if not self.compiled:
            raise ValueError("8-bit activations need the compiled int4 kernel")
        if not self.int8_activations:
            self.weight = q8_layout(self._buffers["weight"])
            self.int8_activations = True

    def _torch_product(self, rows: torch.Tensor, buffers: dict) -> torch.Tensor:
        """(M, in) in op_dtype -> (M, out) through PyTorch's kernel."""
        if self.input_copies > 1:  # (M, in / 32, copies, 32): each group once per weight group
            blocks = rows.reshape(-1, self.in_features // GROUP, 1, GROUP)
            rows = blocks.expand(-1, -1, self.input_copies, -1).reshape(rows.shape[0], -1)
        if not rows.is_contiguous():
            rows = rows.contiguous()  # (M, copies * in)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, buffers["weight"], GROUP, buffers["scales_and_zeros"]
        )  # (M, out + pad) in op_dtype
        return y[:, : self.out_features] if self.pad else y

    def extra_repr(self) -> str:
        copies = f" x{self.input_copies}" if self.input_copies > 1 else ""
        kernel = "compiled" if self.compiled else "PyTorch's"
        if self.int8_activations:
            kernel += ", 8-bit rows"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP}{copies}, {kernel} kernel"
        )


def use_int8_activations(model: nn.Module) -> int:
    """Move every compiled `Int4Linear` of `model` to 8-bit rows (`Int4Linear.use_int8_activations`),
    in place; returns how many."""
    layers = [m for m in model.modules() if type(m) is Int4Linear and m.compiled]
    for layer in layers:
        layer.use_int8_activations()
    return len(layers)


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


@functools.cache
def _compiled_matmul() -> Any | None:
    """The compiled `int4_matmul`, or None where the CPU kernels do not build or were built
    without vector instructions (not x86 with AVX2: PyTorch's kernel is faster there)."""
    ops = native_ops()
    if ops is None or ops.int4_lanes() < 2:
        return None
    return ops.int4_matmul


def int4_compiled() -> bool:
    """Whether the compiled int4 kernels serve here (`_compiled_matmul`)."""
    return _compiled_matmul() is not None


@functools.cache
def _compiled_q8_matmul() -> Any | None:
    """The compiled `int4_q8_matmul`, where `_compiled_matmul` is."""
    return None if _compiled_matmul() is None else native_ops().int4_q8_matmul


def q8_layout(tiled: torch.Tensor) -> torch.Tensor:
    """`pack_tiles`' codes (tiles, width / 2, TILE) -> `int4_q8_matmul`'s (tiles, width / 8, TILE,
    4) uint8: for each 8 inputs, byte b of a column holds the codes of input b (low nibble) and
    b + 4 (high)."""
    tiles, half, _ = tiled.shape
    codes = torch.stack([tiled & 15, tiled >> 4], dim=2).view(tiles, half * 2, TILE)  # (T, W, 32)
    eights = codes.view(tiles, half // 4, 2, 4, TILE)  # (T, W / 8, first or last 4, 4, 32)
    packed = eights[:, :, 0] | (eights[:, :, 1] << 4)  # (T, W / 8, 4, 32)
    return packed.transpose(2, 3).contiguous()  # (T, W / 8, 32, 4)


def pack_tiles(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4 groups (out, width) -> the compiled kernel's layout: codes (tiles, width / 2, TILE)
    uint8, byte (p, j) holding column j's codes 2p (low nibble) and 2p + 1 (high), and a
    (tiles, width / 32, 2, TILE) table of each group's scale and offset zero - 8 scale, in
    float16 where that is exact (GGUF's Q4_0, Q4_1 and Q8_0 store theirs so), else float32; zero
    columns pad the last tile."""
    out, width = groups.codes.shape
    pad = -out % TILE
    tiles = (out + pad) // TILE
    offsets = groups.zeros.astype(np.float64) - 8 * groups.scales.astype(np.float64)
    table = np.stack([groups.scales, offsets], axis=1).astype(np.float32)  # (out, 2, G)
    half = table.astype(np.float16)
    if np.array_equal(half.astype(np.float32), table):
        table = half  # no rounding: half the bytes
    table = np.pad(table, ((0, pad), (0, 0), (0, 0))).reshape(tiles, TILE, 2, -1)
    codes = np.pad(groups.codes, ((0, pad), (0, 0))).reshape(tiles, TILE, width // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)  # (tiles, TILE, width / 2)
    packed = np.ascontiguousarray(packed.transpose(0, 2, 1))  # (tiles, width / 2, TILE)
    table = np.ascontiguousarray(table.transpose(0, 3, 2, 1))  # (tiles, G, 2, TILE)
    return torch.from_numpy(packed), torch.from_numpy(table)
