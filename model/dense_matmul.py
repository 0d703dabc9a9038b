"""Float32 matrix products of plain (trainable) tensors on oneDNN's kernels: `matmul`.

PyTorch's CPU `torch.mm` in float32 calls MKL, which on AMD processors takes its AVX2 kernels
even where the CPU has AVX-512: on this project's AMD EPYC development box it reaches about 105
GFLOP/s a core where oneDNN's kernels, which choose by instruction set rather than vendor,
reach about twice that (docs/BENCHMARKS.md, "Training step"). oneDNN's product reads either
operand in place through its strides (a transposed view costs no copy); the only copy made
here is of a non-contiguous left operand. Unlike `OneDnnLinear` nothing is reordered ahead of
time: the operands change every step (the training head's gradients).

The result is the same product within float32 rounding (another summation order); where oneDNN
is not in this build `matmul` is `torch.mm`.
"""

from __future__ import annotations

import functools

import torch


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, K) @ (K, N) -> (M, N), on oneDNN for float32 CPU tensors where it runs."""
    if a.dtype == b.dtype == torch.float32 and a.device.type == "cpu" and available():
        # oneDNN's linear: input (M, K) @ weight (N, K).T; b.t() is a view, read in place
        return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.t(), None, "none", [], "")
    return torch.mm(a, b)


@functools.cache
def available() -> bool:
    """Whether this build runs oneDNN's float32 linear (a tiny product, checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # a private op: present in PyTorch's CPU builds with oneDNN, checked rather than assumed
        a = torch.arange(6.0).view(2, 3)
        b = torch.arange(12.0).view(3, 4)
        got = torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")
        return torch.equal(got, a @ b)
    except (RuntimeError, AttributeError):
        return False
