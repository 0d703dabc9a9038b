"""Constants and helpers the kernel tests share (imported by conftest.py and the tests)."""

from __future__ import annotations

import os

import torch

ON_CUDA = os.environ.get("GPTSERVE_TRITON_CUDA") == "1" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# max |error| / max |reference|, per dtype of the inputs
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32; NaN anywhere makes it NaN."""
    actual, expected = actual.detach().float(), expected.detach().float()
    diff = (actual - expected).abs().max()
    return float(diff / expected.abs().max().clamp_min(1e-6))
