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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.metadata import AttentionPlan, PagedKV
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, FewRowsLinear
from gptserve.model.cpu.one_call_block import OneCallBlock, install_one_call_blocks
from gptserve.model.gpt import MLP, Block, Rope

__all__ = ["FusedDecodeBlock", "install_decode_layers"]


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


def fits(block: nn.Module) -> bool:
    """Whether `block` is a float32 pre-norm GPT-2 layer whose four products read tiles."""
    if type(block) is not Block or not block.pre_norm:
        return False
    norms = (block.ln_1, block.ln_2)
    if not all(type(n) is nn.LayerNorm and n.weight.dtype == torch.float32 for n in norms):
        return False
    if any(n.bias is None or n.eps != block.ln_1.eps for n in norms):
        return False
    attn, mlp = block.attn, block.mlp
    if attn.qk_norm or attn.n_kv_head != attn.n_head or isinstance(mlp, MLP):
        return False  # a plain MLP applies its activation itself: c_fc's product must (FusedMLP)
    products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
    return all(type(p) is FewRowsLinear for p in products)


def install_decode_layers(model: nn.Module, ops: Any) -> int:
    """Make each layer of `model` that `fits` a `FusedDecodeBlock` over `ops` (the compiled
    kernels), in place; returns how many."""
    return install_one_call_blocks(
        model, fits, lambda block: FusedDecodeBlock(block, ops.decode_layer)
    )
