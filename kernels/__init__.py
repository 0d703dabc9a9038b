"""Attention kernels with one dispatch point.

`flash_attention` (training, full causal forward) and `paged_attention` (inference over the paged
KV cache) run as Triton kernels on CUDA and as PyTorch elsewhere: SDPA, and for paged attention
`kernels.paged_decode_cpu` for the sequences that decode, over head-major pools (how `KVCache`
stores them), and SDPA after a gather of each sequence's keys and values for the rest
(`kernels.sdpa_paged`). `set_backend("triton")`
forces the Triton kernels (on CPU that needs TRITON_INTERPRET=1 set before triton is imported);
`set_backend("torch")` forces PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_decode_cpu import decode_attention_cpu
from kernels.reference import attention_reference, paged_attention_reference
from kernels.sdpa_paged import paged_attention_sdpa
from kernels.step_plan import StepPlanCache

__all__ = [
    "attention_reference",
    "flash_attention",
    "get_backend",
    "paged_attention",
    "paged_attention_reference",
    "set_backend",
]

_BACKENDS = ("auto", "triton", "torch")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose how attention runs: "auto" (Triton on CUDA), "triton" or "torch"."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def _use_triton(t: torch.Tensor) -> bool:
    if _backend == "torch":
        return False
    if _backend == "triton":
        return True
    return t.is_cuda


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Fused attention over (B, H, T, D) tensors, differentiable; like F.scaled_dot_product_attention."""
    if _use_triton(q):
        from kernels.flash import triton_flash_attention

        return triton_flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """New tokens (N, H, D) against paged K/V; see `paged_attention_reference` for the contract."""
    if _use_triton(q):
        from kernels.paged import triton_paged_attention

        return triton_paged_attention(
            q, k_cache, v_cache, block_tables, context_lens, query_start, sm_scale=sm_scale
        )
    if q.device.type == "cpu":
        return _paged_attention_cpu(
            q, k_cache, v_cache, block_tables, context_lens, query_start, sm_scale
        )
    return paged_attention_sdpa(
        q, k_cache, v_cache, block_tables, context_lens, query_start, sm_scale=sm_scale
    )


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # block tables, lengths, query starts
_cpu_splits: StepPlanCache[tuple[int, Batch, Batch] | None] = StepPlanCache()


def _decode_prefix(
    tables: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor
) -> tuple[int, Batch, Batch] | None:
    """(n, first n sequences, the rest) when the batch opens with n decodes and has more."""
    one_new = (starts[1:] - starts[:-1]) == 1  # (B,)
    n = int(one_new.int().cumprod(0).sum())  # leading sequences with one new token
    if n in (0, len(one_new)):
        return None
    rest_starts = starts[n:] - starts[n]
    return n, (tables[:n], lens[:n], starts[: n + 1]), (tables[n:], lens[n:], rest_starts)


def _paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Decode sequences read head-major pools in place; prefills (and the rest) gather + SDPA.

    The engine puts a step's decodes first, so a step that also prefills splits in two.
    """
    inputs = (block_tables, context_lens, query_start)
    split = _cpu_splits.get(inputs, q.shape[0], lambda: _decode_prefix(*inputs))
    if split is None:
        out = decode_attention_cpu(q, k_cache, v_cache, *inputs, scale)
        return paged_attention_sdpa(q, k_cache, v_cache, *inputs, scale) if out is None else out
    n, decodes, rest = split
    first = decode_attention_cpu(q[:n], k_cache, v_cache, *decodes, scale)
    if first is None:  # pools the in-place path does not cover
        return paged_attention_sdpa(q, k_cache, v_cache, *inputs, scale)
    return torch.cat([first, paged_attention_sdpa(q[n:], k_cache, v_cache, *rest, scale)])
