"""A Gemma 3 layer whose decode step is one compiled call.

A Gemma 3 layer (`model.gpt.SandwichBlock`) runs six (1 + w) RMSNorms (one before and one after
each branch, one on each head's query and key), GeGLU and the four products: through the modules
that is about 70 PyTorch operations and their Python a decode step, more than the products cost
on a model of SmolLM2-135M's shape. `gemma_decode_layer` (kernels/cpu/llama_layer.cpp) runs the
layer as `model.cpu.llama_layer`'s call runs a Llama one: the same products (a GGUF file's int4
matrices or float32 tiles), the compiled RMSNorm with each norm's 1 + w as its weight (to the bit
the arithmetic of `GemmaRMSNorm`), ATen's own GELU and product for GeGLU, the rotation, cache
writes and windowed attention of `paged_decode_qkv`, so that a step's output is the modules'
path's to the bit. Any step it does not suit (a prefill, more rows than float32 tiles take, a
bfloat16 model, LoRA updates it cannot take) runs the block's own forward.
`python bench/gemma_layer.py` measures it against the modules' path and against a Llama layer of
the same shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.metadata import AttentionPlan, PagedKV
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS
from gptserve.model.cpu.llama_layer import ANY_ROWS, FLOAT_TILES, product_args, product_kind
from gptserve.model.cpu.one_call_block import OneCallBlock, install_one_call_blocks
from gptserve.model.gpt import MLP, Rope, SandwichBlock
from gptserve.model.rmsnorm import GemmaRMSNorm

__all__ = ["FusedGemmaBlock", "install_gemma_layers"]


def _norms(block: SandwichBlock) -> list[nn.Module]:
    """The layer's norms in the order the kernel takes their weights."""
    attn = block.attn
    return [block.ln_1, attn.q_norm, attn.k_norm, block.post_attn_norm, block.ln_2,
            block.post_mlp_norm]  # fmt: skip


def fits(block: nn.Module) -> bool:
    """Whether `block` is a float32 Gemma 3 layer (sandwich and q/k norms, GeGLU) whose four
    products the kernel can call."""
    if type(block) is not SandwichBlock or not block.pre_norm or not block.attn.qk_norm:
        return False
    norms = _norms(block)
    if not all(type(n) is GemmaRMSNorm and n.weight.dtype == torch.float32 for n in norms):
        return False
    if any(n.eps != block.ln_1.eps for n in norms):
        return False
    if any(n.scale != 1.0 for n in norms if n is not block.attn.q_norm):
        return False  # only the query norm carries a scale (query_pre_attn_scalar's)
    mlp = block.mlp
    if type(mlp) is not MLP or not (mlp.gated and mlp.gelu_gate):
        return False
    products = (block.attn.c_attn, block.attn.c_proj, mlp.c_fc, mlp.c_proj)
    return all(product_kind(p) is not None for p in products)


class FusedGemmaBlock(OneCallBlock, SandwichBlock):
    """`block` (the same children and forward) whose cached forward of decoding rows is one
    `gemma_decode_layer` call where the step suits it."""

    def __init__(self, block: SandwichBlock, op: Any) -> None:
        super().__init__(block)
        attn, mlp = block.attn, block.mlp
        products = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        self.op, self.n_head, self.eps = op, attn.n_head, block.ln_1.eps
        self.q_scale = attn.q_norm.scale
        # 1 + w, as each GemmaRMSNorm computes it in float32 before multiplying by it
        self.norms = [(1.0 + n.weight.detach().float()).contiguous() for n in _norms(block)]
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
            return self.op(x, self.norms, self.eps, self.q_scale, self.kinds, self.weights,
                           self.tables, self.biases, self.widths, self.copies, cos, sin, *step,
                           self.n_head, cache.window(layer) or 0, *updates)  # fmt: skip
        return super().forward_cached(x, cache, layer, plan, rope)


def install_gemma_layers(model: nn.Module, ops: Any) -> int:
    """Make each layer of `model` that `fits` a `FusedGemmaBlock` over `ops` (the compiled
    kernels), in place; returns how many."""
    return install_one_call_blocks(
        model, fits, lambda block: FusedGemmaBlock(block, ops.gemma_decode_layer)
    )
