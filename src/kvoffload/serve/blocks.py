"""Host bookkeeping of the serving cache's blocks: the allocator, reference counts and the prefix cache.

Nothing here touches a device. Block ids index the first axis of the device block store (`serve/cache.py`);
block 0 is a scratch block that writes nobody reads go to, so ids handed out start at 1.

A full prompt block is keyed by a chained hash: the hash of the previous block's key and this block's
tokens, rooted in what makes K/V differ (model, dtype, storage form, block size). Equal keys therefore mean
equal K/V, so a new request reuses the blocks of its longest cached prefix. A block's reference count is the
number of running requests whose table holds it; at zero a hashed block stays cached (evictable, least
recently used first) while the cached bytes stay within the budget, and an unhashed one goes straight back
to the free list.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable, Sequence

SCRATCH = 0


def root_key(*parts) -> bytes:
    """The chain's root: every part that changes the K/V a token sequence produces."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def block_keys(root: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """The chained key of each full block of `tokens` (a trailing partial block has none)."""
    keys, prev = [], root
    for i in range(len(tokens) // block_tokens):
        chunk = tokens[i * block_tokens:(i + 1) * block_tokens]
        prev = hashlib.blake2b(prev + b"|" + ",".join(map(str, chunk)).encode(), digest_size=16).digest()
        keys.append(prev)
    return keys


class BlockAllocator:
    """Free list, reference counts and the LRU prefix cache over blocks 1..num_blocks.

    cache_blocks: the most unreferenced blocks kept cached (the byte budget divided by a block's bytes);
    0 turns prefix reuse off."""

    def __init__(self, num_blocks: int, cache_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the serving cache needs at least one block, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.cache_blocks = max(0, int(cache_blocks))
        self.free: list[int] = list(range(self.num_blocks, 0, -1))  # pop() hands out the lowest id first
        self.ref = [0] * (self.num_blocks + 1)
        self.key_of: dict[int, bytes] = {}  # block -> its key (hashed blocks only)
        self.block_of: dict[bytes, int] = {}  # key -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first
        self.hits = 0  # blocks reused from the cache, over the allocator's life

    # -- what is available -------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks an allocation can get now: the free ones and the evictable cached ones."""
        return len(self.free) + len(self.lru)

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `keys` (not acquired)."""
        out = []
        for k in keys:
            b = self.block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    # -- taking and giving back --------------------------------------------------------------------

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each of `blocks` (cached blocks leave the evictable list)."""
        for b in blocks:
            if self.ref[b] == 0:
                if b not in self.lru:
                    raise RuntimeError(f"block {b} is neither referenced nor cached")
                del self.lru[b]
                self.hits += 1
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with one reference each, evicting least recently used cached blocks when the free
        list runs short; None (and nothing taken) when fewer than n are available."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if not self.free:
                self._evict_one()
            b = self.free.pop()
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less to each of `blocks`; unreferenced ones are cached (hashed) or freed."""
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.key_of and self.cache_blocks:
                    self.lru[b] = None  # most recently used end
                else:
                    self._forget(b)
                    self.free.append(b)
        while len(self.lru) > self.cache_blocks:
            self._evict_one()

    def register(self, block: int, key: bytes) -> bool:
        """Records that referenced `block` holds the K/V of `key`. False (nothing recorded) when the key is
        cached already (another request computed the same prefix meanwhile) or the block has a key."""
        if not self.cache_blocks or key in self.block_of or block in self.key_of:
            return False
        if self.ref[block] <= 0:
            raise RuntimeError(f"block {block} registered while unreferenced")
        self.key_of[block], self.block_of[key] = key, block
        return True

    def _evict_one(self) -> None:
        b, _ = self.lru.popitem(last=False)
        self._forget(b)
        self.free.append(b)

    def _forget(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None:
            del self.block_of[key]

    # -- invariants (tests) ------------------------------------------------------------------------

    def check(self, tables: Iterable[Sequence[int]] = ()) -> None:
        """Raises AssertionError unless every block is exactly one of free / cached / referenced, the
        reference counts equal the tables' holdings, and keys and blocks map one to one."""
        held = [0] * (self.num_blocks + 1)
        for t in tables:
            for b in t:
                held[b] += 1
        assert SCRATCH not in self.free and held[SCRATCH] == 0, "the scratch block was handed out"
        free, cached = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "a block is twice on the free list"
        for b in range(1, self.num_blocks + 1):
            states = (b in free) + (b in cached) + (self.ref[b] > 0)
            assert states == 1, f"block {b}: free={b in free} cached={b in cached} ref={self.ref[b]}"
            assert self.ref[b] == held[b], f"block {b}: ref {self.ref[b]} but held by {held[b]} tables"
            assert b not in cached or b in self.key_of, f"cached block {b} has no key"
        assert len(self.lru) <= self.cache_blocks, "more blocks cached than the budget"
        assert all(self.block_of[k] == b for b, k in self.key_of.items()), "key map out of step"
        assert len(self.block_of) == len(self.key_of), "key map out of step"
