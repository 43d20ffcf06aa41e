"""Paged decode attention over one extent's token blocks, the block tables it reads (a sliding window's,
several extents joined) and the fp32 accumulator its results fold into."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.pallas import paged_attention as _pa


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _paged_kernel_jit(q, k_blocks, v_blocks, block_table, num_blocks, scale, interpret, first_pos=None, start=None):
    return _pa.paged_decode_attention_kernel(q, k_blocks, v_blocks, block_table, num_blocks,
                                             scale=scale, interpret=interpret, first_pos=first_pos, start=start)


@functools.partial(jax.jit, static_argnames=("scale",))
def _paged_ref_jit(q, k_blocks, v_blocks, block_table, num_blocks, scale, first_pos=None, start=None):
    return _pa.paged_decode_attention_reference(q, k_blocks, v_blocks, block_table, num_blocks,
                                                scale=scale, first_pos=first_pos, start=start)


def window_block_table(block_table, num_blocks, first_pos, start, blk: int):
    """(table, count) without each row's leading blocks that end before start[b] (a sliding window's first
    position): a row's blocks are in position order, so those are a prefix; the rest move to the front."""
    m = block_table.shape[1]
    j = jnp.arange(m, dtype=jnp.int32)[None]
    ends = first_pos[jnp.clip(block_table, 0, first_pos.shape[0] - 1)] + blk  # [B, M] one past each block
    gone = jnp.sum((j < num_blocks[:, None]) & (ends <= start[:, None]), axis=1).astype(jnp.int32)
    table = jnp.take_along_axis(block_table, jnp.clip(j + gone[:, None], 0, m - 1), axis=1)
    return table, num_blocks - gone


def paged_decode_attention(q, k_blocks, v_blocks, block_table, num_blocks, *, first_pos=None, start=None,
                           scale=None, impl="auto", interpret=False):
    """Decode attention over K/V kept in fixed-size token blocks of one extent.

    q [B, n_heads, d]; k_blocks, v_blocks [E, n_kv, blk, d]; block_table [B, M] int32 of block
    indices into the first axis of k_blocks; num_blocks [B] int32 in [0, M]: row b attends the
    blocks block_table[b, :num_blocks[b]] (every listed block holds blk valid keys; the other
    entries are never read). A sliding window: first_pos [E] int32 (each block's first token position) and
    start [B] int32: keys at positions < start[b] are masked (a row's blocks must then be in position order:
    the blocks wholly before start are dropped from its table first, `window_block_table`, so the kernel
    walks the window's blocks only). scale defaults to d**-0.5. Returns (out [B, n_heads, d] in q.dtype,
    lse [B, n_heads] float32); num_blocks[b] == 0 gives out 0, lse -inf.
    """
    block_table = jnp.asarray(block_table, jnp.int32)
    num_blocks = jnp.asarray(num_blocks, jnp.int32)
    scale = None if scale is None else float(scale)
    window = ()
    if start is not None:
        first_pos, start = jnp.asarray(first_pos, jnp.int32), jnp.asarray(start, jnp.int32)
        if block_table.shape[1]:
            block_table, num_blocks = window_block_table(block_table, num_blocks, first_pos, start,
                                                         k_blocks.shape[2])
        window = (first_pos, start)
    if use_kernel(impl):  # per device on its heads under a tensor-parallel mesh
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        if not window:
            return _sh.per_shard(lambda q_, k_, v_, t_, n_: _paged_kernel_jit(q_, k_, v_, t_, n_, scale, interpret),
                                 (heads, heads, heads, rep, rep), (heads, heads))(q, k_blocks, v_blocks, block_table,
                                                                                   num_blocks)
        return _sh.per_shard(lambda q_, k_, v_, t_, n_, f_, s_: _paged_kernel_jit(q_, k_, v_, t_, n_, scale, interpret,
                                                                                  f_, s_),
                             (heads, heads, heads, rep, rep, rep, rep), (heads, heads))(
            q, k_blocks, v_blocks, block_table, num_blocks, *window)
    return _paged_ref_jit(q, k_blocks, v_blocks, block_table, num_blocks, scale, *window)


def join_block_tables(tables, counts, sizes):
    """One block table over extents laid end to end: extent e's blocks [E_e, ...] concatenated on axis 0 in
    order (sizes: the E_e). tables [B, M_e], counts [B] per extent (row b attends tables[e][b, :counts[e][b]]).
    Returns (table [B, sum M_e], count [B]): row b's blocks of extent 0, then extent 1, ..., indices offset into
    the joined blocks, packed at the front (paged_decode_attention reads a row's first count entries; the
    rest are 0, never read). One paged attention over the joined extents then attends what one call per
    extent did, in the same block order."""
    if len(tables) == 1:
        return jnp.asarray(tables[0], jnp.int32), jnp.asarray(counts[0], jnp.int32)
    offsets = [0]
    for e in sizes[:-1]:
        offsets.append(offsets[-1] + int(e))
    tables = [jnp.asarray(t, jnp.int32) for t in tables]
    counts = [jnp.clip(jnp.asarray(c, jnp.int32), 0, t.shape[1]) for c, t in zip(counts, tables)]
    rows = tables[0].shape[0]
    width = sum(t.shape[1] for t in tables)
    start = jnp.zeros((rows,), jnp.int32)
    values, dest = [], []
    for t, c, off in zip(tables, counts, offsets):
        j = jnp.arange(t.shape[1], dtype=jnp.int32)[None]
        values.append(t + off)
        dest.append(jnp.where(j < c[:, None], start[:, None] + j, width))  # past the end: dropped
        start = start + c
    joined = jnp.zeros((rows, width), jnp.int32).at[jnp.arange(rows)[:, None], jnp.concatenate(dest, 1)].set(
        jnp.concatenate(values, 1), mode="drop")
    return joined, start


merge_attention_into = jax.jit(_pa.merge_attention_into)
empty_attention = jax.jit(_pa.empty_attention)
