"""The compiled K-quant kernels (`kernels/cpu/kquant_matmul.cpp`): the weights they decode are the
gguf package's dequantization to the bit, their products that weight's times the inputs, a row
alike in any batch, rows longer than a decoding chunk, their checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gptserve.kernels.cpu.native import native_ops

from tests.model.gguf.test_kquant_blocks import oracle, random_blocks

pytestmark = pytest.mark.skipif(native_ops() is None, reason="CPU kernels not built")
CODES = {"Q5_K": 5, "Q6_K": 6}


@pytest.mark.parametrize("kind", list(CODES))
def test_decodes_the_files_weights_to_the_bit(kind: str) -> None:
    data = random_blocks(kind, 33, 1280, seed=5)
    got = native_ops().kquant_dequantize(torch.from_numpy(data), CODES[kind], 1280)
    assert got.shape == (33, 1280) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), oracle(data, kind))


@pytest.mark.parametrize("kind", list(CODES))
@pytest.mark.parametrize("cols", [256, 4608])  # 4608: 18 super-blocks, two decoding chunks
def test_products_and_a_row_alike_in_any_batch(kind: str, cols: int) -> None:
    data = random_blocks(kind, 45, cols, seed=cols)
    blocks = torch.from_numpy(data)
    weight = torch.from_numpy(oracle(data, kind)).double()
    for rows in (1, 2, 3, 4, 5, 9):  # rows go 4 (AVX-512) or 2 at a time, then one by one
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        together = native_ops().kquant_matmul(x, blocks, CODES[kind])
        want = x.double() @ weight.t()
        assert together.shape == (rows, 45) and together.dtype == torch.float32
        assert (together.double() - want).abs().max() <= 1e-5 * want.abs().max()
        alone = torch.cat([native_ops().kquant_matmul(x[i : i + 1], blocks, CODES[kind]) for i in range(rows)])  # fmt: skip
        assert torch.equal(together, alone)
        halves = native_ops().kquant_matmul(x.to(torch.bfloat16), blocks, CODES[kind])
        assert torch.equal(halves, native_ops().kquant_matmul(x.to(torch.bfloat16).float(), blocks, CODES[kind]))  # fmt: skip


def test_checks_are_one_line_errors() -> None:
    ops = native_ops()
    blocks = torch.from_numpy(random_blocks("Q6_K", 4, 512))
    with pytest.raises(RuntimeError, match="kind must be 5"):
        ops.kquant_matmul(torch.randn(1, 512), blocks, 4)
    with pytest.raises(RuntimeError, match="blocks must be"):
        ops.kquant_matmul(torch.randn(1, 512), blocks, 5)  # Q6_K's bytes read as Q5_K's
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.kquant_dequantize(blocks, 6, 500)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.kquant_matmul(torch.randn(1, 512, dtype=torch.float64), blocks, 6)
