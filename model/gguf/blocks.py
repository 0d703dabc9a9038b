"""GGML's 4- and 8-bit block formats read as int4 groups of 32: a code, a scale, a zero point.

PyTorch's int4 CPU product (`model.int4_linear`) computes each weight of a group of 32 as
`(code - 8) * scale + zero` with codes in 0..15. Three GGML formats are exactly that form:

- Q4_0, blocks of 32: an f16 scale d, then 16 bytes of codes; w = d * (q - 8), so scale d, zero 0;
- Q4_1, blocks of 32: f16 d and m, then 16 bytes of codes; w = d * q + m, so scale d and zero
  m + 8d;
- Q4_K, super-blocks of 256: f16 d and dmin, 12 bytes holding eight 6-bit scales and eight 6-bit
  mins, then 128 bytes of codes; sub-block j of 32 has w = d * sc_j * q - dmin * m_j, so scale
  d * sc_j and zero 8 * d * sc_j - dmin * m_j.

In all three a block's 16 bytes of codes hold 32 codes as low nibbles (the first 16) then high
nibbles (the next 16); Q4_K's 128 bytes are four such runs of 32 bytes, each covering two
sub-blocks. Scales and zeros come out in float32, computed from the f16 fields without rounding
(an f16 times a 6-bit integer fits float32's mantissa).

Q8_0 (blocks of 32: an f16 scale d, then 32 int8 values q) becomes two groups per block, exactly:
q = 16 * hi + lo with hi = q >> 4 in -8..7 and lo = q & 15, so d * q is the group (hi + 8, scale
16d, zero 0) plus the group (lo, scale d, zero 8d). The matrix is then twice as wide, each block's
high group before its low one, and each input feeds both (`Int4Linear`'s `input_copies=2`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # weights per scale and zero point
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # exactly int4 groups
SPLIT_TYPES = ("Q8_0",)  # exactly two int4 groups per block
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


@dataclass
class Int4Groups:
    """A matrix as int4 groups: w[r, c] = (codes[r, c] - 8) * scales[r, g] + zeros[r, g] with
    g = c // GROUP."""

    codes: np.ndarray  # (rows, cols) uint8 in 0..15
    scales: np.ndarray  # (rows, cols // GROUP) float32
    zeros: np.ndarray  # (rows, cols // GROUP) float32

    def dequantize(self) -> np.ndarray:
        """(rows, cols) float32, for checks."""
        rows, cols = self.codes.shape
        codes = self.codes.reshape(rows, cols // GROUP, GROUP).astype(np.float32) - 8
        return (codes * self.scales[..., None] + self.zeros[..., None]).reshape(rows, cols)

    @staticmethod
    def concat(parts: list[Int4Groups]) -> Int4Groups:
        """The parts' rows one after another (a joined q/k/v or gate/up matrix)."""
        return Int4Groups(
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scales for p in parts]),
            np.concatenate([p.zeros for p in parts]),
        )


def int4_groups(data: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Groups:
    """A Q4_0, Q4_1 or Q4_K matrix's bytes (rows, bytes per row) as int4 groups of `shape`."""
    if kind not in INT4_TYPES:
        raise ValueError(f"GGML type {kind} is not an int4 group format ({', '.join(INT4_TYPES)})")
    rows, cols = shape
    if cols % _BLOCK_WEIGHTS[kind]:
        raise ValueError(f"a {kind} row of {cols} weights is not whole blocks")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[kind])
    if kind == "Q4_K":
        return _q4_k(blocks, rows, cols)
    d = _f16(blocks[..., 0:2])  # (rows, blocks)
    if kind == "Q4_0":
        zeros = np.zeros_like(d)
        nibbles = blocks[..., 2:18]
    else:
        zeros = _f16(blocks[..., 2:4]) + 8 * d
        nibbles = blocks[..., 4:20]
    return Int4Groups(_unpack(nibbles).reshape(rows, cols), d, zeros)


def q8_0_split_groups(data: np.ndarray, shape: tuple[int, int]) -> Int4Groups:
    """A Q8_0 matrix (rows, cols) as int4 groups (rows, 2 * cols): per block of 32, the group of
    its high nibbles, then the group of its low nibbles (module docstring)."""
    rows, cols = shape
    if cols % GROUP:
        raise ValueError(f"a Q8_0 row of {cols} weights is not whole blocks")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, 34)
    d = _f16(blocks[..., 0:2])  # (rows, blocks)
    q = blocks[..., 2:34].view(np.int8)  # (rows, blocks, 32)
    high = (q >> 4) + 8  # arithmetic shift: -8..7, as a code 0..15
    low = q & 15
    codes = np.stack([high, low], axis=2).astype(np.uint8)  # (rows, blocks, 2, 32)
    scales = np.stack([16 * d, d], axis=2)  # (rows, blocks, 2)
    zeros = np.stack([np.zeros_like(d), 8 * d], axis=2)
    return Int4Groups(
        codes.reshape(rows, 2 * cols), scales.reshape(rows, -1), zeros.reshape(rows, -1)
    )


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> Int4Groups:
    """Super-blocks (rows, n, 144) -> groups of 32: eight per super-block."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # (rows, n)
    sc, mins = _six_bit_scales(blocks[..., 4:16])  # (rows, n, 8) each
    scales = d[..., None] * sc  # (rows, n, 8)
    zeros = 8 * scales - dmin[..., None] * mins
    runs = blocks[..., 16:144].reshape(rows, -1, 4, 32)  # four runs of 32 bytes: 2 sub-blocks each
    codes = np.stack([runs & 0x0F, runs >> 4], axis=3)  # (rows, n, 4, 2, 32): sub-block 2i, 2i+1
    return Int4Groups(codes.reshape(rows, cols), scales.reshape(rows, -1), zeros.reshape(rows, -1))


def _six_bit_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., 12) bytes -> eight 6-bit scales and eight 6-bit mins (..., 8), as float32.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 keep
    their low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits in the
    top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    low_sc, low_min, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low_sc & 0x3F, (extra & 0x0F) | ((low_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_min & 0x3F, (extra >> 4) | ((low_min >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _unpack(nibbles: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: the low nibbles, then the high nibbles."""
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """(..., 2) little-endian bytes -> (...) float32."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)
