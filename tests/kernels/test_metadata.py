"""`AttentionMetadata.build`: each new token's position and pool slot, for a step of decodes
(one token a sequence, computed in Python) and for a step with prefills (tensor operations)."""

import torch
from gptserve.kernels.metadata import AttentionMetadata


def _expected(tables, lens, new, block_size):
    positions, slots = [], []
    for table, n, q in zip(tables, lens, new):
        for p in range(n - q, n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    return positions, slots


def test_positions_and_slots_of_decodes_and_of_prefills():
    tables = [[7, 2, 9], [4], [11, 3]]
    lens = [40, 5, 17]
    for new in ([1, 1, 1], [3, 1, 17]):  # decodes only, then prefills beside a decode
        meta = AttentionMetadata.build(tables, lens, new, block_size=16)
        positions, slots = _expected(tables, lens, new, 16)
        assert meta.positions.tolist() == positions and meta.slot_mapping.tolist() == slots
        assert meta.positions.dtype == meta.slot_mapping.dtype == torch.int64
        assert meta.block_tables.tolist() == [[7, 2, 9], [4, 0, 0], [11, 3, 0]]
