"""The compiled float32 product (`kernels/cpu/f32_matmul.cpp`): the product with its bias and
activation, every row count and tile tail, a row alike in any batch and thread count, its
checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gptserve.kernels.cpu import native
from gptserve.model.activations import KERNEL_CODES
from gptserve.model.cpu.few_rows_linear import pack_tiles

pytestmark = pytest.mark.skipif(not native.enabled(), reason="GPTSERVE_NATIVE=0")


def _op():
    ops = native.native_ops()
    assert ops is not None, "the CPU kernels did not build"
    return ops.f32_matmul


def _reference(x, weight, bias, activation: str) -> torch.Tensor:
    y = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return F.relu(y) if activation == "relu" else y


@pytest.mark.parametrize("activation", list(KERNEL_CODES))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("out, width", [(96, 128), (40, 64), (232, 300), (7, 1)])
def test_multiplies_adds_the_bias_and_applies_the_activation(out, width, rows, with_bias,
                                                             activation):  # fmt: skip
    gen = torch.Generator().manual_seed(out + width + rows)
    weight = torch.randn(out, width, generator=gen)
    bias = torch.randn(out, generator=gen) if with_bias else None
    x = torch.randn(rows, width, generator=gen)
    got = _op()(x, pack_tiles(weight), bias, out, KERNEL_CODES[activation])
    want = _reference(x, weight, bias, activation)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64, 70, 131])
def test_a_row_is_the_same_in_any_batch(rows):
    # rows go 4 (AVX-512) or 3 (AVX2) at a time through tiles taken 2, 4 or 1 at a time, in
    # chunks of 64; a lone row takes more tiles at once than a block of rows
    weight = torch.randn(232, 256)  # 8 tiles: the last of 8 columns
    tiles, bias = pack_tiles(weight), torch.randn(232)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    together = _op()(x, tiles, bias, 232, 1)
    alone = torch.cat([_op()(x[i : i + 1], tiles, bias, 232, 1) for i in range(rows)])
    assert torch.equal(together, alone)


def test_a_row_is_the_same_on_any_number_of_threads():
    weight, x = torch.randn(1000, 192), torch.randn(6, 192)
    tiles = pack_tiles(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _op()(x, tiles, None, 1000, 0)
        torch.set_num_threads(max(2, threads))
        many = _op()(x, tiles, None, 1000, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_no_rows_give_an_empty_result():
    got = _op()(torch.empty(0, 64), pack_tiles(torch.randn(40, 64)), None, 40, 0)
    assert got.shape == (0, 40)


def test_the_layout_is_tiles_of_32_columns():
    weight = torch.randn(40, 64)
    tiles = pack_tiles(weight)
    assert tiles.shape == (2, 64, 32)  # 40 columns -> 2 tiles
    assert tiles[1, 6, 5] == weight[37, 6]  # tile 1, input 6, column 32 + 5
    assert torch.equal(tiles[1, :, 8:], torch.zeros(64, 24))  # padding


def test_bad_inputs_are_refused():
    op, tiles = _op(), pack_tiles(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match="K as x's width"):
        op(torch.randn(2, 96), tiles, None, 64, 0)
    with pytest.raises(RuntimeError, match="n does not match"):
        op(torch.randn(2, 64), tiles, None, 100, 0)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 64).bfloat16(), tiles, None, 64, 0)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 64), tiles, torch.randn(63), 64, 0)
    with pytest.raises(RuntimeError, match="activation"):
        op(torch.randn(2, 64), tiles, None, 64, 3)
