"""Attention kernels with one dispatch point.

`flash_attention` (training, full causal forward) and `paged_attention` (inference over the paged
KV cache) run as Triton kernels on CUDA and as PyTorch elsewhere: SDPA, and for paged attention
`kernels.paged_decode_cpu` for decode steps over head-major pools (how `KVCache` stores them), else
SDPA after a gather of each sequence's keys and values (`kernels.sdpa_paged`). `set_backend("triton")`
forces the Triton kernels (on CPU that needs TRITON_INTERPRET=1 set before triton is imported);
`set_backend("torch")` forces PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_decode_cpu import decode_attention_cpu
from kernels.reference import attention_reference, paged_attention_reference
from kernels.sdpa_paged import paged_attention_sdpa

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
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start, sm_scale)
    out = decode_attention_cpu(*args) if q.device.type == "cpu" else None
    return paged_attention_sdpa(*args) if out is None else out
