"""LoRA training: trainable low-rank pairs put into a frozen model, and taken back out.

`inject_lora` wraps each adapted linear layer in a `LoraLinear` (the frozen layer, plus A and B of
each slice it adapts: A random as PEFT starts it, kaiming-uniform, B zero, so training starts
from the base model's outputs). `adapter_of` reads the trained pairs out as a `LoraAdapter`,
`lora_state` / `load_lora_state` are what train_state.pt keeps of them, and `merge_lora` folds
them into the weights and unwraps the layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.model import GPT, ModelConfig
from gptserve.model.lora.adapter import LoraAdapter, LoraPiece
from gptserve.model.lora.merge import merge_into
from gptserve.model.lora.modules import (
    TARGETS,
    Slice,
    adapter_slices,
    available_targets,
    is_llama_family,
)
from gptserve.training.errors import TrainError

# what --lora-targets means when not given: PEFT's defaults (q and v of the Llama family, all of
# GPT-2's fused c_attn)
DEFAULT_TARGETS = {"llama": ("q", "v"), "gpt2": ("q", "k", "v")}


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus scaling * B @ A on each of its output slices:
    y[..., s] = base(x)[..., s] + scaling * dropout(x) @ A.T @ B.T."""

    def __init__(
        self, base: nn.Linear, slices: list[Slice], rank: int, scaling: float, dropout: float
    ) -> None:
        super().__init__()
        self.base = base
        self.scaling = scaling
        self.offsets = [s.offset for s in slices]
        self.lora_A = nn.ParameterList(
            nn.Parameter(torch.empty(rank, base.in_features)) for _ in slices
        )  # each (rank, in)
        self.lora_B = nn.ParameterList(nn.Parameter(torch.zeros(s.rows, rank)) for s in slices)
        for a in self.lora_A:  # PEFT's (and nn.Linear's) initialization
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # the output as consecutive (start, width, slice index or None for rows not adapted)
        self.segments: list[tuple[int, int, int | None]] = []
        at = 0
        for i, s in enumerate(slices):
            if s.offset > at:
                self.segments.append((at, s.offset - at, None))
            self.segments.append((s.offset, s.rows, i))
            at = s.offset + s.rows
        if at < base.out_features:
            self.segments.append((at, base.out_features - at, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (..., out)
        h = self.dropout(x)  # (..., in)
        parts = []
        for start, width, i in self.segments:
            part = y[..., start : start + width]
            if i is not None:  # (..., width) += scaling * (h @ A.T) @ B.T
                part = part + self.scaling * F.linear(F.linear(h, self.lora_A[i]), self.lora_B[i])
            parts.append(part)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def resolve_targets(targets: tuple[str, ...] | None, config: ModelConfig) -> tuple[str, ...]:
    """--lora-targets for this model: the default for its family when not given, every
    projection it has for "all"; TrainError for one it lacks."""
    if targets is None:
        return DEFAULT_TARGETS["llama" if is_llama_family(config) else "gpt2"]
    if targets == ("all",):
        return available_targets(config)
    lacking = [t for t in targets if t not in available_targets(config)]
    if lacking:
        family = "a Llama-family" if is_llama_family(config) else "a GPT-2-shaped"
        raise TrainError(
            f"--lora-targets {','.join(lacking)}: {family} model has no such projection "
            f"(it has {','.join(available_targets(config))})"
        )
    return tuple(t for t in TARGETS if t in targets)


def inject_lora(
    model: GPT, targets: tuple[str, ...], rank: int, alpha: float, dropout: float
) -> None:
    """Freeze every weight of `model` and wrap the layers of `targets` in LoraLinear, in place;
    A is drawn from torch's global RNG (seed it first for the same start everywhere)."""
    model.requires_grad_(False)
    for name, slices in adapter_slices(model.config, targets).items():
        parent, child = name.rsplit(".", 1)
        owner = model.get_submodule(parent)
        layer = LoraLinear(getattr(owner, child), slices, rank, alpha / rank, dropout)
        setattr(owner, child, layer)


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def adapter_of(model: GPT, name: str, rank: int, alpha: float, base: str | None) -> LoraAdapter:
    """The trained pairs of `model` as an adapter (float32 copies on the CPU)."""
    pieces = {
        layer_name: [
            LoraPiece(
                a=a.detach().float().cpu().clone(), b=b.detach().float().cpu().clone(), offset=off
            )
            for a, b, off in zip(layer.lora_A, layer.lora_B, layer.offsets)
        ]
        for layer_name, layer in lora_layers(model).items()
    }
    return LoraAdapter(name, rank, alpha, alpha / rank, pieces, base)


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors by parameter name (what train_state.pt keeps of a LoRA run)."""
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def load_lora_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put saved LoRA tensors back; TrainError when they are not this model's pairs."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state) or any(params[n].shape != t.shape for n, t in state.items()):
        raise TrainError("--resume: the saved LoRA weights do not fit this base and --lora-targets")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)


def merge_lora(model: GPT, adapter: LoraAdapter) -> None:
    """Unwrap every LoraLinear back to its base layer and add `adapter` into the weights."""
    for name in lora_layers(model):
        parent, child = name.rsplit(".", 1)
        owner = model.get_submodule(parent)
        setattr(owner, child, getattr(owner, child).base)
    model.requires_grad_(False)
    merge_into(model, adapter)
