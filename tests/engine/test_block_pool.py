"""The block pool and the KV cache's prefix caching: sharing, copy-on-write, eviction, audits."""

import pytest
import torch
from gptserve.engine.block_manager import BlockAllocator, OutOfBlocks
from gptserve.model import GPT, ModelConfig

from tests.conftest import PagedCache


def test_allocator_hands_out_and_takes_back():
    alloc = BlockAllocator(6, order=[5, 3, 1, 0, 2, 4])
    assert alloc.allocate(2) == [5, 3]
    rest = alloc.allocate(4)
    assert sorted(rest) == [0, 1, 2, 4]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)
    alloc.free([3])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([3])  # never freed twice
    assert alloc.allocate(1) == [3]


def test_a_released_keyed_block_stays_cached_until_needed_then_the_oldest_goes_first():
    alloc = BlockAllocator(4)
    a, b, c, d = alloc.allocate(4)
    for block, key in ((a, "ka"), (b, "kb"), (c, "kc")):
        alloc.set_key(block, key)
    alloc.free([b, a, d])  # b released before a; d has no key: plain free
    assert alloc.num_free == 3 and alloc.num_cached == 2
    assert alloc.lookup("ka") == a and alloc.lookup("kb") == b
    assert alloc.allocate(1) == [d]  # free blocks go before cached ones
    assert alloc.allocate(1) == [b]  # then the least recently released cached block
    assert alloc.lookup("kb") is None and alloc.lookup("ka") == a
    alloc.hold(a)  # a prefix hit takes a back from the cache
    assert alloc.ref(a) == 1 and alloc.num_cached == 0
    alloc.hold(c)  # a live block shared by a second holder
    assert alloc.ref(c) == 2
    alloc.audit([a, b, c, c, d])


def test_audit_catches_a_torn_pool():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(2)
    alloc.audit(blocks)
    with pytest.raises(AssertionError, match="reference counts"):
        alloc.audit(blocks[:1])


def _cache(num_blocks: int, block_size: int = 4) -> PagedCache:
    return PagedCache((1, 1, 2), num_blocks, block_size)


def test_a_prompt_reuses_the_longest_run_of_matching_full_blocks():
    cache = _cache(16)
    first = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    assert cache.blocks.reuse_prefix(0, first) == 0
    cache.prepare([(0, len(first))])
    cache.blocks.register_full_blocks(0, first)
    table = cache.blocks.block_table(0)
    # the same first block only; then the same two blocks; then the whole prompt again
    assert cache.blocks.reuse_prefix(1, first[:4] + [1, 2, 3, 4, 5]) == 4
    assert cache.blocks.reuse_prefix(2, first[:8] + [9]) == 8
    assert cache.blocks.reuse_prefix(3, first) == 8  # a live sequence's partial block is not keyed
    # the second block matches in full, but one token is left to compute: 3 of its 4 tokens,
    # from a copy of the block (the sequence writes its own token after them)
    assert cache.blocks.reuse_prefix(4, first[:8]) == 7
    assert (
        cache.blocks.block_table(4)[0] == table[0] and cache.blocks.block_table(4)[1] not in table
    )
    cache.copy_pending()  # the copy is made before the next step's forward
    assert torch.equal(cache.pools.k[:, cache.blocks.block_table(4)[1]], cache.pools.k[:, table[1]])
    assert cache.blocks.reuse_prefix(5, [7] + first[1:]) == 0  # a different first token: no match
    assert cache.blocks.block_table(2) == table[:2]
    assert cache.blocks.allocator.ref(table[0]) == 5 and cache.blocks.allocator.ref(table[1]) == 3
    cache.blocks.audit()


def _filled(cache: PagedCache, seq: int, tokens: list[int]) -> list[int]:
    """Prefill `tokens` for `seq` (random keys and values) and register its blocks."""
    cache.prepare([(seq, len(tokens))])
    for block in cache.blocks.block_table(seq):
        cache.pools.k[:, block] = torch.randn_like(cache.pools.k[:, block])
    cache.blocks.register_full_blocks(seq, tokens)
    return cache.blocks.block_table(seq)


def test_a_released_partial_block_is_reused_token_by_token_from_a_copy():
    cache = _cache(16)
    first = list(range(100, 111))  # two full blocks, then 108 109 110 in the third
    table = _filled(cache, 0, first)
    cache.blocks.free(0)  # the partial block stays cached, keyed by its three tokens
    assert cache.blocks.allocator.num_cached == 3
    # the next turn: everything, then tokens of its own
    assert cache.blocks.reuse_prefix(1, first + [5, 6]) == 11
    copy = cache.blocks.block_table(1)[2]
    assert cache.blocks.block_table(1)[:2] == table[:2] and copy != table[2]
    cache.copy_pending()
    assert torch.equal(cache.pools.k[:, copy], cache.pools.k[:, table[2]])
    # a prompt that leaves the old one inside the partial block takes what matches
    assert cache.blocks.reuse_prefix(2, first[:9] + [7, 7]) == 9
    # and one that leaves it inside a full block takes that block's matching start
    assert cache.blocks.reuse_prefix(3, first[:6] + [7, 7]) == 6
    cache.blocks.audit()
    # the copies are the new sequences' own: writing there leaves the cached block as it was
    before = cache.pools.k[:, table[2]].clone()
    cache.prepare([(1, 2)])
    assert torch.equal(cache.pools.k[:, table[2]], before)
    assert cache.blocks.allocator.lookup(cache.blocks.index.keys_of(1)[-1]) == table[1]
    cache.blocks.audit()


