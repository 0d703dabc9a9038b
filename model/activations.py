"""The activations a product may apply to its outputs, by name, and their codes in the compiled
CPU kernels (`kernels/cpu/vec_math.h`'s `Activation`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNEL_CODES = {"none": 0, "gelu_tanh": 1, "relu": 2}


def activate(y: torch.Tensor, name: str) -> torch.Tensor:
    """`y` through the activation `name` (a key of KERNEL_CODES), by PyTorch."""
    if name == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if name == "relu":
        return F.relu(y)
    if name == "none":
        return y
    raise ValueError(f"activation must be one of {sorted(KERNEL_CODES)}, got {name!r}")
