"""The CPU wing: inference-only layouts for a loaded model's matrices, applied from outside.

`optimize_for_cpu(model)` swaps modules of a loaded `GPT`, as a quantizer is applied at load:
every `nn.Linear` of the layers gets oneDNN's weight layout where this CPU and build have it
(per-thread slabs otherwise), each feed-forward block becomes a `FusedMLP` whose first product
applies GELU/ReLU itself, and the output head gets oneDNN's layout too (slabs where oneDNN does
not run: a tied embedding then reads its rows from them, so the table is stored once). Where the
compiled CPU kernels are built, float32 products of a few rows (a decode step of a few
sequences) read a second copy of each matrix laid out in tiles instead (`model.cpu.few_rows_linear`),
faster while the weights' reading bounds the product; a sequence's logits then agree alone and
in a batch to rounding, and to the bit with `batch_invariant` (oneDNN's products alone compute a
row alike whatever the row count: docs/RELIABILITY.md, "Batch invariance"). Layers already quantized
(`model.quantize`'s int8, a GGUF file's own bits: `model.gguf.quantized`) are left as they are:
only `nn.Linear` modules are swapped, except that an int8 feed-forward block whose first product
is compiled (`Int8Linear` in tiles) has that product apply the activation too. A gated (SwiGLU)
feed-forward block keeps its own forward, unless the compiled CPU kernels are built
(`kernels.cpu.native`): then a float32 Llama-family layer's norms and SwiGLU are one call each,
written in the next product's dtype (`model.cpu.fused_rows`), a Llama-family layer whose products
are compiled takes its decode step in one call (`model.cpu.llama_layer`), as does a Gemma 3
layer of float32 norms, its (1 + w) norms, q/k norms and GeGLU included (`model.cpu.gemma_layer`),
and a float32 GPT-2 layer whose products read tiles takes a decode step of a few rows in one call
(`model.cpu.decode_layer`).
`python bench/cpu_parts.py` measures each part against what it replaces.

The model computes the same function afterwards, but its parameters are no longer trainable
tensors: it cannot be trained, and `save_checkpoint` refuses it. `GPT` itself knows nothing of
this module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from gptserve.kernels.cpu.native import native_ops
from gptserve.model.cpu.decode_layer import install_decode_layers
from gptserve.model.cpu.few_rows_linear import LAYER_FEW_ROWS, FewRowsLinear, compiled_tiles
from gptserve.model.cpu.fused_rows import FusedRMSNorm, install_fused_rows
from gptserve.model.cpu.gemma_layer import install_gemma_layers
from gptserve.model.cpu.llama_layer import install_llama_layers
from gptserve.model.cpu.onednn_linear import OneDnnLinear
from gptserve.model.cpu.packed_linear import (
    PackedEmbedding,
    PackedLinear,
    pack_head,
    pack_linear,
    pack_linears,
    with_few_rows,
)
from gptserve.model.gpt import GPT, MLP


class FusedMLP(nn.Module):
    """`MLP` for CPU inference: c_fc's product applies the activation (no dropout)."""

    def __init__(self, mlp: MLP, threads: int, tiles_ops: Any | None = None) -> None:
        super().__init__()
        activation = "relu" if mlp.relu else "gelu_tanh"
        if not isinstance(mlp.c_fc, nn.Linear):  # an Int8Linear: its compiled product applies it
            mlp.c_fc.activation = activation
            self.c_fc, self.c_proj = mlp.c_fc, mlp.c_proj
            return
        many = OneDnnLinear(mlp.c_fc, activation=activation)
        self.c_fc = with_few_rows(mlp.c_fc, many, tiles_ops, LAYER_FEW_ROWS, activation)
        self.c_proj = pack_linear(mlp.c_proj, threads, tiles_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules  # dict reads and `forward`: see model.gpt._submodules
        return modules["c_proj"].forward(modules["c_fc"].forward(x))


WING_MODULES = (OneDnnLinear, PackedLinear, PackedEmbedding, FusedRMSNorm, FewRowsLinear, FusedMLP)


def is_optimized_for_cpu(model: nn.Module) -> bool:
    """Whether `optimize_for_cpu` has swapped any of this model's modules."""
    return any(isinstance(m, WING_MODULES) for m in model.modules())


@torch.no_grad()
def optimize_for_cpu(model: GPT, threads: int | None = None, batch_invariant: bool = False) -> GPT:
    """Swap the model's linear layers for CPU inference layouts, in place; returns the model.

    A model on another device, or one already swapped, is returned unchanged. The model is put in
    eval mode and can no longer be trained or saved. `batch_invariant`: no layer computes a row
    by another kernel for few rows than for many (no `FewRowsLinear`).
    """
    if next(model.parameters()).device.type != "cpu" or is_optimized_for_cpu(model):
        return model
    from gptserve.model.quantize import Int8Linear  # here: model.quantize imports this package

    model.eval().requires_grad_(False)
    threads = threads or torch.get_num_threads()
    ops = native_ops()
    tiles_ops = ops if compiled_tiles(ops) and not batch_invariant else None
    if isinstance(model.lm_head, nn.Linear):  # not when quantized (model.quantize)
        tied = model.lm_head.weight is getattr(model.transformer.wte, "weight", None)
        model.lm_head, slabs = pack_head(model.lm_head, threads, tiles_ops)
        if tied and slabs is not None:  # else the embedding keeps its table
            model.transformer.wte = PackedEmbedding(slabs)
    for block in model.transformer.h:
        c_fc = block.mlp.c_fc
        gated = getattr(block.mlp, "gated", False)  # SwiGLU: no fused activation for it
        if gated:
            continue
        if isinstance(c_fc, nn.Linear) and OneDnnLinear.supports(c_fc.weight.dtype):
            block.mlp = FusedMLP(block.mlp, threads, tiles_ops)
        elif isinstance(c_fc, Int8Linear) and c_fc.q8 is not None:
            block.mlp = FusedMLP(block.mlp, threads)
    pack_linears(model, threads, tiles_ops)
    if ops is not None:
        install_fused_rows(model, ops)
        install_llama_layers(model, ops)
        install_gemma_layers(model, ops)
    if tiles_ops is not None:
        install_decode_layers(model, tiles_ops)
    return model
