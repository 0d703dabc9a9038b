"""Shared setup for the kernel tests.

Under the root conftest.py the Triton kernels run in the interpreter on CPU tensors. With
GPTSERVE_TRITON_CUDA=1 on a machine with a GPU (bench/gpu_check.sh) the same tests run the
compiled kernels on CUDA tensors, with bf16 added (the interpreter has no bf16 arithmetic).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, DTYPES


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])


@pytest.fixture
def device() -> torch.device:
    return DEVICE
