"""Sliding-window attention: which keys a windowed layer's queries see, and which blocks hold them.

A layer with a window of W tokens (Mistral, Gemma 3's local layers, Hugging Face's
`sliding_window`) lets the query at position p see the keys at positions j with p - W < j <= p:
itself and the W - 1 before it. Every attention path takes the window as `window: int | None`
(None: the whole causal context).

A step's blocks that lie wholly before all of a sequence's windows are never read:
`trim_to_window` gives the metadata of the blocks the step's queries can see, each sequence's
block table shifted past the blocks it skips and its context shortened by as many slots. Key
positions within a sequence move by the same amount as its queries' positions, so a causal and
window mask computed on the trimmed metadata is the same mask; a backend that plans its reads
from metadata (gathers, runs of blocks) plans a windowed layer from the trimmed one. The engine
frees blocks no window will see again (`engine.block_manager`), and their table entries are then
stale: only the trimmed tables are safe to read.
"""

from __future__ import annotations

import torch
from gptserve.kernels.metadata import AttentionMetadata


def check_window(window: int | None, causal: bool = True) -> None:
    """A ValueError unless `window` is None or a positive int, and the attention causal."""
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    if not causal:
        raise ValueError("a sliding window needs causal attention")


def skipped_blocks(seq_len: int, query_len: int, window: int, block_size: int) -> int:
    """Leading blocks of a sequence of `seq_len` tokens, the last `query_len` of them new, that
    none of its new tokens' windows reaches: the first new token (position seq_len - query_len)
    sees keys from seq_len - query_len - window + 1 on."""
    return max(0, seq_len - query_len - window + 1) // block_size


def trim_to_window(meta: AttentionMetadata, window: int, block_size: int) -> AttentionMetadata:
    """`meta` with each sequence's blocks before its window dropped (`skipped_blocks`): tables
    shifted, context lengths shortened by the skipped slots; the slots the new tokens are written
    to, their positions and the packed rows are unchanged. `meta` itself when nothing is
    skipped."""
    skips = [
        skipped_blocks(n, q, window, block_size) for n, q in zip(meta.seq_lens, meta.query_lens)
    ]
    if not any(skips):
        return meta
    seq_lens = [n - s * block_size for n, s in zip(meta.seq_lens, skips)]
    width = max(-(-n // block_size) for n in seq_lens)
    tables = meta.block_tables
    device = tables.device
    skip = torch.tensor(skips, dtype=torch.long).to(device, non_blocking=True)  # (B,)
    cols = (skip[:, None] + torch.arange(width, device=device)[None, :]).clamp_(
        max=tables.shape[1] - 1
    )  # (B, nb') each kept column's place in the full table
    trimmed = tables.gather(1, cols).contiguous()  # (B, nb')
    lens = torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True)  # (B,)
    return AttentionMetadata(
        positions=meta.positions,
        slot_mapping=meta.slot_mapping,
        block_tables=trimmed,
        context_lens=lens,
        query_start=meta.query_start,
        seq_lens=seq_lens,
        query_lens=list(meta.query_lens),
    )
