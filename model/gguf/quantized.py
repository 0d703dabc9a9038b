"""A GGUF file's model at the file's own bits: each matrix becomes the module its type maps to.

- Q4_0, Q4_1, Q4_K: `Int4Linear`, exactly the file's codes, scales and zero points
  (`model.gguf.blocks`);
- Q8_0: `Int4Linear` too, each block exactly as two int4 groups (its high and low nibbles), so the
  products take the same kernel; a sixth more bytes than the file (the kernel's scale table);
- Q5_K, Q6_K: `KQuantLinear`, the file's super-blocks byte for byte (5.5 and 6.5625 bits a
  weight, `model.gguf.kquant_blocks`), multiplied as the file's dequantized weights in float32 by
  the compiled kernels (decoded inside the dot products for few rows, decoded to float32 for a
  float32 product for many); where those kernels are not built, `Int8Linear` (int8 rows, one
  scale each) requantized from the dequantized rows as before: not exact, but PyTorch decoding
  the blocks at every product would be many times slower;
- F32, F16, BF16: `nn.Linear` in the model's dtype, as `dequantized_state` gives them.

The int4 products run in float32 with the file's scales exactly where the compiled CPU kernels
build, else in bfloat16 through PyTorch's kernel (`model.int4_linear`); the int8 ones with their
rows rounded to 8 bits per block (`model.quantize`).
So the model is close to the float model, not equal to it: tests/model/gguf/test_gguf_lowbit.py
measures how far (SmolLM2 over the first 512 tokens of Shakespeare: the top token is the float
model's at every position with the compiled kernel, at 99.0% with PyTorch's; the loss within
0.1%; its FFN down matrices requantized to Q6_K or Q5_K, the same at their own bits).

A joined matrix (q/k/v, gate/up) whose parts map to different modules (a Q4_K_M file keeps some
V matrices in Q6_K) becomes a `StackedLinear` of the parts. A quantized token table is never held
in memory: the embedding reads its rows from the file (`model.gguf.rows.FileRows`), and the
output head (the table when tied) is the fast product above refined by those exact rows
(`RefinedHead`), except a `KQuantLinear` head, whose products are the exact rows' already.
Norms, biases and position tables are small and become float.

The GPT's parameters are built on the meta device and each matrix is converted on its own, so no
float copy of the model is ever made: the largest temporaries are one matrix's int32 codes before
packing, and `ROWS_AT_ONCE` dequantized rows on the way to int8.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn as nn
from gptserve.model.config import ConfigError
from gptserve.model.gguf.blocks import (
    INT4_TYPES,
    SPLIT_TYPES,
    Int4Groups,
    int4_groups,
    q8_0_split_groups,
)
from gptserve.model.gguf.checkpoint import GGUFModel, RawTensor
from gptserve.model.gguf.kquant_blocks import KQUANT_TYPES
from gptserve.model.gguf.rows import FileRows, RefinedHead, RowsEmbedding
from gptserve.model.gpt import GPT
from gptserve.model.int4_linear import Int4Linear, int4_compiled
from gptserve.model.kquant_linear import KQuantLinear, kquant_compiled
from gptserve.model.quantize import Int8Linear, quantize_rows
from torch.overrides import TorchFunctionMode

FLOAT_TYPES = ("F32", "F16", "BF16")
ROWS_AT_ONCE = 2048  # rows dequantized at a time on the way to int8


class StackedLinear(nn.Module):
    """A joined matrix whose parts are stored at different bits: (..., in) -> (..., sum of the
    parts' out), each part multiplied by its own module."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class _ParametersOnMeta(TorchFunctionMode):
    """Builds a model with its parameters on the meta device (no memory) and none of their random
    fills, while buffers computed at construction (rotary frequencies) are made as usual.

    Parameters are allocated with `torch.empty` by PyTorch's layers; the fills are skipped rather
    than run on meta tensors, where PyTorch runs them through Python reference implementations
    whose first use imports sympy (seconds, and 160 MB held for good).
    """

    FILLS = (torch.Tensor.normal_, torch.Tensor.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs["device"] = "meta"
        elif func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]  # as the fills return it
        return func(*args, **kwargs)


def family(kind: str) -> str:
    """The module a GGML type maps to: "int4", "split" (int4, two groups a block), "Q5_K" or
    "Q6_K" (`KQuantLinear`, or "int8" where its compiled kernels are not built) or "float"."""
    if kind in INT4_TYPES:
        return "int4"
    if kind in SPLIT_TYPES:
        return "split"
    if kind in KQUANT_TYPES:
        return kind if kquant_compiled() else "int8"
    if kind in FLOAT_TYPES:
        return "float"
    raise ConfigError(f"GGML type {kind} has no low-bit module here")


def float_rows(raw: RawTensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows start:stop of a tensor as float32 (rows, cols); a vector as (n,)."""
    data = raw.data[start:stop]
    if raw.type in ("F32", "F16"):
        array = data.astype(np.float32)
    else:
        array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[raw.type])
    shape = raw.shape if len(raw.shape) == 1 else (-1, raw.shape[1])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def int8_rows(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix as (rows, cols) int8 and (rows,) float32 scales (`quantize_rows`), dequantized
    `ROWS_AT_ONCE` rows at a time."""
    rows, cols = raw.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, ROWS_AT_ONCE):
        stop = min(start + ROWS_AT_ONCE, rows)
        q[start:stop], scales[start:stop] = quantize_rows(float_rows(raw, start, stop))
    return q, scales


def linear_module(
    parts: list[RawTensor], biases: list[torch.Tensor | None], dtype: torch.dtype
) -> nn.Module:
    """The module for a matrix stored as `parts` (joined by rows), with their biases or Nones."""
    kinds = {family(p.type) for p in parts}
    if len(kinds) > 1:
        return StackedLinear([linear_module([p], [b], dtype) for p, b in zip(parts, biases)])
    bias = None if biases[0] is None else torch.cat(biases).to(dtype)  # (out,)
    kind = kinds.pop()
    if kind == "int4":
        groups = Int4Groups.concat([int4_groups(p.data, p.type, p.shape) for p in parts])
        return Int4Linear(groups, bias, dtype)
    if kind == "split":
        groups = Int4Groups.concat([q8_0_split_groups(p.data, p.shape) for p in parts])
        return Int4Linear(groups, bias, dtype, input_copies=2)
    if kind in KQUANT_TYPES:
        rows = [np.asarray(p.data, np.uint8).reshape(p.shape[0], -1) for p in parts]
        blocks = torch.from_numpy(np.concatenate(rows))  # a copy: the file's mapping is let go
        return KQuantLinear(blocks, kind, parts[0].shape[1], bias, dtype)
    if kind == "int8":
        rows = [int8_rows(p) for p in parts]
        q, scales = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        return Int8Linear.from_rows(q, scales, bias, dtype)
    weight = torch.cat([float_rows(p) for p in parts]).to(dtype)  # (out, in)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _parts(tensors: dict[str, RawTensor], name: str) -> list[RawTensor]:
    """The raw tensor `name`, or its joined parts name#0, name#1, ... in order."""
    if name in tensors:
        return [tensors.pop(name)]
    parts = []
    while f"{name}#{len(parts)}" in tensors:
        parts.append(tensors.pop(f"{name}#{len(parts)}"))
    return parts


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _head(raw: RawTensor, rows: FileRows, dtype: torch.dtype) -> nn.Module:
    """A quantized output head, refined by its exact rows. A Q8_0 head's fast product is int8 rows
    (a fifth fewer bytes than two int4 groups a block, and faster for many rows): the refinement
    makes its top logits exact, and the others move by less than the bfloat16 kernels' rounding
    matters (SmolLM2: the loss within 0.1% of the float head's). A Q5_K or Q6_K head held as its
    blocks computes every logit from the exact rows: it is not refined."""
    if family(raw.type) in KQUANT_TYPES:
        return linear_module([raw], [None], dtype)
    if family(raw.type) == "split":
        fast: nn.Module = Int8Linear.from_rows(*int8_rows(raw), dtype=dtype)
    else:
        fast = linear_module([raw], [None], dtype)
    return RefinedHead(fast, rows)


def split_head_for_8_bit_rows(model: GPT) -> bool:
    """For `--int8-activations`: a refined Q8_0 head's fast product (int8 rows requantized, one
    scale each) becomes the file's blocks exactly as two int4 groups each (`Int4Linear` with two
    input copies), which the 8-bit-row int4 kernel multiplies faster than the int8 kernel on AVX2
    (the default model's 16-row decode step: the head 7.9 -> 4.6 ms, `bench/step_profile.py`) and
    from the file's own scales, as llama.cpp does; a sixth more bytes than the file. Returns whether it did (not where no compiled kernel serves)."""
    head = model.lm_head
    if not (isinstance(head, RefinedHead) and head.table.kind == "Q8_0"):
        return False
    if type(head.fast) is not Int8Linear or not int4_compiled():
        return False
    groups = q8_0_split_groups(head.table.data, head.table.shape)
    head.fast = Int4Linear(groups, None, head.fast.dtype, input_copies=2)
    return True


def _token_table(
    model: GPT, raw: RawTensor, path: Path | None, dtype: torch.dtype
) -> list[nn.Module]:
    """The embedding, and the head when tied: float as read, else rows read from the file (and a
    refined head). Returns the modules whose weights are now loaded."""
    tied = model.config.tie_embeddings
    if family(raw.type) == "float":
        weight = nn.Parameter(float_rows(raw).to(dtype), requires_grad=False)
        model.transformer.wte.weight = weight
        if tied:
            model.lm_head.weight = weight
        return [model.transformer.wte]
    rows = FileRows.of(raw, path)
    model.transformer.wte = RowsEmbedding(rows, dtype)
    if not tied:
        return [model.transformer.wte]
    model.lm_head = _head(raw, rows, dtype)
    return [model.transformer.wte, model.lm_head]


@torch.no_grad()
def build_low_bit_gpt(
    gguf_model: GGUFModel, path: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> GPT:
    """An eval-mode GPT on the CPU whose matrices keep the file's bits (module docstring); `path`
    is the file's, whose quantized token table is read on use (without it, kept in memory).

    Raises ConfigError when a tensor is missing, unexpected or of the wrong shape.
    """
    path = None if path is None else Path(path)
    config = gguf_model.config
    tensors = dict(gguf_model.tensors)
    with _ParametersOnMeta():
        model = GPT(config)
    table = tensors.pop("transformer.wte.weight", None)
    if table is None:
        raise ConfigError("the file has no token_embd.weight")
    built = _token_table(model, table, path, dtype)
    linears = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not (name == "lm_head" and config.tie_embeddings)
    ]  # fmt: skip
    for name in linears:
        expected = model.get_submodule(name)
        parts = _parts(tensors, f"{name}.weight")
        if not parts:
            raise ConfigError(f"the file has no weights for {name}")
        biases = _parts(tensors, f"{name}.bias")
        if (expected.bias is not None) != bool(biases):
            raise ConfigError(f"{name}: bias presence does not match the config")
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if shape != tuple(expected.weight.shape):
            raise ConfigError(
                f"{name} has shape {shape}, the config implies {tuple(expected.weight.shape)}"
            )
        vectors = [float_rows(b) for b in biases] if biases else [None] * len(parts)
        if name == "lm_head" and family(parts[0].type) != "float":
            module = _head(parts[0], FileRows.of(parts[0], path), dtype)
        else:
            module = linear_module(parts, vectors, dtype)
        _set_module(model, name, module)
        built.append(module)
    _load_small_tensors(model, built, tensors, dtype)
    left = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise ConfigError(f"the file has no values for {', '.join(left[:3])}")
    return model.eval().requires_grad_(False)


def _load_small_tensors(
    model: GPT, built: list[nn.Module], tensors: dict[str, RawTensor], dtype: torch.dtype
) -> None:
    """Norms, position tables and the like, in `dtype`: every weight outside the `built`
    modules, each of which the file must hold."""
    held = {id(t) for module in built for t in module.state_dict(keep_vars=True).values()}
    wanted = {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) not in held}
    unexpected = sorted(set(tensors) - set(wanted))
    missing = sorted(set(wanted) - set(tensors))
    if unexpected or missing:
        raise ConfigError(
            f"tensors do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    state = {}
    for name, raw in tensors.items():
        value = float_rows(raw).to(dtype)
        if value.shape != wanted[name].shape:
            raise ConfigError(
                f"{name} has shape {tuple(value.shape)}, the config implies "
                f"{tuple(wanted[name].shape)}"
            )
        state[name] = value
    model.load_state_dict(state, strict=False, assign=True)
