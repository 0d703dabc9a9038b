"""Rotary position embeddings in Hugging Face's half-rotation layout.

A head's channels are two halves (x1, x2); position p turns each pair (x1[i], x2[i]) by the angle
p * inv_freq[i]: x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1). That is the layout
of Llama, Mistral and Qwen checkpoints as transformers stores them (GGUF files store Q and K rows
interleaved instead; their loader undoes that permutation).

A partial rotation (Phi-4-mini's partial_rotary_factor, `ModelConfig.rotary_dim`) turns only a
head's leading R channels, as transformers does: the frequencies are `rotary_inv_freq(R, ...)`,
cos and sin are R wide, the halves are those of the R channels, and the channels after them pass
through as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rotary_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequencies (head_dim: the channels that rotate), with Llama 3's long-context rescaling when
    `scaling` is {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}, or every frequency divided by `factor` when it is
    {"rope_type": "linear", "factor"} (Gemma 3's global layers), or each divided by its
    `short_factor` when it is {"rope_type": "longrope", "short_factor", "attention_factor"}
    (Phi-3's long-context models within their original context, where transformers uses those)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "longrope":
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta**exponents)
    inv = 1.0 / theta**exponents
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    smooth = ((old_len / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_len / low, inv / factor, inv)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, blended, out)


def rotary_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: longrope's `attention_factor`, else 1."""
    if scaling and scaling.get("rope_type") == "longrope":
        return float(scaling["attention_factor"])
    return 1.0


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) positions -> cos and signed sin, each (N, 1, R) for `inv_freq`'s R / 2 frequencies
    (R: head_dim, or a partial rotation's rotary_dim), computed in float32 (times
    `factor`, `rotary_attention_factor`'s) and cast to dtype: sin's first half is negated, so that
    `apply_rotary` needs no negation per call."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (N, hd/2)
    emb = torch.cat([angles, angles], dim=-1)  # (N, hd)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    sin[:, : angles.shape[1]].neg_()
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., N, H, hd) by `rotary_cos_sin`'s cos/sin (N, 1, R) of each token's position:
    all of each head when R is hd, else its first R channels (the rest as they are).

    x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1) is, with the halves swapped
    by a roll and the sign folded into sin, x * cos + (x2, x1) * (-sin1, sin2): four operations
    (not `addcmul`, whose fused rounding moves a GGUF model at its bits off its float twin).
    """
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + x.roll(width // 2, dims=-1) * sin
    turned = x[..., :width]
    turned = turned * cos + turned.roll(width // 2, dims=-1) * sin
    return torch.cat([turned, x[..., width:]], dim=-1)
