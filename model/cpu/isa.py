"""What this CPU's instruction sets make fast, as PyTorch will use them.

The CPU wing's choices that depend on the host are rules derived from measurements on both
kinds of x86 host users have (docs/BENCHMARKS.md, "AVX2 hosts"), not assumptions:
`fast_bfloat16_products` says whether a bfloat16 matrix product runs on native bfloat16 dot
products (AVX-512 BF16 or AMX); without them (AVX2 hosts, AVX-512 without BF16) PyTorch
converts each element and such a product is slower than float32's.

PyTorch's kernels follow `ATEN_CPU_CAPABILITY` and oneDNN's `ONEDNN_MAX_CPU_ISA`; setting both to
AVX2 on an AVX-512 machine makes it compute, and these rules decide, as an AVX2 host would
(`bench/host.py` prints the capability in use).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def fast_bfloat16_products() -> bool:
    """Whether this process's CPU kernels multiply bfloat16 natively."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False  # AVX2 kernels (or another architecture): no bfloat16 dot products
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
