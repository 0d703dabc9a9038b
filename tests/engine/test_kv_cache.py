"""The paged KV cache: cached inference equals the full forward; the allocator never overlaps."""

import random

import pytest
import torch
from gptserve.engine.block_manager import BlockAllocator, OutOfBlocks
from gptserve.model import GPT, ModelConfig

from tests.conftest import PagedCache


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, block_size=96, n_layer=2, n_head=4, n_embd=32)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg)).eval()


@pytest.mark.parametrize(
    "variant",
    [{}, {"pos_encoding": "sinusoidal", "activation": "relu", "norm_position": "post"}],
    ids=["gpt2", "original"],
)
def test_prefill_then_decode_matches_full_forward(variant):
    model = _model(**variant)
    lengths = [1, 7, 8, 9, 23]  # below, at and across the 8-token block boundary
    steps = 12
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 97, (n + steps,), generator=gen) for n in lengths]
    order = list(range(64))
    random.Random(0).shuffle(order)
    cache = PagedCache(model, 64, 8, block_order=order)

    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]  # each (T, V)
        batch = cache.prepare([(i, n) for i, n in enumerate(lengths)])
        tokens = torch.cat([s[:n] for s, n in zip(seqs, lengths)])
        every = torch.arange(len(tokens))
        logits = model.forward_cached(tokens, cache.pools, batch, logits_index=every)
        start = 0
        for n, f in zip(lengths, full):
            torch.testing.assert_close(logits[start : start + n], f[:n], atol=1e-5, rtol=1e-4)
            start += n
        for step in range(steps):
            batch = cache.prepare([(i, 1) for i in range(len(seqs))])
            tokens = torch.stack([s[n + step] for s, n in zip(seqs, lengths)])
            logits = model.forward_cached(tokens, cache.pools, batch)
            for row, (n, f) in enumerate(zip(lengths, full)):
                torch.testing.assert_close(logits[row], f[n + step], atol=1e-5, rtol=1e-4)

    for i, n in enumerate(lengths):
        table = cache.blocks.block_table(i)
        assert len(table) == -(-(n + steps) // 8)
    used = [b for i in range(len(seqs)) for b in cache.blocks.block_table(i)]
    assert len(used) == len(set(used)), "two sequences share a block"


def test_extend_in_chunks_matches_full_forward():
    model = _model()
    seq = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(5))
    cache = PagedCache(model, 16, 8)
    with torch.no_grad():
        full = model(seq[None])[0]
        for lo, hi in [(0, 13), (13, 14), (14, 31), (31, 40)]:
            batch = cache.prepare([(0, hi - lo)])
            out = model.forward_cached(seq[lo:hi], cache.pools, batch)
            torch.testing.assert_close(out[0], full[hi - 1], atol=1e-5, rtol=1e-4)


def test_out_of_blocks_changes_nothing():
    model = _model()
    cache = PagedCache(model, 4, 8)
    cache.prepare([(0, 20)])  # 3 blocks
    k_before = cache.pools.k.clone()
    with pytest.raises(OutOfBlocks):
        cache.prepare([(1, 4), (2, 9)])  # needs 1 + 2 blocks, only 1 free
    assert cache.blocks.num_free_blocks == 1
    assert cache.blocks.seq_len(1) == 0 and cache.blocks.seq_len(2) == 0
    assert cache.blocks.seq_len(0) == 20
    assert torch.equal(cache.pools.k, k_before)
    cache.blocks.free(0)
    assert cache.blocks.num_free_blocks == 4


def test_allocator_hands_out_the_earliest_free_block_in_its_order():
    alloc = BlockAllocator(6, order=[5, 3, 1, 0, 2, 4])
    first = alloc.allocate(4)  # 5, 3, 1, 0
    alloc.free([3, 0])
    assert alloc.allocate(1) == [3]  # 3 comes before 0 in the order, wherever it was freed
    assert alloc.allocate(2) == [0, 2]
    plain = BlockAllocator(8)
    blocks = plain.allocate(6)
    plain.free(blocks[1:4])
    assert plain.allocate(2) == [1, 2]  # lowest ids first: the pool in use stays packed
    assert first == [5, 3, 1, 0]


def test_pools_store_each_block_and_head_as_one_tile_and_writes_land_in_their_slots():
    cache = PagedCache(_model(), 5, 4)
    n_layer, n_blocks, bs, n_head, head_dim = cache.pools.k.shape
    assert (n_blocks, bs) == (5, 4)
    assert (
        cache.pools.k.transpose(2, 3).is_contiguous()
        and cache.pools.v.transpose(2, 3).is_contiguous()
    )
    batch = cache.prepare([(0, 6)])  # slots 0..5: blocks 0 and 1
    k = torch.randn(6, n_head, head_dim)
    cache.pools.write(1, batch, k, -k)
    assert torch.equal(cache.pools.k[1, 0], k[:4]) and torch.equal(cache.pools.k[1, 1, :2], k[4:])
    assert torch.equal(cache.pools.v[1, 1, :2], -k[4:])
    assert not cache.pools.k[0].any() and not cache.pools.k[1, 1, 2:].any()
