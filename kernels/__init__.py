"""Attention kernels with one dispatch point.

`flash_attention` (training, full causal forward) and `paged_attention` (inference over the paged
KV cache, described per step by `AttentionMetadata`) run as Triton kernels on CUDA and as PyTorch
elsewhere: SDPA, and for paged attention `kernels.paged_decode_cpu` for the step's leading decodes,
over head-major pools (how `KVCache` stores them), and SDPA after a gather of each sequence's keys
and values for the rest (`kernels.sdpa_paged`). `set_backend("triton")` forces the Triton kernels
(on CPU that needs TRITON_INTERPRET=1 set before triton is imported); `set_backend("torch")`
forces PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata
from kernels.paged_decode_cpu import decode_attention_cpu, is_head_major
from kernels.prefill_cpu import prefill_attention_cpu, shares_prefix
from kernels.reference import attention_reference, paged_attention_reference
from kernels.sdpa_paged import paged_attention_sdpa

__all__ = [
    "AttentionMetadata",
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    sm_scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Fused attention over (B, H, T, D) tensors, differentiable; like F.scaled_dot_product_attention."""
    if _use_triton(q):
        from kernels.flash import triton_flash_attention

        return triton_flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    sm_scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """New tokens (N, H, D) against one layer's paged K/V; see `paged_attention_reference`."""
    if _use_triton(q):
        from kernels.paged import triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, meta, sm_scale)
    if q.device.type == "cpu":
        return _paged_attention_cpu(q, k_cache, v_cache, meta, sm_scale)
    return paged_attention_sdpa(q, k_cache, v_cache, meta, sm_scale)


def _paged_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float | None,
) -> torch.Tensor:  # fmt: skip
    """Over head-major pools: the leading decodes read the pools in place; the rest (prefills)
    read a prefix that several of them share once (cascade), or else gather + SDPA."""
    if not is_head_major(k_cache, v_cache):
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale)
    n = meta.num_decodes
    if n == meta.num_seqs:
        return decode_attention_cpu(q, k_cache, v_cache, meta, scale)
    if n == 0:
        return _prefill_cpu(q, k_cache, v_cache, meta, scale)
    decodes, rest = meta.plan("cpu_split", lambda: meta.split(n))
    first = decode_attention_cpu(q[:n], k_cache, v_cache, decodes, scale)
    return torch.cat([first, _prefill_cpu(q[n:], k_cache, v_cache, rest, scale)])


def _prefill_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float | None,
) -> torch.Tensor:  # fmt: skip
    if shares_prefix(meta, k_cache.shape[1]):
        return prefill_attention_cpu(q, k_cache, v_cache, meta, scale)
    return paged_attention_sdpa(q, k_cache, v_cache, meta, scale)
