"""A LoRA adapter as gptserve holds it: low-rank updates keyed by our linear layers' names.

A Hugging Face model's separate q/k/v (or gate/up) projections are slices of one of our fused
layers (`c_attn`, `c_fc`), so an update names the layer and the first output row of its slice:
y[..., offset : offset + rows] += scaling * (x @ a.T) @ b.T.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoraPiece:
    """One low-rank update of a slice of a linear layer's output rows."""

    a: torch.Tensor  # (rank, in_features)
    b: torch.Tensor  # (rows, rank)
    offset: int = 0  # the slice's first output row in our (fused) layer

    @property
    def rows(self) -> int:
        return self.b.shape[0]


@dataclass
class LoraAdapter:
    """A named adapter: its rank, alpha and scaling, and its updates by our layer names
    (for example "transformer.h.0.attn.c_attn" -> [q's piece, v's piece])."""

    name: str
    rank: int
    alpha: float
    scaling: float  # alpha / rank, or alpha / sqrt(rank) with rsLoRA
    pieces: dict[str, list[LoraPiece]] = field(default_factory=dict)
    base: str | None = None  # the base model the adapter was trained on, as its config says

    @property
    def max_rank(self) -> int:
        """The largest rank of any of its pieces (a `rank_pattern` may raise one above `rank`)."""
        return max([self.rank, *(p.a.shape[0] for ps in self.pieces.values() for p in ps)])
