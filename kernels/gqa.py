"""Grouped-query attention: which key/value head each query head reads.

A model with n_kv_head < n_head key/value heads (Llama 3, Mistral, Qwen2) gives each KV head to a
group of n_head // n_kv_head consecutive query heads: query head h reads KV head h // group. The
KV cache stores n_kv_head heads, so every attention path takes keys and values with fewer heads
than the queries; group 1 is plain multi-head attention.
"""

from __future__ import annotations


def kv_group(n_head: int, n_kv_head: int) -> int:
    """Query heads per key/value head; a ValueError when n_head is not a multiple of n_kv_head."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads cannot share {n_kv_head} key/value heads evenly")
    return n_head // n_kv_head
