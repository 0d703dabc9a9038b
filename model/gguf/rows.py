"""A GGUF table's rows read from the file when asked for, and an output head refined with them.

`FileRows` dequantizes rows of one quantized tensor on demand from a read-only mapping of the
file made for that tensor alone, so only the pages of the rows read become resident: a 49152-token
embedding costs the pages of the tokens a server sees, not the table. The file must stay where it
is while the model serves (replacing it by a rename is fine: the mapping keeps the old inode).

`RefinedHead` is an output head whose fast product rounds (bfloat16 outputs: SmolLM2's logits
reach 40, where bfloat16's step is 0.25; a Q8_0 table requantized to int8 rows moves them further;
alone, the head then changes the top token at 1-2% of positions): it recomputes each row's
`REFINED` largest logits in float32 from the exact rows, so for a given hidden state the top
tokens and their logits are the float head's, and the other logits keep the fast product's.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn as nn
from gptserve.model.gguf.checkpoint import RawTensor

REFINED = 16  # logits per row recomputed exactly


class FileRows:
    """Rows of a quantized (rows, cols) tensor, dequantized to float32 when indexed."""

    def __init__(self, data: np.ndarray, kind: str, shape: tuple[int, int]) -> None:
        self.data, self.kind, self.shape = data, kind, shape  # data: (rows, bytes per row)

    @classmethod
    def of(cls, raw: RawTensor, path: Path | None) -> FileRows:
        """From the file when the tensor is stored there as is, else from a copy of its bytes."""
        if path is None or raw.offset is None:
            return cls(np.array(raw.data), raw.type, raw.shape)
        mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=raw.offset, shape=raw.data.shape)
        return cls(np.asarray(mapped), raw.type, raw.shape)  # a plain view: faster to index

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        """(...) row indices -> (..., cols) float32."""
        flat = index.reshape(-1).cpu().numpy()
        if self.kind == "Q8_0":
            rows = _q8_0_rows(self.data[flat])
        else:
            rows = gguf.quants.dequantize(self.data[flat], gguf.GGMLQuantizationType[self.kind])
        values = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        return values.view(*index.shape, self.shape[1])


def _q8_0_rows(data: np.ndarray) -> np.ndarray:
    """(n, bytes per row) Q8_0 rows -> (n, cols) float32, each weight its block's float16 scale
    times its int8 (what gguf's dequantize computes, without its per-call overhead: a GGUF head
    refines 16 rows a sequence every step)."""
    blocks = data.reshape(data.shape[0], data.shape[1] // 34, 34)  # (n, blocks, 2 + 32)
    scales = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # (n, blocks, 1)
    weights = blocks[..., 2:].view(np.int8).astype(np.float32)  # (n, blocks, 32)
    return (weights * scales).reshape(data.shape[0], blocks.shape[1] * 32)


class RowsEmbedding(nn.Module):
    """A token embedding whose rows come from `FileRows`: (...) ids -> (..., C) in `dtype`."""

    def __init__(self, rows: FileRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = rows, dtype

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.table(index).to(self.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.table.shape[0]} rows of {self.table.shape[1]}, {self.table.kind}, read on use"
        )


class RefinedHead(nn.Module):
    """`fast`'s logits with each row's `refine` largest recomputed in float32 from `rows`."""

    def __init__(self, fast: nn.Module, rows: FileRows, refine: int = REFINED) -> None:
        super().__init__()
        self.fast, self.table, self.refine = fast, rows, refine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., V)."""
        logits = self.fast(x)  # (..., V)
        flat = logits.reshape(-1, logits.shape[-1])  # (M, V)
        hidden = x.reshape(-1, x.shape[-1]).float()  # (M, C)
        top = flat.topk(min(self.refine, flat.shape[-1]), dim=-1).indices  # (M, k)
        weights = self.table(top)  # (M, k, C) float32, exact
        # products and sums per row (a bmm of M matrix-vector products rounds a row differently
        # when M is 1: the row's logits would depend on its batch)
        exact = (weights * hidden[:, None, :]).sum(-1)  # (M, k)
        flat.scatter_(1, top, exact.to(flat.dtype))
        return flat.view(logits.shape)

    def extra_repr(self) -> str:
        return f"top {self.refine} per row in float32"
