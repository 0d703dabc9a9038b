"""Which cached KV blocks hold which tokens: the prefix cache's index.

A full block is keyed by a digest of its tokens and of its parent block's key, so by every token
before it too (`block_key`); the key is set on the block in the pool (`BlockAllocator.set_key`),
which finds it again while nobody has evicted it. A sequence's last, partly filled block is keyed
the same way, with a key of its own kind, once the sequence lets go of it. Besides the digests the
index keeps each keyed block's tokens under its parent's key and its first token, so a new prompt
that diverges inside a block can still take the longest matching start of one (`best_partial`).

A cache salt isolates tenants (and LoRA adapters, `Salt`): the chain of a salted sequence starts from a root digested from
its salt (`salt_root`) instead of from nothing, so its blocks are keyed, found and matched token
by token only under that salt. Without this, how much of a prompt was cached (reported to the
client, and visible in its time to first token) would tell one tenant what another had sent.

The index holds no tensors: `engine.block_manager.BlockManager` owns the block tables and asks
the index what to reuse and what to key.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import lru_cache

from gptserve.engine.block_pool import BlockAllocator

# a sequence's cache salt (None: unsalted), or (salt, adapter) for a sequence of a LoRA adapter
# (`engine.adapters`: the adapter's load, a number never reused)
Salt = str | tuple[str | None, int] | None


@lru_cache(maxsize=1024)
def salt_root(salt: Salt) -> bytes | None:
    """The parent key of a salted sequence's first block (None: unsalted, the shared chain). An
    adapter's sequences are keyed under roots of their own kind: its rows compute other keys
    and values for the same tokens, so no block is shared across adapters or with the base."""
    if salt is None:
        return None
    if isinstance(salt, str):
        return hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=b"cache-salt").digest()
    tenant, adapter = salt
    digest = hashlib.blake2b(f"{adapter}".encode(), digest_size=16, person=b"lora-salt")
    digest.update(b"\0" + (tenant or "").encode("utf-8"))
    return digest.digest()


def block_key(parent: bytes | None, tokens: Sequence[int], partial: bool = False) -> bytes:
    """A block's key: a digest of its tokens and of its parent block's key. A cryptographic
    digest, so no prompt can be built to collide with another's cached blocks (Python's 64-bit
    hash() could be); partly filled blocks get keys of their own kind."""
    digest = hashlib.blake2b(parent or b"", digest_size=16, person=b"tail" if partial else b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class PrefixIndex:
    """Keys of every sequence's full blocks, the tokens of its partly filled one, and the tokens
    of every keyed block by (parent key, first token)."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._keys: dict[int, list[bytes]] = {}  # seq_id -> key of each of its full blocks
        self._roots: dict[int, bytes] = {}  # seq_id -> its salt's root (absent: unsalted)
        self._tails: dict[int, tuple[int, ...]] = {}  # seq_id -> tokens in its partial block
        self._tokens: dict[bytes, tuple[int, ...]] = {}  # a keyed block's tokens, by its key
        # keys of the keyed blocks after a parent key, by their first token (insertion order, so
        # the choice among equal matches does not depend on the process's hash seed)
        self._children: dict[tuple[bytes | None, int], dict[bytes, None]] = {}
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, tokens found there

    # ---- lookups ---------------------------------------------------------------------------

    def match_full_blocks(
        self, token_ids: Sequence[int], root: bytes | None = None
    ) -> tuple[list[bytes], list[int]]:
        """Keys and pool blocks of the longest run of cached full blocks under `root` (a salt's,
        or None) that starts token_ids, leaving at least one token uncovered."""
        bs = self.block_size
        keys: list[bytes] = []
        blocks: list[int] = []
        for i in range((len(token_ids) - 1) // bs):
            key = block_key(keys[-1] if keys else root, token_ids[i * bs : (i + 1) * bs])
            block = self.allocator.lookup(key)
            if block is None:
                break
            keys.append(key)
            blocks.append(block)
        return keys, blocks

    def best_partial(self, parent: bytes | None, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The cached block after `parent` whose tokens start most like `tokens`, and how many of
        them match; None when none matches a token."""
        if not tokens:
            return None
        best, matched = None, 0
        where = (parent, tokens[0])
        for key in list(self._children.get(where, ())):
            block = self.allocator.lookup(key)
            if block is None:  # evicted since
                self._forget(where, key)
                continue
            n = 0
            for mine, theirs in zip(tokens, self._tokens[key]):
                if mine != theirs:
                    break
                n += 1
            if n > matched:
                best, matched = block, n
        return None if best is None else (best, matched)

    def keys_of(self, seq_id: int) -> list[bytes]:
        return self._keys.get(seq_id, [])

    def _parent(self, seq_id: int, keys: list[bytes]) -> bytes | None:
        """The parent key of the block after `keys`, the sequence's keys so far."""
        return keys[-1] if keys else self._roots.get(seq_id)

    # ---- a sequence's keys -----------------------------------------------------------------

    def adopt(self, seq_id: int, keys: list[bytes], root: bytes | None = None) -> None:
        """A sequence starts with the keys of the cached blocks it reused, under its root."""
        self._keys[seq_id] = keys
        self._set_root(seq_id, root)

    def _set_root(self, seq_id: int, root: bytes | None) -> None:
        if root is None:
            self._roots.pop(seq_id, None)
        else:
            self._roots[seq_id] = root

    def fork(self, src: int, dst: int) -> None:
        self._keys[dst] = list(self._keys.get(src, []))
        self._set_root(dst, self._roots.get(src))
        if src in self._tails:
            self._tails[dst] = self._tails[src]

    def truncate(self, seq_id: int, length: int) -> None:
        del self._keys.setdefault(seq_id, [])[length // self.block_size :]
        self._tails.pop(seq_id, None)  # known again at the next `register`

    def drop(self, seq_id: int) -> None:
        self._keys.pop(seq_id, None)
        self._tails.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def register(
        self,
        seq_id: int,
        table: Sequence[int],
        seq_len: int,
        token_ids: Sequence[int],
        root: bytes | None = None,
        released: int = 0,
    ) -> None:
        """Key the sequence's newly filled blocks (its first seq_len tokens are token_ids')
        under its salt's root. Its first `released` blocks it no longer holds (out of every
        layer's window): their keys continue the chain, but no block is keyed by them."""
        keys = self._keys.setdefault(seq_id, [])
        self._set_root(seq_id, root)
        bs = self.block_size
        known = min(seq_len, len(token_ids))  # a finished sequence may know fewer
        for i in range(len(keys), known // bs):
            parent = self._parent(seq_id, keys)
            tokens = token_ids[i * bs : (i + 1) * bs]
            keys.append(block_key(parent, tokens))
            if i < released:  # not ours any more: whatever holds that block now is not this
                continue
            self.allocator.set_key(table[i], keys[-1])
            self._remember(parent, keys[-1], tokens)
        self._tails[seq_id] = tuple(token_ids[len(keys) * bs : known])

    def key_tail(self, seq_id: int, table: Sequence[int], seq_len: int) -> None:
        """Key a sequence's partly filled last block by its tokens, if it holds it alone and
        every token in it was computed by a step that succeeded (`register`)."""
        tail, keys = self._tails.get(seq_id), self._keys.get(seq_id, [])
        if not tail or len(keys) * self.block_size + len(tail) != seq_len:
            return
        if len(table) != len(keys) + 1 or self.allocator.ref(table[-1]) != 1:
            return
        parent = self._parent(seq_id, keys)
        key = block_key(parent, tail, partial=True)
        self.allocator.set_key(table[-1], key)
        if self.allocator.lookup(key) == table[-1]:
            self._remember(parent, key, tail)

    def count_query(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted prompt's lookup (for /metrics)."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit

    # ---- the token index -------------------------------------------------------------------

    def _remember(self, parent: bytes | None, key: bytes, tokens: Sequence[int]) -> None:
        """Index a keyed block's tokens under its parent's key (for `best_partial`)."""
        if key in self._tokens or not tokens:
            return
        self._tokens[key] = tuple(tokens)
        self._children.setdefault((parent, tokens[0]), {})[key] = None
        if len(self._tokens) > 2 * self.allocator.num_blocks:  # drop what eviction left behind
            for stale in [k for k in self._tokens if self.allocator.lookup(k) is None]:
                del self._tokens[stale]
            for where, children in list(self._children.items()):
                for stale in [k for k in children if k not in self._tokens]:
                    del children[stale]
                if not children:
                    del self._children[where]

    def _forget(self, where: tuple[bytes | None, int], key: bytes) -> None:
        self._tokens.pop(key, None)
        children = self._children.get(where)
        if children is not None:
            children.pop(key, None)
            if not children:
                del self._children[where]
