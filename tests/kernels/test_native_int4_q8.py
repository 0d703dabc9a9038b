"""The compiled int4 product with 8-bit rows (`kernels/cpu/int4_q8_matmul.cpp`, through
`Int4Linear.use_int8_activations`): exactly the rows rounded to 8 bits per block of 32 times the
int4 weights; every row count and tile tail; a row alike in any batch; the layout's round trip."""

from __future__ import annotations

import pytest
import torch
from gptserve.kernels.cpu import native
from gptserve.model.int4_linear import Int4Linear, q8_layout

from tests.kernels.test_native_int4 import _groups, assert_rows_batch_free

pytestmark = pytest.mark.skipif(not native.enabled(), reason="GPTSERVE_NATIVE=0")


def _rows8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> its blocks of 32 rounded as the kernel rounds them: xq (M, K / 32, 32) float64
    integers within [-127, 127] and d (M, K / 32, 1), x ~ d * xq."""
    blocks = x.double().view(x.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True).float() / 127).double()  # float32 amax / 127
    scaled = torch.where(d > 0, blocks.float() * (1 / d.float()), 0).double()
    return torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5).trunc(), d


def _expected(layer_groups, x: torch.Tensor, copies: int) -> torch.Tensor:
    """(M, out) float64: the weights times the rounded rows, d * xq."""
    xq, d = _rows8(x)  # (M, G, 32), (M, G, 1)
    codes = torch.from_numpy(layer_groups.codes).double()  # (out, copies * K)
    out = codes.shape[0]
    scales = torch.from_numpy(layer_groups.scales).double()  # (out, copies * G)
    offsets = torch.from_numpy(layer_groups.zeros).double() - 8 * scales
    codes = codes.view(out, -1, copies, 32)  # (out, G, copies, 32)
    sums = torch.einsum("mgk,ogck->mogc", xq, codes)  # (M, out, G, copies)
    scales, offsets = scales.view(out, -1, copies), offsets.view(out, -1, copies)
    block_sums = (xq.sum(-1, keepdim=True) * d)[..., 0]  # (M, G): d * sum(xq)
    dot = (sums * scales[None] * d[:, None, :, :]).sum((2, 3))
    return dot + torch.einsum("mg,ogc->mo", block_sums, offsets)


@pytest.mark.parametrize("half_scales", [True, False], ids=["float16-table", "float32-table"])
@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("out, width", [(96, 128), (40, 64), (200, 576), (16, 32)])
def test_multiplies_the_rows_rounded_to_8_bits(out, width, copies, half_scales):
    groups = _groups(out, width * copies, half_scales=half_scales)
    layer = Int4Linear(groups, input_copies=copies, compiled=True)
    x = torch.randn(7, width, generator=torch.Generator().manual_seed(1))
    float_rows = layer(x)
    layer.use_int8_activations()
    got = layer(x)
    want = _expected(groups, x, copies)
    assert got.shape == (7, out) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # and it is not the float32 rows' product: the rows' rounding shows, a little
    gap = (got - float_rows).abs().max() / float_rows.abs().max()
    assert 0 < gap < 0.02


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, 67, 131])
def test_a_row_is_the_same_in_any_batch(rows):
    # rows go 4, 2 or 1 at a time (AVX2 builds) through tiles, in chunks of 64
    layer = Int4Linear(_groups(232, 256), compiled=True)  # 8 tiles: the last of 8 columns
    layer.use_int8_activations()
    assert_rows_batch_free(layer, rows)


def test_bfloat16_in_and_out_and_a_bias():
    groups = _groups(64, 96)
    bias = torch.randn(64)
    layer = Int4Linear(groups, bias=bias, dtype=torch.bfloat16, compiled=True)
    layer.use_int8_activations()
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = layer(x)
    want = _expected(groups, x.float(), 1) + bias.to(torch.bfloat16).double()
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()


def test_zero_rows_give_zeros_and_a_nan_stays_in_its_row():
    layer = Int4Linear(_groups(32, 64), compiled=True)
    layer.use_int8_activations()
    x = torch.zeros(3, 64)
    x[1, 5] = float("nan")
    got = layer(x)
    assert torch.equal(got[0], torch.zeros(32)) and torch.equal(got[2], torch.zeros(32))
    assert got[1].isnan().all()


def test_the_layout_holds_every_code_once():
    groups = _groups(64, 128)
    tiled = Int4Linear(groups, compiled=True).weight  # (tiles, 64, 32): codes 2p and 2p + 1
    packed = q8_layout(tiled)  # (tiles, 16, 32, 4)
    assert packed.shape == (2, 16, 32, 4) and packed.dtype == torch.uint8
    codes = torch.from_numpy(groups.codes).view(2, 32, 16, 8)  # (tiles, column, eights, input)
    assert torch.equal(packed & 15, codes[..., :4].permute(0, 2, 1, 3))
    assert torch.equal(packed >> 4, codes[..., 4:].permute(0, 2, 1, 3))


def test_moving_twice_is_moving_once_and_pytorchs_kernel_refuses():
    layer = Int4Linear(_groups(32, 64), compiled=True)
    layer.use_int8_activations()
    weight = layer.weight
    layer.use_int8_activations()
    assert layer.weight is weight and "8-bit rows" in repr(layer)
    with pytest.raises(ValueError, match="compiled"):
        Int4Linear(_groups(32, 64), compiled=False).use_int8_activations()
