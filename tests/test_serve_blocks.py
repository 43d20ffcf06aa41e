"""The serving cache's host bookkeeping (serve/blocks.py) under random request traffic: no block leaked, none
freed or overwritten while referenced or cached, none shared between requests whose prefixes differ."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from kvoffload.serve.blocks import BlockAllocator, block_keys, root_key  # noqa: E402

BLK = 4
ROOT = root_key("tiny", "float32", "device", BLK)

# a request: a prompt over a 2-token alphabet (so prefixes collide often) and the blocks it reserves beyond it
requests = st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=14), st.integers(0, 3))
ops = st.lists(st.one_of(st.tuples(st.just("admit"), requests), st.tuples(st.just("leave"), st.integers(0, 50))),
               max_size=60)


def _admit(alloc, content, prompt, extra):
    """What the scheduler does: reuse the longest cached prefix, allocate the rest, 'write' the new full
    blocks (content) and register them. Returns (table, keys) or None when it does not fit now."""
    keys = block_keys(ROOT, prompt, BLK)
    prefix = alloc.lookup(keys[:(len(prompt) - 1) // BLK])
    for b, k in zip(prefix, keys):
        assert content.get(b) == k, f"block {b} reused for a prefix it does not hold"
    alloc.acquire(prefix)
    fresh = alloc.allocate(len(keys) + extra - len(prefix))
    if fresh is None:
        alloc.release(prefix)
        return None
    for b in fresh:
        content[b] = None  # a fresh block's old K/V are gone (it will be overwritten)
    table = prefix + fresh
    for j in range(len(prefix), len(keys)):
        content[table[j]] = keys[j]
        alloc.register(table[j], keys[j])
    return table, keys


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), cache_blocks=st.integers(0, 12), ops=ops)
def test_allocator_under_random_traffic(num_blocks, cache_blocks, ops):
    alloc = BlockAllocator(num_blocks, cache_blocks)
    content: dict[int, bytes | None] = {}  # what each block holds, as the device would
    running: list[tuple[list[int], list[bytes]]] = []
    for op, arg in ops:
        if op == "admit":
            got = _admit(alloc, content, *arg)
            if got is not None:
                running.append(got)
        elif running:
            table, _ = running.pop(arg % len(running))
            alloc.release(table)
        alloc.check(t for t, _ in running)
        # a block two requests hold sits at the same position of both and holds their common prefix
        where: dict[int, tuple[int, list[bytes]]] = {}
        for table, keys in running:
            for j, b in enumerate(table):
                if b in where:
                    j0, keys0 = where[b]
                    assert j0 == j and j < len(keys) and keys0[:j + 1] == keys[:j + 1], f"block {b} shared wrongly"
                where[b] = (j, keys)
        # every cached key still maps to a block holding it
        for k, b in alloc.block_of.items():
            assert content.get(b) == k
    for table, _ in running:
        alloc.release(table)
    alloc.check()
    assert alloc.available() == num_blocks  # nothing leaked


def test_refcount_misuse_is_refused():
    alloc = BlockAllocator(2, 2)
    (b,) = alloc.allocate(1)
    alloc.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        alloc.release([b])
    assert alloc.allocate(3) is None and alloc.available() == 2  # nothing taken on a refusal


def test_lru_eviction_order_and_budget():
    alloc = BlockAllocator(4, 2)
    blocks = alloc.allocate(3)
    for i, b in enumerate(blocks):
        alloc.register(b, bytes([i]))
    alloc.release(blocks)  # three unreferenced hashed blocks, budget two: the oldest goes
    assert alloc.lookup([bytes([0])]) == [] and len(alloc.lru) == 2
    alloc.acquire(alloc.lookup([bytes([1])]))  # block of key 1 in use again: key 2 is now the oldest cached
    fresh = alloc.allocate(3)  # the two free blocks first, then the LRU one
    assert fresh[-1] == blocks[2] and alloc.lookup([bytes([2])]) == [] and alloc.lookup([bytes([1])]) == [blocks[1]]
    alloc.check([[blocks[1]], fresh])
