"""An adapter's updates added into the model's own weights: W[rows] += scaling * B @ A."""

from __future__ import annotations

import torch
import torch.nn as nn
from gptserve.model.lora.adapter import LoraAdapter


def merge_into(model: nn.Module, adapter: LoraAdapter, sign: float = 1.0) -> None:
    """Add (sign=-1: take away) each piece's scaling * b @ a into the rows of its layer's weight,
    computed in float32 and rounded once to the weight's dtype. The layers must be plain
    nn.Linear (not yet optimized for CPU inference or quantized)."""
    for name, pieces in adapter.pieces.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"adapter {adapter.name!r}: the model has no layer {name}") from None
        if type(layer) is not nn.Linear:
            raise ValueError(
                f"adapter {adapter.name!r}: {name} is a {type(layer).__name__}, not a plain "
                "Linear; merge before optimizing or quantizing the model"
            )
        weight = layer.weight  # (out, in)
        with torch.no_grad():
            for p in pieces:
                if (
                    p.offset < 0
                    or p.offset + p.rows > weight.shape[0]
                    or p.a.shape[1] != weight.shape[1]
                ):
                    raise ValueError(
                        f"adapter {adapter.name!r}: a piece of {name} ({p.rows} x "
                        f"{p.a.shape[1]} from row {p.offset}) does not fit its weight "
                        f"{tuple(weight.shape)}"
                    )
                rows = weight[p.offset : p.offset + p.rows]  # (rows, in), a view
                delta = p.b.float().to(weight.device) @ p.a.float().to(weight.device)
                rows.copy_((rows.float() + sign * adapter.scaling * delta).to(weight.dtype))
