"""`KQuantLinear`: a GGUF file's Q5_K and Q6_K blocks held as they are, multiplied as the file's
dequantized weights (the gguf package's, the oracle) by every path: the compiled few-row kernel,
decoded weights and a float32 product for many rows, PyTorch's decoding where nothing is
compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gptserve.model.gguf.kquant_blocks import row_bytes
from gptserve.model.kquant_linear import KQuantLinear, kquant_compiled
from gptserve.model.quantize import is_quantized, keep_int8_kernel

from tests.model.gguf.test_kquant_blocks import oracle, random_blocks

KINDS = ("Q5_K", "Q6_K")
COMPILED = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not kquant_compiled(), reason="not built")),
]


def layer_and_weight(
    kind: str, out: int, cols: int, compiled: bool, bias: torch.Tensor | None = None
) -> tuple[KQuantLinear, torch.Tensor]:
    data = random_blocks(kind, out, cols, seed=out + cols)
    layer = KQuantLinear(torch.from_numpy(data), kind, cols, bias, compiled=compiled)
    return layer, torch.from_numpy(oracle(data, kind)).double()  # (out, cols)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within float32 rounding of sums over a few thousand products."""
    return bool((got.double() - want).abs().max() <= 1e-5 * want.abs().max())


@pytest.mark.parametrize("compiled", COMPILED, ids=["pytorch", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 40])  # 40: past `many_rows`, the decoded product
def test_multiplies_the_files_weights(kind: str, compiled: bool, rows: int) -> None:
    layer, weight = layer_and_weight(kind, 72, 512, compiled)
    assert layer.blocks.shape == (72, row_bytes(kind, 512)) and layer.blocks.dtype == torch.uint8
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = layer(x)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    assert close(got, x.double() @ weight.t())


@pytest.mark.parametrize("compiled", COMPILED, ids=["pytorch", "compiled"])
def test_bias_batches_and_dtype(compiled: bool) -> None:
    bias = torch.randn(40, generator=torch.Generator().manual_seed(0))
    data = random_blocks("Q6_K", 40, 256, seed=4)
    layer = KQuantLinear(torch.from_numpy(data), "Q6_K", 256, bias, torch.bfloat16, compiled)
    weight = torch.from_numpy(oracle(data, "Q6_K")).double()
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    got = layer(x.to(torch.bfloat16))
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    want = x.to(torch.bfloat16).double() @ weight.t() + bias.to(torch.bfloat16).double()
    assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()  # bfloat16's step


@pytest.mark.parametrize("compiled", COMPILED, ids=["pytorch", "compiled"])
def test_the_decoded_product_in_chunks_is_the_whole(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer, weight = layer_and_weight("Q5_K", 100, 768, compiled)
    layer.many_rows = 1  # always the decoded product
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(2))
    whole = layer(x)
    monkeypatch.setattr(
        "gptserve.model.kquant_linear.CHUNK_ELEMENTS", 768 * 32
    )  # 32 rows at a time
    assert torch.equal(layer(x), whole)
    assert close(whole, x.double() @ weight.t())


def test_keep_int8_kernel_keeps_the_few_row_kernel() -> None:
    layer, _ = layer_and_weight("Q6_K", 32, 256, compiled=None)
    model = torch.nn.Sequential(layer)
    assert is_quantized(model) and layer.many_rows is not None
    keep_int8_kernel(model)
    assert layer.many_rows is None


def test_blocks_of_the_wrong_width_are_refused() -> None:
    data = torch.from_numpy(random_blocks("Q6_K", 8, 512))
    with pytest.raises(ValueError, match=r"\(out, 210\) uint8"):
        KQuantLinear(data, "Q6_K", 256)
    with pytest.raises(ValueError, match="whole super-blocks"):
        KQuantLinear(data, "Q6_K", 500)
    np.testing.assert_array_equal(KQuantLinear(data, "Q6_K", 512).blocks.numpy(), data.numpy())
