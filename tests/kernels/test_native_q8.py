"""The compiled 8-bit product (`kernels/cpu/q8_matmul.cpp`, through `model.quantize.Int8Linear`):
rows quantized per block of 32 times int8 tiles, against the same arithmetic in float64; every
row count and tile tail; a row alike in any batch and thread count; its checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from gptserve.kernels.cpu import native
from gptserve.model.activations import KERNEL_CODES, activate
from gptserve.model.quantize import Int8Linear, pack_q8_tiles, q8_ops, quantize_rows

OPS = q8_ops(32, torch.device("cpu")) if native.enabled() else None
pytestmark = pytest.mark.skipif(OPS is None, reason="no compiled vector kernels")


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of 32: (M, K) int8 values (amax / 127 steps, halves away from zero) and
    (M, K / 32) scales, as the kernel quantizes them."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127  # (M, K / 32)
    v = blocks * torch.where(d > 0, 1 / d, 0)[..., None]
    q = torch.where(v >= 0, v + 0.5, v - 0.5).trunc()
    return q.view_as(x), d


def _reference(x, q, scales, bias) -> torch.Tensor:
    """float64: sum over blocks of d * (exact integer sums), times the column's scale, + bias."""
    xq, d = _quantized_rows(x)
    blocks = torch.einsum("mbk,nbk->mnb", xq.double().view(x.shape[0], -1, 32),
                          q.double().view(q.shape[0], -1, 32))  # (M, N, blocks)  # fmt: skip
    y = (blocks * d.double()[:, None, :]).sum(-1) * scales.double()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
@pytest.mark.parametrize("out, width", [(96, 128), (40, 64), (232, 320), (7, 32)])
def test_multiplies_the_quantized_rows_by_the_int8_matrix(out, width, rows, with_bias):
    gen = torch.Generator().manual_seed(out + width + rows)
    q, scales = quantize_rows(torch.randn(out, width, generator=gen))
    bias = torch.randn(out, generator=gen) if with_bias else None
    x = torch.randn(rows, width, generator=gen)
    got = OPS.q8_matmul(x, pack_q8_tiles(q), scales, bias, out)
    want = _reference(x, q, scales, bias)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_the_activation_is_applied_after_the_bias(activation, with_bias):
    gen = torch.Generator().manual_seed(7)
    q, scales = quantize_rows(torch.randn(72, 96, generator=gen))
    bias = torch.randn(72, generator=gen) if with_bias else None
    x = torch.randn(5, 96, generator=gen)
    got = OPS.q8_matmul(x, pack_q8_tiles(q), scales, bias, 72, KERNEL_CODES[activation])
    want = activate(_reference(x, q, scales, bias), activation)
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())
    with pytest.raises(RuntimeError, match="activation must be"):
        OPS.q8_matmul(x, pack_q8_tiles(q), scales, bias, 72, 3)


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 70])
def test_a_row_is_the_same_in_any_batch_and_on_any_number_of_threads(rows):
    q, scales = quantize_rows(torch.randn(232, 256))
    codes = pack_q8_tiles(q)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    together = OPS.q8_matmul(x, codes, scales, None, 232)
    alone = torch.cat([OPS.q8_matmul(x[i : i + 1], codes, scales, None, 232) for i in range(rows)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(OPS.q8_matmul(x, codes, scales, None, 232), together)
    finally:
        torch.set_num_threads(threads)


def test_the_layout_is_tiles_of_32_columns_4_inputs_at_a_time():
    q, _ = quantize_rows(torch.randn(40, 64))
    codes = pack_q8_tiles(q)
    assert codes.shape == (2, 16, 32, 4)  # 40 columns -> 2 tiles; 64 inputs -> 16 quads
    assert codes[1, 3, 5, 2] == q[37, 14]  # tile 1, inputs 12-15, column 32 + 5, input 14
    assert torch.equal(codes[1, :, 8:], torch.zeros(16, 24, 4, dtype=torch.int8))  # padding


def test_the_layer_holds_tiles_reads_rows_from_them_and_dequantizes_many_rows():
    torch.manual_seed(0)
    linear = nn.Linear(64, 70)
    layer, plain = Int8Linear(linear), Int8Linear(linear, tiled=False)
    assert layer.q8 is not None and plain.q8 is None and "weight" not in dict(layer.named_buffers())
    assert torch.equal(layer.dense(), plain.dense()[:, :64])
    index = torch.tensor([[0, 33], [69, 5]])
    assert torch.equal(layer.rows(index), plain.rows(index))
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x), rtol=2e-2, atol=2e-2)
        layer.many_rows = 3  # from 3 rows on: the dequantized bfloat16 product, as plain's
        plain.many_rows = 3
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused():
    q, scales = quantize_rows(torch.randn(64, 64))
    op, codes = OPS.q8_matmul, pack_q8_tiles(q)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 48), codes, scales, None, 64)
    with pytest.raises(RuntimeError, match="K as x's width"):
        op(torch.randn(2, 96), codes, scales, None, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        op(torch.randn(2, 64), codes, scales, None, 100)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 64).bfloat16(), codes, scales, None, 64)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.randn(2, 64), codes, scales.bfloat16(), None, 64)
    with pytest.raises(ValueError, match="does not run here"):
        Int8Linear(nn.Linear(40, 8), tiled=True)  # 40 inputs: not whole blocks of 32


def test_a_nan_comes_out_as_nan_and_tiny_blocks_as_zeros():
    q, scales = quantize_rows(torch.randn(40, 64))
    codes = pack_q8_tiles(q)
    x = torch.randn(3, 64)
    x[0, 5] = float("nan")  # row 0: every output NaN
    x[1, :32] = 1e-35  # row 1: its first block counts as zeros
    got = OPS.q8_matmul(x, codes, scales, None, 40)
    assert got[0].isnan().all() and not got[1:].isnan().any()
    x[1, :32] = 0.0
    assert torch.equal(OPS.q8_matmul(x[1:2], codes, scales, None, 40), got[1:2])
