"""Attention: the fused causal forward for training and paged attention over the KV cache.

`flash_attention` (training, full causal forward) runs the Triton kernel on CUDA tensors and
PyTorch's SDPA elsewhere. Paged attention runs through an `AttentionBackend` (`kernels.backends`),
chosen once per KV cache by `select_attention_backend(device, dtype)`: Triton on CUDA, the CPU
paths (`kernels.cpu`) on a CPU, gather + SDPA (`kernels.sdpa_paged`) anywhere else. Tests that
want Triton on a CPU (under TRITON_INTERPRET=1) call `kernels.triton` or `TritonBackend` directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gptserve.kernels.backends import (
    AttentionBackend,
    CpuPagedBackend,
    KVSpec,
    SdpaGatherBackend,
    TritonBackend,
    select_attention_backend,
)
from gptserve.kernels.gqa import kv_group
from gptserve.kernels.metadata import AttentionMetadata, AttentionPlan
from gptserve.kernels.reference import attention_reference, paged_attention_reference
from gptserve.kernels.triton import available as triton_available
from gptserve.kernels.window import check_window, trim_to_window

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPlan",
    "CpuPagedBackend",
    "KVSpec",
    "SdpaGatherBackend",
    "TritonBackend",
    "attention_reference",
    "flash_attention",
    "paged_attention_reference",
    "select_attention_backend",
    "trim_to_window",
]


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    sm_scale: float | None = None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Fused attention of q (B, H, T, D) over k, v (B, H_kv, T, D), differentiable; like
    F.scaled_dot_product_attention. H_kv may be fewer than H (grouped-query attention, SDPA's
    `enable_gqa`): H must be a multiple of it, and query head h reads KV head h // (H // H_kv).
    `window` (causal only): each query sees itself and the window - 1 keys before it
    (`kernels.window`); None: every earlier key."""
    check_window(window, causal)
    gqa = kv_group(q.shape[-3], k.shape[-3]) > 1
    if q.is_cuda and triton_available():
        from gptserve.kernels.triton.flash import triton_flash_attention

        return triton_flash_attention(
            q, k, v, causal=causal, sm_scale=sm_scale, enable_gqa=gqa, window=window
        )
    if window is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=gqa
        )
    tq, tk = q.shape[-2], k.shape[-2]
    qpos = torch.arange(tq, device=q.device)[:, None] + (tk - tq)  # (Tq, 1) bottom-right aligned
    kpos = torch.arange(tk, device=q.device)[None, :]  # (1, Tk)
    seen = (kpos <= qpos) & (kpos > qpos - window)  # (Tq, Tk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=sm_scale, enable_gqa=gqa)
