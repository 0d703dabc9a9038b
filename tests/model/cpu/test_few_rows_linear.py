"""Few float32 rows by the compiled tiles, more by the wrapped layer: where each serves, the same
function, and where `optimize_for_cpu` installs it (not with `batch_invariant`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from gptserve.kernels.cpu import native
from gptserve.model import GPT
from gptserve.model.config import ModelConfig
from gptserve.model.cpu import optimize_for_cpu
from gptserve.model.cpu.few_rows_linear import (
    HEAD_FEW_ROWS,
    LAYER_FEW_ROWS,
    FewRowsLinear,
    compiled_tiles,
)
from gptserve.model.cpu.onednn_linear import OneDnnLinear

OPS = native.native_ops() if native.enabled() else None
pytestmark = pytest.mark.skipif(not compiled_tiles(OPS), reason="no compiled vector kernels")


class _Counting(nn.Module):
    """A stand-in for the many-rows layer that counts its calls."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear, self.calls = linear, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x.float())


def test_few_rows_take_the_tiles_and_more_the_wrapped_layer():
    torch.manual_seed(0)
    linear = nn.Linear(96, 70)
    many = _Counting(linear)
    layer = FewRowsLinear(linear, many, OPS, few_rows=4)
    with torch.no_grad():
        for shape in [(1, 96), (2, 2, 96), (4, 96)]:  # up to 4 rows, any leading shape
            x = torch.randn(shape)
            got = layer(x)
            assert got.shape == (*shape[:-1], 70)
            torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        assert many.calls == 0
        x = torch.randn(5, 96)
        assert torch.equal(layer(x), linear(x)) and many.calls == 1
        layer(torch.randn(2, 96).bfloat16())  # another dtype: the wrapped layer
        assert many.calls == 2


def _gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=301)
    return GPT(cfg).to(dtype).eval()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_an_optimized_gpt_gives_the_same_logits_for_few_and_many_rows(rows):
    model = _gpt()
    idx = torch.randint(0, 301, (1, rows))
    with torch.no_grad():
        before = model(idx)
        optimize_for_cpu(model, threads=2)
        after = model(idx)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    wrapped = [m for m in model.modules() if isinstance(m, FewRowsLinear)]
    assert len(wrapped) == 2 * 4 + 1  # each layer's four matrices and the head
    assert model.lm_head.few_rows == HEAD_FEW_ROWS
    assert {m.few_rows for m in model.transformer.h.modules() if isinstance(m, FewRowsLinear)} == {
        LAYER_FEW_ROWS
    }


def test_batch_invariant_and_bfloat16_models_keep_one_kernel():
    model = optimize_for_cpu(_gpt(), threads=2, batch_invariant=True)
    assert not any(isinstance(m, FewRowsLinear) for m in model.modules())
    if OneDnnLinear.supports(torch.bfloat16):
        model = optimize_for_cpu(_gpt(torch.bfloat16), threads=2)
        assert not any(isinstance(m, FewRowsLinear) for m in model.modules())
