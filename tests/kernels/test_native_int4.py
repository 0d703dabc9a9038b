"""The compiled int4 product (`kernels/cpu/int4_matmul.cpp`, through `model.int4_linear`): the
dequantized weights' product, every row count and tile tail, a row alike in any batch, its
checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gptserve.kernels.cpu import native
from gptserve.model.gguf.blocks import Int4Groups
from gptserve.model.int4_linear import Int4Linear, pack_tiles

pytestmark = pytest.mark.skipif(not native.enabled(), reason="GPTSERVE_NATIVE=0")


def _groups(out: int, width: int, seed: int = 0, half_scales: bool = True) -> Int4Groups:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (out, width), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (out, width // 32)).astype(np.float32)
    zeros = rng.normal(0, 0.05, (out, width // 32)).astype(np.float32)
    if half_scales:  # as GGUF's Q4_0, Q4_1 and Q8_0 store them
        scales, zeros = scales.astype(np.float16), (zeros - 8 * scales).astype(np.float16)
        zeros = zeros.astype(np.float32) + 8 * scales.astype(np.float32)
    return Int4Groups(codes, scales.astype(np.float32), zeros.astype(np.float32))


def _dense(groups: Int4Groups, copies: int) -> torch.Tensor:
    """(out, in) float64: each group's weights, the `copies` groups an input group feeds added."""
    weight = torch.from_numpy(groups.dequantize()).double()  # (out, copies * in)
    out, width = weight.shape
    return weight.view(out, width // (32 * copies), copies, 32).sum(2).reshape(out, -1)


@pytest.mark.parametrize("half_scales", [True, False], ids=["float16-table", "float32-table"])
@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("out, width", [(96, 128), (40, 64), (200, 576), (16, 32)])
def test_multiplies_the_dequantized_weights(out, width, copies, half_scales):
    groups = _groups(out, width * copies, half_scales=half_scales)
    layer = Int4Linear(groups, input_copies=copies, compiled=True)
    table = layer.scales_and_zeros
    assert table.dtype == (torch.float16 if half_scales else torch.float32)
    x = torch.randn(7, width, generator=torch.Generator().manual_seed(1))
    want = x.double() @ _dense(groups, copies).t()  # (7, out)
    got = layer(x)
    assert got.shape == (7, out) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 64, 70, 131])
def test_a_row_is_the_same_in_any_batch(rows):
    # rows go 4 (AVX-512) or 1 at a time through tiles taken 4 or 1 at a time, in chunks of 64
    layer = Int4Linear(_groups(232, 256), compiled=True)  # 8 tiles: the last of 8 columns
    assert_rows_batch_free(layer, rows)


def assert_rows_batch_free(layer: Int4Linear, rows: int) -> None:
    """`rows` random rows through `layer` at once give each row's result alone, to the bit."""
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


def test_bfloat16_in_and_out_and_a_bias():
    groups = _groups(64, 96)
    bias = torch.randn(64)
    layer = Int4Linear(groups, bias=bias, compiled=True)
    x = torch.randn(3, 96)
    want = x.double() @ _dense(groups, 1).t() + bias.double()
    assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max()
    layer.out_dtype = torch.bfloat16
    got = layer(x.bfloat16())  # inputs rounded to bfloat16 (as op_dtype bfloat16 would)
    want = x.bfloat16().double() @ _dense(groups, 1).t() + bias.double()
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()


def test_the_layout_is_tiles_of_32_columns():
    groups = _groups(40, 64)
    codes, table = pack_tiles(groups)
    assert codes.shape == (2, 32, 32) and table.shape == (2, 2, 2, 32)  # 40 columns -> 2 tiles
    byte = int(codes[1, 3, 5])  # tile 1, inputs 6 and 7, column 32 + 5
    assert byte & 15 == groups.codes[37, 6] and byte >> 4 == groups.codes[37, 7]
    assert float(table[1, 0, 0, 5]) == pytest.approx(groups.scales[37, 0], rel=1e-3)
    assert torch.equal(codes[1, :, 8:], torch.zeros(32, 24, dtype=torch.uint8))  # padding


def test_bad_shapes_are_refused():
    layer = Int4Linear(_groups(64, 64), compiled=True)
    op = native.native_ops().int4_matmul
    weight, table = layer.weight, layer.scales_and_zeros
    with pytest.raises(RuntimeError, match="width"):
        op(torch.randn(2, 96), weight, table, 64, 1, torch.float32)
    with pytest.raises(RuntimeError, match="n does not match"):
        op(torch.randn(2, 64), weight, table, 100, 1, torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 64).half(), weight, table, 64, 1, torch.float32)