def test_a_partial_block_is_keyed_only_when_its_last_holder_leaves_after_a_good_step():
    cache = _cache(16)
    first = list(range(100, 110))  # two full blocks and 108 109
    _filled(cache, 0, first)
    cache.blocks.fork(0, 1)  # a second completion holds the partial block too
    cache.blocks.free(0)
    assert cache.blocks.reuse_prefix(2, first + [1]) == 8  # still held by 1: not keyed
    cache.blocks.free(2)
    cache.blocks.free(1)
    assert cache.blocks.reuse_prefix(3, first + [1]) == 10  # its last holder left: keyed
    # a step that never registered (it failed): its tokens are not trusted
    cache.prepare([(3, 1)])
    cache.blocks.free(3)
    assert cache.blocks.reuse_prefix(4, first + [1, 2]) == 10
    cache.blocks.audit()


def test_partial_reuse_gives_the_logits_a_full_prefill_gives():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=97)).eval()
    cache = PagedCache(model, 16, 4)
    prompt = torch.randint(0, 97, (23,))  # five full blocks and three tokens
    turn = torch.cat([prompt[:22], torch.tensor([5, 6])])  # leaves it at its 23rd token
    with torch.no_grad():
        model.forward_cached(prompt, cache.pools, cache.prepare([(0, 23)]))
        cache.blocks.register_full_blocks(0, prompt.tolist())
        cache.blocks.free(0)
        full = model.forward_cached(turn, cache.pools, cache.prepare([(1, 24)]))  # (1, V)
        hit = cache.blocks.reuse_prefix(2, turn.tolist())
        assert hit == 22
        rest = model.forward_cached(turn[hit:], cache.pools, cache.prepare([(2, 24 - hit)]))
    torch.testing.assert_close(rest, full, atol=1e-5, rtol=1e-5)
    cache.blocks.audit()


def test_forks_share_blocks_and_copy_the_partial_one_on_write():
    cache = _cache(8)
    cache.prepare([(0, 6)])  # one full block, one partial
    cache.pools.k[0, cache.blocks.block_table(0)[1], :2] = 1.0  # what the parent wrote there
    cache.blocks.fork(0, 1)
    cache.blocks.fork(0, 2)
    parent = cache.blocks.block_table(0)
    assert cache.blocks.block_table(1) == parent and cache.blocks.allocator.ref(parent[1]) == 3
    assert cache.blocks.num_free_blocks == 6  # nothing copied yet
    meta = cache.prepare([(1, 1)])  # child 1 writes slot 6: into the shared partial block
    own = cache.blocks.block_table(1)
    assert own[0] == parent[0] and own[1] != parent[1]
    assert torch.equal(cache.pools.k[0, own[1], :2], cache.pools.k[0, parent[1], :2])  # a copy
    assert int(meta.slot_mapping[0]) // 4 == own[1]  # the write lands in the copy
    assert cache.blocks.allocator.ref(parent[1]) == 2
    cache.blocks.audit()
    for seq in (0, 1, 2):
        cache.blocks.free(seq)
    assert cache.blocks.num_free_blocks == 8
    cache.blocks.audit()


def test_without_prefix_caching_nothing_is_reused():
    cache = PagedCache((1, 1, 2), 8, 4, prefix_caching=False)
    cache.prepare([(0, 9)])
    cache.blocks.register_full_blocks(0, list(range(9)))
    assert cache.blocks.reuse_prefix(1, list(range(9))) == 0
    cache.blocks.free(0)
    assert cache.blocks.allocator.num_cached == 0


def test_a_cached_prefix_gives_the_logits_a_full_prefill_gives():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=97)).eval()
    cache = PagedCache(model, 16, 4)
    prompt = torch.randint(0, 97, (23,))
    with torch.no_grad():
        full = model.forward_cached(prompt, cache.pools, cache.prepare([(0, 23)]))  # (1, V)
        cache.blocks.register_full_blocks(0, prompt.tolist())
        hit = cache.blocks.reuse_prefix(1, prompt.tolist())
        assert hit == 20
        rest = model.forward_cached(prompt[hit:], cache.pools, cache.prepare([(1, 23 - hit)]))
    torch.testing.assert_close(rest, full, atol=1e-5, rtol=1e-5)
    cache.blocks.audit()


def test_a_released_prompt_loses_its_last_blocks_first_so_its_prefix_stays_reachable():
    cache = _cache(3)
    prompt = list(range(13))  # three full blocks of 4 and one more token
    cache.prepare([(0, 12)])
    cache.blocks.register_full_blocks(0, prompt)
    cache.blocks.free(0)
    cache.prepare([(2, 8)])  # room for someone else: two cached blocks are evicted
    assert cache.blocks.reuse_prefix(1, prompt) == 4  # the first block is the one left
    cache.blocks.audit()
