"""RMSNorm, the normalization of Llama-family blocks, and Gemma's (1 + weight) variant."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the root mean square taken in float32 (as Llama and Qwen compute it)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # PyTorch's rms_norm: the same operations to the bit, with less Python between them
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32 and cast back, as transformers
    computes it; the weight starts at zero. `scale` multiplies the result too, in float32: a
    query norm carries attention's query_pre_attn_scalar that way (model.config.query_scale)."""

    def __init__(self, dim: int, eps: float = 1e-6, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.scale = eps, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h * (1.0 + self.weight.float())
        if self.scale != 1.0:
            h = h * self.scale
        return h.type_as(x)
