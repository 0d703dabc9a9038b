"""RMSNorm and SwiGLU in one compiled call each, their outputs in the next product's dtype.

Between a Llama-family layer's products, PyTorch spends about nine operations on a RMSNorm, four
on silu(gate) * up and a cast before each bfloat16 product (the int4 and int8 kernels take
bfloat16 rows); on a model of 135M parameters and 30 layers those small operations cost more than
the arithmetic. `install_fused_rows(model)` swaps each float32 layer's two norms and gated
feed-forward block for `kernels.cpu.native`'s `rms_norm` and `silu_mul`, which compute in float32
as before (the norm as PyTorch's to the bit: its sum of squares is ATen's own reduction) and
write bfloat16 where a bfloat16 product reads the result. The products that end a
branch (attention's and the feed-forward block's c_proj) then hand back their bfloat16 output,
which the residual add takes exactly (float32 + bfloat16 adds in float32).

Left alone: bfloat16 and float16 models (their norm multiplies by the weight after the cast),
the final norm (the GGUF head refines logits from its float32 output) and Qwen3's per-head q/k
norms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from gptserve.model.gpt import GPT, MLP
from gptserve.model.rmsnorm import RMSNorm


def _input_dtype(product: nn.Module) -> torch.dtype | None:
    """The dtype a product computes in when it is not its input's (int4 and int8 layers)."""
    return getattr(product, "op_dtype", None)


class FusedRMSNorm(nn.Module):
    """`RMSNorm` of float32 rows as one call, written in `out_dtype` (None: the input's)."""

    def __init__(self, norm: RMSNorm, ops: Any, out_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight, self.eps, self.out_dtype = norm.weight, norm.eps, out_dtype
        self.op = ops.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, C)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        weight = self._parameters["weight"]  # a dict read, not Module.__getattr__
        y = self.op(rows, weight, self.eps, self.out_dtype or x.dtype)  # (M, C)
        return y if x.dim() == 2 else y.view(x.shape)


class FusedSwiGLU(nn.Module):
    """`MLP` with gate: c_fc, silu(gate) * up as one call in c_proj's input dtype, c_proj."""

    def __init__(self, mlp: MLP, ops: Any) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.op = mlp.c_fc, mlp.c_proj, ops.silu_mul
        self.mid_dtype = _input_dtype(mlp.c_proj) or torch.float32  # a float c_proj: float32
        if _input_dtype(self.c_fc) is not None and self.c_fc.bias is None:
            self.c_fc.out_dtype = _input_dtype(self.c_fc)  # silu_mul reads bfloat16 as well

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules  # dict reads and `forward`: see model.gpt._submodules
        h = modules["c_fc"].forward(x)  # (..., 2W): gate, then up
        rows = h if h.dim() == 2 else h.reshape(-1, h.shape[-1])
        y = self.op(rows, self.mid_dtype)  # (M, W)
        out = modules["c_proj"].forward(y)  # (M, C) in the product's dtype (the residual promotes)
        return out if h.dim() == 2 else out.view(*h.shape[:-1], out.shape[-1])


def install_fused_rows(model: GPT, ops: Any) -> int:
    """Swap each float32 RMSNorm layer's norms and gated feed-forward block for the compiled
    row operations `ops` (`kernels.cpu.native.native_ops()`), in place; returns the layers
    changed."""
    changed = 0
    for block in model.transformer.h:
        norms = (block.ln_1, block.ln_2)
        if not all(type(n) is RMSNorm and n.weight.dtype == torch.float32 for n in norms):
            continue
        mlp = block.mlp
        if not (isinstance(mlp, MLP) and mlp.gated and not mlp.gelu_gate and block.pre_norm):
            continue
        c_attn = block.attn.c_attn
        block.ln_1 = FusedRMSNorm(block.ln_1, ops, _input_dtype(c_attn))
        if _input_dtype(c_attn) is not None:  # q, k, v in float32, as without the swap
            c_attn.out_dtype = torch.float32
        block.ln_2 = FusedRMSNorm(block.ln_2, ops, _input_dtype(block.mlp.c_fc))
        block.mlp = FusedSwiGLU(block.mlp, ops)
        for c_proj in (block.attn.c_proj, block.mlp.c_proj):
            if _input_dtype(c_proj) is not None and c_proj.bias is None:
                c_proj.out_dtype = _input_dtype(c_proj)  # the residual add takes it as it is
        changed += 1
    return changed
