"""GGML's Q5_K and Q6_K super-blocks as the file stores them, and their weights in PyTorch.

Both hold 256 weights a super-block (a row of the matrix is whole super-blocks, one after
another):

- Q6_K, 210 bytes (6.5625 bits a weight): ql[128], each weight's low 4 bits; qh[64], its high 2
  bits; sixteen int8 scales, one per 16 weights; the float16 super scale d. A weight is
  d * scale * (q - 32) with q = low | high << 4 in 0..63. Each half of 128 weights takes 64 bytes
  of ql and 32 of qh: its four runs of 32 take their low bits from the low nibbles of ql[0:32],
  of ql[32:64], then the high nibbles of the same, and their high bits from bits 0-1, 2-3, 4-5
  and 6-7 of qh[0:32];
- Q5_K, 176 bytes (5.5 bits a weight): float16 d and dmin; 12 bytes of eight 6-bit scales sc and
  eight 6-bit mins m (packed as Q4_K's, `model.gguf.blocks`); qh[32], bit s of byte l being the
  fifth bit of weight l of sub-block s; qs[128], sub-blocks 2i and 2i + 1 being the low and high
  nibbles of bytes 32i..32i + 31. A weight of sub-block s (32 weights) is d * sc_s * q - dmin * m_s
  with q in 0..31.

`dequantize` computes the weights in float32 in the same order as the gguf package's reference
(d * scale first, then times q; Q5_K's dmin * m taken off after), so they are its values exactly;
the compiled kernels (kernels/cpu/kquant_matmul.cpp) compute them the same way.
"""

from __future__ import annotations

import numpy as np
import torch

SUPER = 256  # weights a super-block holds
BLOCK_BYTES = {"Q5_K": 176, "Q6_K": 210}
KQUANT_TYPES = tuple(BLOCK_BYTES)
KIND_CODES = {"Q5_K": 5, "Q6_K": 6}  # the compiled kernels' names for them


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of a row of `cols` weights; raises ValueError unless `cols` is whole super-blocks."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGML type {kind} is not a K-quant held here ({', '.join(KQUANT_TYPES)})")
    if cols % SUPER:
        raise ValueError(f"a {kind} row of {cols} weights is not whole super-blocks of {SUPER}")
    return cols // SUPER * BLOCK_BYTES[kind]


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """(rows, bytes per row) uint8 super-blocks -> (rows, cols) float32 weights, the file's."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCK_BYTES[kind])  # (rows, n, bytes)
    weights = _q6_k(b) if kind == "Q6_K" else _q5_k(b)  # (rows, n, 256)
    return weights.reshape(rows, -1)


def _half(pairs: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian bytes -> (...) float32."""
    return pairs.contiguous().view(torch.float16)[..., 0].float()


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """(rows, n, 210) -> (rows, n, 256)."""
    rows, n = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, n, 2, 1, 64)  # (rows, n, half, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(rows, n, 2, 128)
    qh = b[..., 128:192].reshape(rows, n, 2, 1, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(rows, n, 2, 128)
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(rows, n, 16, 16)
    scales = b[..., 192:208].contiguous().view(torch.int8).float()  # (rows, n, 16)
    d = _half(b[..., 208:210])  # (rows, n)
    return ((d[..., None] * scales)[..., None] * q).reshape(rows, n, SUPER)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """(rows, n, 176) -> (rows, n, 256)."""
    rows, n = b.shape[:2]
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # (rows, n)
    sc, mins = six_bit_scales(b[..., 4:16])  # (rows, n, 8)
    qh = b[..., 16:48].reshape(rows, n, 1, 32)
    high = torch.cat([(qh >> s) & 1 for s in range(8)], dim=2)  # (rows, n, 8, 32)
    qs = b[..., 48:176].reshape(rows, n, 4, 1, 32)
    low = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, n, 8, 32)
    q = (low | (high << 4)).float()
    scale, offset = d[..., None] * sc, dmin[..., None] * mins  # (rows, n, 8)
    return (scale[..., None] * q - offset[..., None]).reshape(rows, n, SUPER)


def six_bit_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) bytes -> eight 6-bit scales and eight 6-bit mins (..., 8) as float32 (bytes 0-3
    and 4-7 hold scales and mins 0-3 in their low 6 bits and the top 2 bits of 4-7; bytes 8-11
    the low 4 bits of scales 4-7, low nibble, and mins 4-7, high nibble)."""
    low_sc, low_min, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low_sc & 63, (extra & 15) | ((low_sc >> 6) << 4)], dim=-1)
    mins = torch.cat([low_min & 63, (extra >> 4) | ((low_min >> 6) << 4)], dim=-1)
    return sc.float(), mins.float()


def quantize(weights: np.ndarray, kind: str) -> np.ndarray:
    """(rows, cols) float weights -> their (rows, bytes per row) Q5_K or Q6_K blocks, rounded to
    nearest with each sub-block's scale (and Q5_K's min) from its range: simpler than llama.cpp's
    search for the best scales, for writing test and benchmark files."""
    rows, cols = weights.shape
    row_bytes(kind, cols)  # whole super-blocks
    w = weights.astype(np.float32).reshape(rows, cols // SUPER, SUPER)
    blocks = _quantize_q6_k(w) if kind == "Q6_K" else _quantize_q5_k(w)
    return blocks.reshape(rows, -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(...) float32 -> (..., 2) little-endian float16 bytes."""
    return values.astype("<f2")[..., None].view(np.uint8)


def _divide(w: np.ndarray, step: np.ndarray) -> np.ndarray:
    """w / step, 0 where the step is 0."""
    return np.divide(w, step, out=np.zeros_like(w), where=step != 0)


def _quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """(rows, n, 256) -> (rows, n, 210)."""
    rows, n = w.shape[:2]
    sub = w.reshape(rows, n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31  # (rows, n, 16): codes in -31..31 before rounding
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)  # (rows, n)
    sc = np.clip(np.rint(_divide(scale, d[..., None])), 0, 127)  # (rows, n, 16)
    step = d[..., None] * sc
    q = np.clip(np.rint(_divide(sub, step[..., None])), -32, 31).astype(np.int32) + 32
    q = q.reshape(rows, n, 2, 4, 32).astype(np.uint8)  # (half, run of 32, l)
    low, high = q & 15, q >> 4
    ql = np.stack([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], axis=3)  # fmt: skip
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)  # fmt: skip
    return np.concatenate(
        [
            ql.reshape(rows, n, 128),
            qh.reshape(rows, n, 64),
            sc.astype(np.int8).view(np.uint8),
            _f16_bytes(d),
        ],
        axis=-1,
    )


def _quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """(rows, n, 256) -> (rows, n, 176)."""
    rows, n = w.shape[:2]
    sub = w.reshape(rows, n, 8, 32)
    low_end = np.minimum(sub.min(axis=-1), 0)  # (rows, n, 8): w = a q - b with b = -low_end >= 0
    scale, offset = (sub.max(axis=-1) - low_end) / 31, -low_end
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)  # (rows, n)
    dmin = (offset.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[..., None])), 0, 63).astype(np.uint8)  # (rows, n, 8)
    m = np.clip(np.rint(_divide(offset, dmin[..., None])), 0, 63).astype(np.uint8)
    step, base = d[..., None] * sc, dmin[..., None] * m
    q = np.clip(np.rint(_divide(sub + base[..., None], step[..., None])), 0, 31).astype(np.uint8)
    packed = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )  # (rows, n, 12)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(
        axis=2, dtype=np.uint8
    )  # (rows, n, 32)
    pairs = q.reshape(rows, n, 4, 2, 32) & 15
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qh, qs], axis=-1)
