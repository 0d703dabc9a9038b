"""Embeddings: how a request's prompt is pooled into one vector, and what a checkpoint says.

An embedding request is an engine request whose `SamplingParams.pooling` is a `PoolingParams`:
its prompt is prefilled like any other (in chunks, sharing steps with generating requests), the
model's final hidden states after the final norm (what the head would read) are pooled, and
when its last chunk is done it ends with one event carrying the vector; it never samples and
keeps no KV blocks. `last` takes the last token's state (Qwen3-Embedding's way), `mean` the mean
over every prompt token; the vector is then cut to `dimensions` (Matryoshka models) and
L2-normalized.

`EmbeddingSpec.read` reads what a checkpoint directory says (a GGUF file says nothing here): sentence-transformers'
`1_Pooling/config.json` (the default pooling) and config.json's Matryoshka markers
(`is_matryoshka`, `matryoshka_dimensions`, as vLLM reads them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_MODES = ("last", "mean")
DEFAULT_POOLING = "last"
# sentence-transformers' 1_Pooling/config.json keys, and the mode each stands for
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's pooling: the mode, and the leading dimensions to keep (None: all)."""

    mode: str = DEFAULT_POOLING
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, not {self.mode!r}")

    def finish(self, pooled: torch.Tensor, num_tokens: int) -> list[float]:
        """The request's vector from its pooled state: for `mean` the sum over its num_tokens
        tokens' states, for `last` the last token's state (float32, (C,))."""
        if self.mode == "mean":
            pooled = pooled / num_tokens
        if self.dimensions is not None:
            pooled = pooled[: self.dimensions]
        return F.normalize(pooled.float(), dim=-1).cpu().tolist()


@dataclass(frozen=True)
class EmbeddingSpec:
    """What a served model's embeddings are: its pooling, width and Matryoshka dimensions."""

    pooling: str = DEFAULT_POOLING
    hidden_size: int = 0
    # Matryoshka-trained: True (any width up to hidden_size), a tuple of the widths it was
    # trained for, or False (only hidden_size)
    matryoshka: bool | tuple[int, ...] = False

    @classmethod
    def read(cls, path: str | Path, hidden_size: int, pooling: str | None = None) -> EmbeddingSpec:
        """The spec of the checkpoint at path; pooling (the --pooling flag) overrides its own."""
        path = Path(path)
        if not path.is_dir():  # a GGUF file says neither
            return cls(pooling or DEFAULT_POOLING, hidden_size, False)
        return cls(
            pooling or checkpoint_pooling(path) or DEFAULT_POOLING,
            hidden_size,
            _matryoshka(path / "config.json"),
        )

    def allows(self, dimensions: int) -> bool:
        """Whether a request may ask for vectors of this many dimensions."""
        if dimensions == self.hidden_size:
            return True
        if isinstance(self.matryoshka, tuple):
            return dimensions in self.matryoshka
        return self.matryoshka and 1 <= dimensions <= self.hidden_size


def checkpoint_pooling(directory: Path) -> str | None:
    """The pooling sentence-transformers' 1_Pooling/config.json asks for, if it has one we run."""
    try:
        config = json.loads((directory / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for key, mode in _ST_MODES.items():
        if config.get(key) is True:
            return mode
    return None


def _matryoshka(config_path: Path) -> bool | tuple[int, ...]:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
        return tuple(dims)
    return config.get("is_matryoshka") is True
