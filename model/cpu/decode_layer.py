"""A GPT-2 layer whose decode step of a few float32 rows is one compiled call.

After `optimize_for_cpu` a GPT-2 layer's decode step is a few PyTorch operations and the
compiled products and attention, each reached through a few Python calls; a single-stream step
of GPT-2 124M is bound by reading its weights, and llama.cpp's is that reading and little else.
`decode_layer` (kernels/cpu/decode_layer.cpp) calls the
same kernels in the same order from C++ (ATen's LayerNorm and add, `f32_matmul` on the tiles,
`paged_decode_qkv`), so a layer's output is the Python path's to the bit; any step it does not
suit (more than `LAYER_FEW_ROWS` rows, a prefill, a cache without the one-call decode) takes the
block's own forward. A step with LoRA adapter rows passes the call its layer's updates
(`OneCallBlock.lora_updates`), as `model.cpu.llama_layer` does. `python bench/cpu_parts.py --parts layer` compares the two: on the
development box 1.02-1.04x for a single stream's step (about 0.6 ms of 16.5), even for 4.

A layer of `--quantize int8` products held in tiles (`Int8Linear` with the compiled 8-bit
product) takes its decode step in one `q8_decode_layer` call the same way (`FusedQ8DecodeBlock`),
for as many rows as the products keep the 8-bit kernel (below their `many_rows`; any number
after `model.quantize.keep_int8_kernel`), so its output is the module path's to the bit too. A
GPT-2 124M int8 single-stream step took 4.71 ms of CPU time by the module path and 4.42 ms in
one call a layer (1.07x; the products alone 3.7 ms), one thread on the development box
(docs/BENCHMARKS.md, "GPT-2 124M int8 against a native llama.cpp build").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.metadata import AttentionPlan, PagedKV
from gptserve.model.activations import KERNEL_CODES
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, FewRowsLinear
from gptserve.model.cpu.one_call_block import OneCallBlock, install_one_call_blocks
from gptserve.model.gpt import MLP, Block, Rope

__all__ = ["FusedDecodeBlock", "FusedQ8DecodeBlock", "install_decode_layers"]


class FusedDecodeBlock(OneCallBlock):
    """`block` (the same children and forward) whose cached forward of up to `LAYER_FEW_ROWS`
    decoding rows is one `decode_layer` call."""

    def __init__(self, block: Block, op: Any) -> None:
        super().__init__(block)
        attn, mlp = block.attn, block.mlp
        products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        self.op, self.n_head = op, attn.n_head
        self.eps = block.ln_1.eps
        self.activation = mlp.c_fc.activation  # the kernel's code, as FewRowsLinear holds it
        self.norms = [block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias]
        self.tiles = [p.tiles for p in products]
        self.biases = [p.bias for p in products]
        self.widths = [p.out_features for p in products]

    def forward_cached(
        self, x: torch.Tensor, cache: PagedKV, layer: int, plan: AttentionPlan, rope: Rope = None,
    ) -> torch.Tensor:  # fmt: skip
        if (
            x.shape[0] <= LAYER_FEW_ROWS
            and rope is None
            and cache.has_one_call_step(plan)
            and (updates := self.lora_updates(layer)) is not None
        ):
            step = cache.one_call_step(layer, plan)
            return self.op(x, self.norms, self.tiles, self.biases, self.widths, *step,
                           self.n_head, self.eps, self.activation,
                           cache.window(layer) or 0, *updates)  # fmt: skip
        return super().forward_cached(x, cache, layer, plan, rope)


class FusedQ8DecodeBlock(OneCallBlock):
    """`block` (the same children and forward) whose cached forward of decoding rows is one
    `q8_decode_layer` call while its int8 products keep the 8-bit kernel for that many rows."""

    def __init__(self, block: Block, op: Any) -> None:
        super().__init__(block)
        attn, mlp = block.attn, block.mlp
        self.products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        self.op, self.n_head = op, attn.n_head
        self.eps = block.ln_1.eps
        self.activation = KERNEL_CODES[mlp.c_fc.activation]
        self.norms = [block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias]
        self.codes = [p.codes for p in self.products]  # (tiles, in / 4, 32, 4) int8 each
        self.scales = [p.scales for p in self.products]  # (out,) float32 each
        self.biases = [p.bias for p in self.products]
        self.widths = [p.out_features for p in self.products]

    def forward_cached(
        self, x: torch.Tensor, cache: PagedKV, layer: int, plan: AttentionPlan, rope: Rope = None,
    ) -> torch.Tensor:  # fmt: skip
        rows = x.shape[0]
        if (
            rope is None
            and all(p.many_rows is None or rows < p.many_rows for p in self.products)
            and cache.has_one_call_step(plan)
            and (updates := self.lora_updates(layer)) is not None
        ):
            step = cache.one_call_step(layer, plan)
            return self.op(x, self.norms, self.codes, self.scales, self.biases, self.widths,
                           *step, self.n_head, self.eps, self.activation,
                           cache.window(layer) or 0, *updates)  # fmt: skip
        return super().forward_cached(x, cache, layer, plan, rope)


def gpt2_layer_shape(block: nn.Module) -> bool:
    """Whether `block` is a pre-norm GPT-2 layer: float32 LayerNorms with biases and one eps,
    no q/k norms, as many key/value heads as heads, and a feed-forward block whose first product
    applies the activation itself (`FusedMLP`, not a plain `MLP`)."""
    if type(block) is not Block or not block.pre_norm:
        return False
    norms = (block.ln_1, block.ln_2)
    if not all(type(n) is nn.LayerNorm and n.weight.dtype == torch.float32 for n in norms):
        return False
    if any(n.bias is None or n.eps != block.ln_1.eps for n in norms):
        return False
    attn, mlp = block.attn, block.mlp
    gated = getattr(mlp, "gated", False)
    return not (attn.qk_norm or attn.n_kv_head != attn.n_head or isinstance(mlp, MLP) or gated)


def fits(block: nn.Module) -> bool:
    """Whether `block` is a float32 pre-norm GPT-2 layer whose four products read tiles."""
    if not gpt2_layer_shape(block):
        return False
    attn, mlp = block.attn, block.mlp
    products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
    return all(type(p) is FewRowsLinear for p in products)


def fits_q8(block: nn.Module) -> bool:
    """Whether `block` is a pre-norm GPT-2 layer whose four products are float32 `Int8Linear`s
    held in tiles for the compiled 8-bit product, c_fc's applying GELU (tanh) or ReLU."""
    from gptserve.model.quantize import Int8Linear  # here: model.quantize imports model.cpu

    if not gpt2_layer_shape(block):
        return False
    attn, mlp = block.attn, block.mlp
    products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
    for p in products:
        if type(p) is not Int8Linear or p.q8 is None or p.dtype != torch.float32:
            return False
        if p.out_dtype not in (None, torch.float32):
            return False
        if p.bias is not None and p.bias.dtype != torch.float32:
            return False  # the module adds such a bias itself, after the product
    if any(p.activation != "none" for p in (attn.c_attn, attn.c_proj, mlp.c_proj)):
        return False
    return KERNEL_CODES.get(mlp.c_fc.activation, 0) in (1, 2)


def install_decode_layers(model: nn.Module, ops: Any) -> int:
    """Make each layer of `model` that `fits` a `FusedDecodeBlock` over `ops` (the compiled
    kernels), and each that `fits_q8` a `FusedQ8DecodeBlock`, in place; returns how many."""
    changed = install_one_call_blocks(
        model, fits, lambda block: FusedDecodeBlock(block, ops.decode_layer)
    )
    q8_op = getattr(ops, "q8_decode_layer", None)  # absent from a build older than the op
    if q8_op is not None:
        changed += install_one_call_blocks(
            model, fits_q8, lambda block: FusedQ8DecodeBlock(block, q8_op)
        )
    return changed
