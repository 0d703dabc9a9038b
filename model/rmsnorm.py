"""RMSNorm, the normalization of Llama-family blocks."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the root mean square taken in float32 (as Llama and Qwen compute it)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
