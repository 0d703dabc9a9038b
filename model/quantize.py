"""Int8 quantization of a loaded model's matrices, applied from outside it (`quantize`).

`quantize(model, "int8")` replaces each layer's four matrices and the output head by `Int8Linear`:
int8 weights with one scale per output channel (symmetric, round to nearest). On a CPU where the
compiled kernels run (`kernels/cpu/q8_matmul.cpp`), the matrix is held in tiles and multiplied
byte by byte with the rows quantized to 8 bits per block of 32, as llama.cpp's q8_0 runs
(`Int8Linear`'s docstring has the figures); elsewhere, and for what follows, by PyTorch's int8
weight-pack product (`torch.ops.aten._weight_int8pack_mm`), on a CPU and on CUDA.
LayerNorms, biases, positions and the KV cache stay in the model's dtype, and so do the
activations between products (the compiled product rounds its input rows to 8 bits for itself;
PyTorch's to bfloat16). A tied
embedding reads its rows from the int8 head (dequantized), so the table is stored once: for
GPT-2 124M the weights then take 127 MB instead of 498 MB in float32.

What the product supports in PyTorch 2.13, and what follows here:
- on x86 CPUs only bfloat16 inputs have a vectorized kernel (float32 and float16 run a scalar
  loop, 5-16x slower), so on a CPU the products always take bfloat16 inputs, whatever the
  model's dtype; the scales are rounded to bfloat16 before quantizing, so they lose nothing;
- that kernel reads 16 input channels at a time with aligned loads: inputs whose width is not a
  multiple of 16 are zero-padded, and an input that does not start on a 64-byte boundary is
  copied first (either one crashes the process otherwise);
- it multiplies blocks of 4 rows, reading the weights again for each block, so it is bound by
  arithmetic beyond a few rows: from `MANY_ROWS` rows on, the weights are dequantized to
  bfloat16 for the call and multiplied by the ordinary product instead, where that product is
  native (`model.cpu.isa.fast_bfloat16_products`: AVX-512 BF16 or AMX). Without native
  bfloat16 products (AVX2 hosts) the dequantized product loses at every row count measured,
  2-3x at 16 and 32 rows, so the int8 kernel is kept throughout; and so it is when a row's result must not depend on the row count
  (`keep_int8_kernel`). `python bench/cpu_parts.py` measures both.

The model is for inference only afterwards (no gradients), and `save_checkpoint` refuses it:
save the model as loaded, not a quantized one.

"none" leaves the weights as the checkpoint stores them: float, or a GGUF file's own low bits
(`model.gguf.quantized`, on a CPU); "dequantize" turns a GGUF file's weights into float in the
model's dtype (for other checkpoints it is "none").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.kernels.cpu.native import native_ops
from gptserve.model.activations import KERNEL_CODES, activate
from gptserve.model.cpu.isa import fast_bfloat16_products
from gptserve.model.gpt import GPT
from gptserve.model.int4_linear import Int4Linear
from gptserve.model.kquant_linear import KQuantLinear

QUANTIZATIONS = ("none", "int8", "dequantize")
K_MULTIPLE = 16  # input channels the CPU kernel reads at a time
ALIGN_BYTES = 64  # the CPU kernel's aligned loads need 32; PyTorch's allocator gives 64
# from this many rows on, dequantize and use the ordinary product: measured per call with native
# bfloat16 (docs/BENCHMARKS.md, "AVX2 hosts"), the int8 kernel wins at 16 rows for every matrix
# (SmolLM2's head 3.6 against 5.4 ms) and ties or loses at 32 (the head 7.1 against 6.6 ms)
MANY_ROWS = 32
# the compiled 8-bit product (kernels/cpu/q8_matmul.cpp) against the dequantized bfloat16 product,
# GPT-2's 49 matrices: 2.5x at 32 rows, 1.5x at 64, 0.8-1.1x at 128 (two runs), 0.73x at 512
TILED_MANY_ROWS = 128
TILE = 32  # output columns a tile of the compiled product holds
QUAD = 4  # inputs a column's consecutive bytes hold there


def q8_ops(in_features: int, device: torch.device) -> Any | None:
    """The compiled CPU kernels if they can multiply an int8 matrix of `in_features` inputs on
    `device` (vector instructions, whole blocks of 32 inputs), else None."""
    if device.type != "cpu" or in_features % 32:
        return None
    ops = native_ops()
    return ops if ops is not None and ops.q8_lanes() > 1 else None


def pack_q8_tiles(q: torch.Tensor) -> torch.Tensor:
    """(out, in) int8 -> (tiles, in / 4, 32, 4): each tile's columns 4 inputs at a time, a
    column's 4 bytes side by side; the last tile padded with zero columns."""
    out_features, in_features = q.shape
    tiles = -(-out_features // TILE)
    padded = F.pad(q, (0, 0, 0, tiles * TILE - out_features))  # (tiles * 32, in)
    view = padded.view(tiles, TILE, in_features // QUAD, QUAD)
    return view.permute(0, 2, 1, 3).contiguous()


def dequantize_from_rows(device: torch.device) -> int | None:
    """From how many rows an int8 product on `device` dequantizes its weights (None: never)."""
    if device.type == "cpu" and not fast_bfloat16_products():
        return None
    return MANY_ROWS


class QuantizeError(ValueError):
    """A quantization that this model, device or dtype cannot run; the message is one line."""


def check_quantization(method: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Raise QuantizeError if `method` cannot serve a model of `dtype` on `device`."""
    if method not in QUANTIZATIONS:
        raise QuantizeError(f"unknown quantization {method!r}; choose from {QUANTIZATIONS}")
    if method in ("none", "dequantize"):
        return
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise QuantizeError(f"--quantize int8 needs PyTorch 2.4 or later (this is {torch.__version__})")  # fmt: skip
    if torch.device(device).type == "cpu" and dtype == torch.float16:
        raise QuantizeError(
            "--quantize int8 on a CPU runs with --dtype float32 or bfloat16 (float16 has no fast "
            "path for its int8 products here)"
        )
    if torch.device(device).type not in ("cpu", "cuda"):
        raise QuantizeError(f"--quantize int8 runs on cpu or cuda, not {torch.device(device).type}")  # fmt: skip


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (out, in) int8 and (out,) float32 scales, weight ~ q * scale.

    Symmetric per output channel, round to nearest, values in [-127, 127]. Each scale is a
    bfloat16 value, so products that run in bfloat16 use exactly these scales.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp(min=1e-12)  # (out,)
    scales = (amax / 127).to(torch.bfloat16).float()  # may round down: the clamp absorbs it
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
    return q, scales


def int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, many_rows: int | None = MANY_ROWS
) -> torch.Tensor:
    """(M, K) x (N, K) int8 weight, (N,) scales -> (M, N) in x's dtype (x, scales same dtype).

    K is a multiple of `K_MULTIPLE` (the caller pads); x is contiguous. From `many_rows` rows on
    (never with None) the weights are dequantized and multiplied by the ordinary product.
    """
    if many_rows is not None and x.shape[0] >= many_rows:
        return F.linear(x, weight.to(x.dtype)) * scales  # (M, N)
    if x.device.type == "cpu" and x.data_ptr() % ALIGN_BYTES:
        x = x.clone()  # a fresh allocation is aligned
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales)  # (M, N)


class Int8Linear(nn.Module):
    """The `nn.Linear` it is built from, with int8 weights and a scale per output channel.

    Where the compiled CPU kernels run (`q8_ops`: a CPU, whole blocks of 32 inputs) the matrix is
    held as `codes`, tiles for `kernels/cpu/q8_matmul.cpp` (`pack_q8_tiles`), with float32
    `scales`: rows in float32, quantized to 8 bits per block of 32 by the kernel, bytes times
    bytes (GPT-2's 49 matrices 1.4-2.4x faster than PyTorch's int8 kernel for 1-128 rows,
    AVX-512 and AVX2 alike); `TILED_MANY_ROWS` rows and more dequantize them where bfloat16
    products are native. Elsewhere `weight` is (out, in padded to K_MULTIPLE) int8 and `scales`
    (out,) in `op_dtype`, the dtype PyTorch's product runs in (bfloat16 on a CPU, the model's
    dtype elsewhere). `tiled` False keeps the latter everywhere (benchmarks compare the two).
    """

    def __init__(self, linear: nn.Linear, tiled: bool | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()  # (out, in)
        q, scales = quantize_rows(weight)
        self._hold(q, scales, linear.bias, weight.dtype, tiled)

    @classmethod
    def from_rows(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        tiled: bool | None = None,
    ) -> Int8Linear:
        """From rows quantized already ((out, in) int8, (out,) scales as `quantize_rows` makes
        them), for matrices never held in float at once (a GGUF file's: model.gguf.quantized)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._hold(q, scales, bias, dtype, tiled)
        return module

    def _hold(
        self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
        dtype: torch.dtype, tiled: bool | None,
    ) -> None:  # fmt: skip
        self.out_features, self.in_features = q.shape
        self.dtype = dtype  # of inputs, outputs and bias
        self.out_dtype: torch.dtype | None = None  # None: `dtype`
        # applied to the outputs (a name of model.activations): set where a feed-forward
        # block's first product takes its activation (model.cpu.optimize.FusedMLP)
        self.activation = "none"
        ops = None if tiled is False else q8_ops(self.in_features, q.device)
        if tiled and ops is None:
            raise ValueError("the compiled 8-bit product does not run here")
        self.q8 = None if ops is None else ops.q8_matmul
        self.q8_dense = None if ops is None else ops.q8_dense
        # None: the int8 kernel at every row count
        self.many_rows: int | None = dequantize_from_rows(q.device)
        self.bias = None
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(dtype).clone(), requires_grad=False)
        if self.q8 is not None:
            self.op_dtype, self.pad = torch.float32, 0
            self.register_buffer("codes", pack_q8_tiles(q))  # (tiles, in / 4, 32, 4)
            self.register_buffer("scales", scales.float())  # (out,)
            self.many_rows = self.many_rows and TILED_MANY_ROWS
            return
        self.op_dtype = torch.bfloat16 if q.device.type == "cpu" else dtype
        self.pad = -self.in_features % K_MULTIPLE
        self.register_buffer("weight", F.pad(q, (0, self.pad)).contiguous())  # (out, in + pad)
        self.register_buffer("scales", scales.to(self.op_dtype))  # (out,)

    def dense(self, dtype: torch.dtype = torch.int8) -> torch.Tensor:
        """(out, in + pad) in `dtype` (the int8 values): the matrix in rows, whichever way it is
        held (from tiles a copy)."""
        if self.q8 is None:
            return self.weight.to(dtype)
        codes = self._buffers["codes"]  # (tiles, in / 4, 32, 4)
        if dtype == torch.bfloat16:  # the many-rows product's: compiled
            return self.q8_dense(codes, self.out_features)  # (out, in)
        rows = codes.permute(0, 2, 1, 3).reshape(-1, self.in_features)  # (tiles * 32, in)
        return rows[: self.out_features].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out). Called 49 times a decode step: few Python steps on purpose."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, in)
        if self.q8 is not None:
            return self._tiled(x, rows)
        rows = rows.to(self.op_dtype).contiguous()
        if self.pad:
            rows = F.pad(rows, (0, self.pad))  # (M, in + pad)
        buffers = self._buffers  # a dict read: `self.weight` goes through Module.__getattr__
        y = int8_matmul(rows, buffers["weight"], buffers["scales"], self.many_rows)  # (M, out)
        if self.bias is not None:
            y = torch.add(self.bias, y)  # in the bias's dtype: the add is the cast back
        y = activate(y, self.activation)
        want = self.out_dtype or self.dtype
        if y.dtype != want:
            y = y.to(want)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _tiled(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`forward` where the matrix is held in tiles: the compiled product, or for
        `many_rows` rows and more the dequantized bfloat16 product."""
        buffers, bias = self._buffers, self.bias
        if self.many_rows is not None and rows.shape[0] >= self.many_rows:
            y = F.linear(rows.to(torch.bfloat16), self.dense(torch.bfloat16))  # (M, out)
            y = y * buffers["scales"].to(torch.bfloat16)
            if bias is not None:
                y = torch.add(bias, y)
            y = activate(y, self.activation)
        else:
            fused = bias is None or bias.dtype == torch.float32
            act = KERNEL_CODES[self.activation] if fused else 0
            y = self.q8(rows.float(), buffers["codes"], buffers["scales"],
                        bias if fused else None, self.out_features, act)  # fmt: skip
            if not fused:
                y = activate(torch.add(bias, y), self.activation)
        want = self.out_dtype or self.dtype
        if y.dtype != want:
            y = y.to(want)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (...) of the dequantized (out, in) weight, as (..., in) in `dtype`."""
        if self.q8 is None:
            q = self.weight[index, : self.in_features].float()  # (..., in)
        else:  # each row's bytes from its tile: (..., in / 4, 4)
            codes = self._buffers["codes"]
            q = codes[index // TILE, :, index % TILE].reshape(*index.shape, -1).float()
        return (q * self.scales[index].float().unsqueeze(-1)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """A tied embedding that reads its rows from the int8 head, so the table is stored once."""

    def __init__(self, source: Int8Linear) -> None:
        super().__init__()
        self.source = source

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        """(...) token ids -> (..., C)."""
        return self.source.rows(index)


def keep_int8_kernel(model: nn.Module) -> None:
    """Make every int8 product of `model` take its int8 kernel (the compiled tiles or PyTorch's)
    at every row count, so a row's result does not depend on how many rows are multiplied with
    it (batch invariance); a batch of `TILED_MANY_ROWS` (`MANY_ROWS` for PyTorch's kernel) rows
    and more is then slower where bfloat16 products are native (docs/RELIABILITY.md has the
    cost). A GGUF file's Q5_K and Q6_K products (`KQuantLinear`) keep their few-row kernel so
    too."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, KQuantLinear)):
            module.many_rows = None


def is_quantized(model: nn.Module) -> bool:
    """Whether the model holds int8 layers or a GGUF file's low-bit ones."""
    return any(isinstance(m, (Int8Linear, Int4Linear, KQuantLinear)) for m in model.modules())


@torch.no_grad()
def quantize(model: GPT, method: str) -> GPT:
    """Quantize the layer matrices and head of a loaded model in place; returns the model.

    "none" and "dequantize" return it unchanged (the latter acts at load: `load_checkpoint`'s
    `low_bit`); a model already quantized is returned unchanged. Quantize before
    `model.cpu.optimize_for_cpu`, which leaves int8 layers as they are.
    """
    if method not in QUANTIZATIONS:
        raise QuantizeError(f"unknown quantization {method!r}; choose from {QUANTIZATIONS}")
    if method in ("none", "dequantize") or is_quantized(model):
        return model
    if not isinstance(model.lm_head, nn.Linear):
        raise QuantizeError("quantize the model before optimize_for_cpu, not after")
    model.eval().requires_grad_(False)
    tied = model.lm_head.weight is model.transformer.wte.weight
    for block in model.transformer.h:
        for owner in (block.attn, block.mlp):
            owner.c_proj = Int8Linear(owner.c_proj)
        block.attn.c_attn = Int8Linear(block.attn.c_attn)
        block.mlp.c_fc = Int8Linear(block.mlp.c_fc)
    model.lm_head = Int8Linear(model.lm_head)
    if tied:
        model.transformer.wte = Int8Embedding(model.lm_head)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights, each tensor counted once (parameters and buffers)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and not t.is_mkldnn:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
