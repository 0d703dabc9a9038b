"""The compiled LoRA update (`kernels/cpu/lora_update.cpp`): each piece's (x @ A.T) @ B.T added
into its output columns of a run of rows and nowhere else, for few rows (its loops) and many
(PyTorch's products), on views of a step's rows; its checks."""

from __future__ import annotations

import pytest
import torch
from gptserve.kernels.cpu import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="GPTSERVE_NATIVE=0")

IN, OUT, RANK = 72, 200, 16
# (c0, c1, lo, hi): pieces of ranks 4, 8 and 4, 40 to 100 columns wide (blocks of 4, 2 and 1
# vectors of columns and a tail, on AVX-512 and AVX2 alike); no piece writes columns 40:60
SPANS = [(0, 4, 0, 40), (4, 12, 60, 100), (12, 16, 100, 200)]


def _op():
    ops = native.native_ops()
    assert ops is not None, "the CPU kernels did not build"
    return ops.lora_update_


def _weights(gen: torch.Generator) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    a_t = torch.randn(IN, RANK, generator=gen)  # (in, R)
    b_ts = [torch.randn(c1 - c0, hi - lo, generator=gen) for c0, c1, lo, hi in SPANS]
    return a_t, [n for span in SPANS for n in span], b_ts


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 16, 17, 40])  # loops up to 16, then ATen
def test_adds_each_pieces_update_into_its_columns_of_the_run(rows):
    gen = torch.Generator().manual_seed(rows)
    a_t, spans, b_ts = _weights(gen)
    x = torch.randn(rows + 4, IN, generator=gen)
    y = torch.randn(rows + 4, OUT, generator=gen)
    expected = y.double().clone()
    h = x[2 : 2 + rows].double() @ a_t.double()
    for (c0, c1, lo, hi), b_t in zip(SPANS, b_ts, strict=True):
        expected[2 : 2 + rows, lo:hi] += h[:, c0:c1] @ b_t.double()
    _op()(y[2 : 2 + rows], x[2 : 2 + rows], a_t, spans, b_ts)  # a run of rows: views
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[:, 40:60].double(), expected[:, 40:60])  # columns no piece has
    assert torch.equal(y[:2].double(), expected[:2])  # rows outside the run
    assert torch.equal(y[2 + rows :].double(), expected[2 + rows :])


def test_a_row_is_alike_whatever_run_it_is_in():
    gen = torch.Generator().manual_seed(0)
    a_t, spans, b_ts = _weights(gen)
    x, y = torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)
    together = y.clone()
    _op()(together, x, a_t, spans, b_ts)
    for r in range(8):
        alone = y[r : r + 1].clone()
        _op()(alone, x[r : r + 1], a_t, spans, b_ts)
        assert torch.equal(alone, together[r : r + 1])


def test_refuses_what_does_not_fit():
    gen = torch.Generator().manual_seed(1)
    a_t, spans, b_ts = _weights(gen)
    x, y = torch.randn(2, IN), torch.zeros(2, OUT)
    with pytest.raises(RuntimeError, match="does not fit its product"):
        _op()(y[:, :150], x, a_t, spans, b_ts)  # the third piece writes up to column 200
    with pytest.raises(RuntimeError, match="a_t"):
        _op()(y, x, a_t.T.contiguous().T, spans, b_ts)  # not contiguous
    with pytest.raises(RuntimeError, match="four numbers per piece"):
        _op()(y, x, a_t, spans[:-1], b_ts)
    with pytest.raises(RuntimeError, match="float32"):
        _op()(y.double(), x.double(), a_t, spans, b_ts)
