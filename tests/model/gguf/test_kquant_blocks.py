"""Q5_K and Q6_K super-blocks (`model.gguf.kquant_blocks`): PyTorch's decoding against the gguf
package's dequantization (the oracle), the quantizer the tests and benchmarks write files with."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gptserve.model.gguf.kquant_blocks import BLOCK_BYTES, dequantize, quantize, row_bytes

gguf = pytest.importorskip("gguf")
KINDS = ("Q5_K", "Q6_K")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) random `kind` blocks: every code, sub-block scale and min random,
    the float16 super scales (d, and Q5_K's dmin) random in 1e-4..1e-2, of either sign for
    Q6_K's d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)

    def halves(sign: bool) -> np.ndarray:
        values = rng.uniform(1e-4, 1e-2, size=(rows, cols // 256))
        if sign:
            values *= rng.choice([-1.0, 1.0], size=values.shape)
        return values.astype("<f2")[..., None].view(np.uint8)

    if kind == "Q6_K":  # ql, qh, scales, then d
        blocks[..., 208:210] = halves(True)
    else:  # d, dmin first
        blocks[..., 0:2], blocks[..., 2:4] = halves(False), halves(False)
    return blocks.reshape(rows, -1)


def oracle(data: np.ndarray, kind: str) -> np.ndarray:
    """The gguf package's dequantization: (rows, cols) float32."""
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    return values.astype(np.float32).reshape(data.shape[0], -1)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_is_the_gguf_packages_to_the_bit(kind: str) -> None:
    data = random_blocks(kind, 24, 768)
    got = dequantize(torch.from_numpy(data), kind)
    assert got.dtype == torch.float32 and got.shape == (24, 768)
    assert np.array_equal(got.numpy(), oracle(data, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rounds_each_weight_to_its_sub_blocks_step(kind: str) -> None:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    w[3, :256] = 0  # a super-block of zeros: scale 0, no division by it
    data = quantize(w, kind)
    assert data.shape == (16, row_bytes(kind, 512)) and data.dtype == np.uint8
    back = oracle(data, kind)
    assert np.all(back[3, :256] == 0)
    sub = 16 if kind == "Q6_K" else 32
    spans = w.reshape(16, -1, sub)
    # a step is the sub-block's range over the codes' count, its scale rounded to 6 or 7 bits
    step = (np.abs(spans).max(-1) / 31 if kind == "Q6_K" else np.ptp(spans, -1) / 31) * 1.1
    error = np.abs(back - w).reshape(16, -1, sub).max(-1)
    assert np.all(error <= step / 2 + 1e-3 * np.abs(w).max())
    assert np.linalg.norm(back - w) <= (0.03 if kind == "Q6_K" else 0.06) * np.linalg.norm(w)


def test_rows_must_be_whole_super_blocks() -> None:
    assert row_bytes("Q6_K", 512) == 420 and row_bytes("Q5_K", 256) == 176
    with pytest.raises(ValueError, match="whole super-blocks"):
        row_bytes("Q6_K", 576)
    with pytest.raises(ValueError, match="not a K-quant"):
        row_bytes("Q4_K", 256)
