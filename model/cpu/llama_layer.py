"""A Llama-family layer whose decode step is one compiled call.

After `optimize_for_cpu` (`model.cpu.fused_rows`) a Llama layer's decode step is ten compiled
operations (two RMSNorms, four products, the rotation with the attention, SwiGLU, two adds), but
each is reached through a module's Python and the operations' own wrappers: about 40 PyTorch
operations and a few hundred microseconds of Python a layer, which on a 135M-parameter model of
30 layers cost as much as the products. `llama_decode_layer` (kernels/cpu/llama_layer.cpp) calls
the same kernels in the same order and dtypes from C++, so the layer's output is the Python
path's to the bit. It takes layers whose products are the compiled int4 kernel's (a GGUF file's
Q4_0, Q4_1, Q4_K and Q8_0 matrices) or float32 tiles (`FewRowsLinear`, up to its few rows); any
other layer (int8, a mixed `StackedLinear`, Qwen3's q/k norms) and any step it does not suit (a
prefill, a cache without the one-call decode) takes the block's own forward. A step with LoRA
adapter rows (`model.lora.batched`) passes the call its layer's updates, which it adds to each
product's output as the products' wrappers do; where it cannot (an adapter's rows not one run,
adapters not float32) the step takes the block's forward, whose products apply them.
Gemma 3's layers take a call of their own over the same products (`model.cpu.gemma_layer`).
`python bench/cpu_parts.py --parts llama-layer` compares the two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.metadata import AttentionPlan, PagedKV
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, FewRowsLinear
from gptserve.model.cpu.fused_rows import FusedRMSNorm, FusedSwiGLU
from gptserve.model.cpu.one_call_block import OneCallBlock, install_one_call_blocks
from gptserve.model.gpt import Block, Rope
from gptserve.model.int4_linear import Int4Linear

__all__ = ["FusedLlamaBlock", "install_llama_layers"]

INT4, FLOAT_TILES, INT4_ROWS8 = 0, 1, 2  # the kernel's product kinds (llama_layer.cpp's `Kind`)
ANY_ROWS = 1 << 30  # int4 products take any number of rows


def product_kind(product: nn.Module) -> int | None:
    """The kernel's kind for a product module it can call, else None."""
    if type(product) is Int4Linear:
        float_out = (product.out_dtype or product.dtype) == torch.float32
        if product.compiled and product.op_dtype == torch.float32 and float_out:
            return INT4_ROWS8 if product.int8_activations else INT4
        return None
    if type(product) is FewRowsLinear and product.activation == 0:
        return FLOAT_TILES
    return None


def product_args(product: nn.Module) -> tuple[torch.Tensor, torch.Tensor, Any, int, int]:
    """weight, table, bias, outputs and input copies as the kernel takes them."""
    if type(product) is Int4Linear:
        return (
            product.weight, product.scales_and_zeros, product.bias, product.out_features,
            product.input_copies,
        )  # fmt: skip
    return product.tiles, product.tiles, product.bias, product.out_features, 1


def fits(block: nn.Module) -> bool:
    """Whether `block` is a pre-norm Llama layer (float32 RMSNorms and SwiGLU fused by
    `model.cpu.fused_rows`, no q/k norms) whose four products the kernel can call."""
    if type(block) is not Block or not block.pre_norm or block.attn.qk_norm:
        return False
    norms = (block.ln_1, block.ln_2)
    if not all(type(n) is FusedRMSNorm for n in norms):
        return False
    if any(n.out_dtype not in (None, torch.float32) or n.eps != block.ln_1.eps for n in norms):
        return False
    mlp = block.mlp
    if type(mlp) is not FusedSwiGLU or mlp.mid_dtype != torch.float32:
        return False
    products = (block.attn.c_attn, block.attn.c_proj, mlp.c_fc, mlp.c_proj)
    return all(product_kind(p) is not None for p in products)


class FusedLlamaBlock(OneCallBlock):
    """`block` (the same children and forward) whose cached forward of decoding rows is one
    `llama_decode_layer` call where the step suits it."""

    def __init__(self, block: Block, op: Any) -> None:
        super().__init__(block)
        attn, mlp = block.attn, block.mlp
        products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        self.op, self.n_head, self.eps = op, attn.n_head, block.ln_1.eps
        self.norms = [block.ln_1.weight, block.ln_2.weight]
        self.kinds = [product_kind(p) for p in products]
        args = [product_args(p) for p in products]
        self.weights, self.tables, self.biases, self.widths, self.copies = (
            list(column) for column in zip(*args)
        )
        self.max_rows = LAYER_FEW_ROWS if FLOAT_TILES in self.kinds else ANY_ROWS

    def forward_cached(
        self, x: torch.Tensor, cache: PagedKV, layer: int, plan: AttentionPlan, rope: Rope = None,
    ) -> torch.Tensor:  # fmt: skip
        n = x.shape[0]
        if (
            n <= self.max_rows
            and rope is not None
            and x.dtype == torch.float32
            and rope[0].dtype == torch.float32
            and cache.has_one_call_step(plan)
            and cache.has_qkv_path(plan, torch.float32, torch.float32)
            and (updates := self.lora_updates(layer)) is not None
        ):
            step = cache.one_call_step(layer, plan)
            cos, sin = rope[0].view(n, -1), rope[1].view(n, -1)  # (N, R) each (R: rope_dim)
            return self.op(x, self.norms, self.eps, self.kinds, self.weights, self.tables,
                           self.biases, self.widths, self.copies, cos, sin, *step,
                           self.n_head, cache.window(layer) or 0, *updates)  # fmt: skip
        return super().forward_cached(x, cache, layer, plan, rope)


def install_llama_layers(model: nn.Module, ops: Any) -> int:
    """Make each layer of `model` that `fits` a `FusedLlamaBlock` over `ops` (the compiled
    kernels), in place; returns how many."""
    return install_one_call_blocks(
        model, fits, lambda block: FusedLlamaBlock(block, ops.llama_decode_layer)
    )
