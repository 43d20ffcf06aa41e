"""Paged decode attention (one query token per sequence) over a pool of fixed-size token blocks.

K/V live in an extent of E blocks, k_blocks and v_blocks each [E, n_kv, blk, d]. Row b of the batch
owns the blocks block_table[b, :num_blocks[b]] (in sequence order); every listed block holds blk
valid keys. Entries past num_blocks[b] are never read.

Kernel: one program per (batch row, kv head, split of the table); it walks its share of the row's
table entries, loads each block straight from the pool with a dynamic first index (no gather copy),
runs the shared online softmax over all G query heads of the kv head at once, and writes a partial
(out, lse); the splits are merged by the decode kernel's merge. blk, d and G need not be powers of
two: the tiles are padded to powers of two and the padding masked (Triton's block-shape rule).

The pure-jnp reference gathers the blocks into a dense [B, n_kv, M*blk, d] cache and calls the
dense decode reference, so reference and dense decode agree by construction.

Also here: the exact pairwise merge with an fp32 accumulator that folds per-extent results left to
right (``merge_attention_into``) and its empty accumulator (``empty_attention``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.errors import KVOffloadError
from kvoffload.pallas.common import (
    NEG_INF,
    decode_tiles,
    default_scale,
    dot,
    load,
    next_pow2,
    online_softmax_init,
    online_softmax_step,
    softmax_stats_to_out,
    split_blocks,
)
from kvoffload.pallas.decode_attention import (
    _attend_masked,
    decode_attention_reference,
    flash_decode,
    load_padded,
)


class PagedLayoutError(KVOffloadError, ValueError):
    """The arrays given to paged attention do not describe one block pool and one table."""


def check_paged_shapes(q, k_blocks, v_blocks, block_table, num_blocks):
    """Validate the shapes of a paged-attention call; returns (B, H, d, E, n_kv, blk, M, G)."""
    if q.ndim != 3 or k_blocks.ndim != 4:
        raise PagedLayoutError(
            f"paged attention wants q [B, n_heads, d] and k_blocks [E, n_kv, blk, d]; got q "
            f"{tuple(q.shape)}, k_blocks {tuple(k_blocks.shape)}")
    B, H, d = q.shape
    E, n_kv, blk, dk = k_blocks.shape
    if tuple(v_blocks.shape) != tuple(k_blocks.shape):
        raise PagedLayoutError(f"v_blocks {tuple(v_blocks.shape)} must have k_blocks' shape "
                               f"{tuple(k_blocks.shape)}")
    if dk != d or H % n_kv:
        raise PagedLayoutError(
            f"q {tuple(q.shape)} does not fit k_blocks {tuple(k_blocks.shape)}: head dims must "
            f"match and n_heads must be a multiple of n_kv")
    if block_table.ndim != 2 or block_table.shape[0] != B or tuple(num_blocks.shape) != (B,):
        raise PagedLayoutError(
            f"block_table must be [B={B}, M] and num_blocks [B={B}]; got "
            f"{tuple(block_table.shape)} and {tuple(num_blocks.shape)}")
    return B, H, d, E, n_kv, blk, block_table.shape[1], H // n_kv


def _no_keys(q):
    """The result of attending no keys (a table with no columns): out 0 in q.dtype, lse -inf."""
    out, lse = empty_attention(q)
    return out.astype(q.dtype), lse


# ----------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------


def paged_decode_attention_reference(q, k_blocks, v_blocks, block_table, num_blocks, *,
                                     scale=None, first_pos=None, start=None):
    """Pure-jnp paged decode attention. See :func:`kvoffload.ops.paged_decode_attention`."""
    B, H, d, E, n_kv, blk, M, G = check_paged_shapes(q, k_blocks, v_blocks, block_table,
                                                     num_blocks)
    if M == 0:
        return _no_keys(q)
    table = jnp.clip(block_table.astype(jnp.int32), 0, E - 1)

    def dense(blocks):  # [E, n_kv, blk, d] -> [B, n_kv, M*blk, d], the row's blocks in order
        g = blocks[table]  # [B, M, n_kv, blk, d]
        return g.transpose(0, 2, 1, 3, 4).reshape(B, n_kv, M * blk, d)

    lengths = jnp.clip(num_blocks.astype(jnp.int32), 0, M) * blk
    if start is None:
        return decode_attention_reference(q, dense(k_blocks), dense(v_blocks), lengths, scale=scale)
    # a sliding window: each key's position (its block's first position + its row) against the window's first
    pos = (first_pos.astype(jnp.int32)[table][:, :, None] + jnp.arange(blk, dtype=jnp.int32)).reshape(B, M * blk)
    valid = (jnp.arange(M * blk)[None] < lengths[:, None]) & (pos >= start.astype(jnp.int32)[:, None])
    out, lse = _attend_masked(q.reshape(B, n_kv, G, d), dense(k_blocks), dense(v_blocks), valid[:, None],
                              default_scale(d, scale))
    return out.reshape(B, H, d).astype(q.dtype), lse.reshape(B, H)


# ----------------------------------------------------------------------------
# exact pairwise merge (fp32 accumulator)
# ----------------------------------------------------------------------------


def empty_attention(q):
    """The empty accumulator for ``merge_attention_into``: out zeros f32 [B, n_heads, d] and
    lse -inf f32 [B, n_heads] (attention over no keys)."""
    return (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], NEG_INF, jnp.float32))


def merge_attention_into(acc, part):
    """Fold one partial attention over a disjoint key set into an fp32 accumulator.

    acc = (out f32 [..., d], lse f32 [...]); part = (out any float dtype, lse f32 [...]).
    Returns the merged (out f32, lse f32). With m = max(lse_acc, lse_part) the weights
    exp(lse - m) are exactly 1 and 0 when one side is empty (lse -inf), and the selects below
    return that side's arrays untouched, so: folding an empty part is a bitwise no-op, and
    folding into the empty accumulator returns the part bitwise (out cast to f32).
    """
    o1, l1 = acc
    o2 = part[0].astype(jnp.float32)
    l2 = part[1].astype(jnp.float32)
    o1 = o1.astype(jnp.float32)
    l1 = l1.astype(jnp.float32)
    m = jnp.maximum(l1, l2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w1 = jnp.exp(l1 - m_safe)  # exp(-inf) = 0 exactly, exp(0) = 1 exactly
    w2 = jnp.exp(l2 - m_safe)
    out, lse = softmax_stats_to_out(o1 * w1[..., None] + o2 * w2[..., None], w1 + w2, m_safe)
    # one side weighs nothing: keep the other bit for bit (even its -0.0s)
    keep1 = (w2 == 0.0)[..., None]
    keep2 = ((w1 == 0.0) & (w2 != 0.0))[..., None]
    out = jnp.where(keep1, o1, jnp.where(keep2, o2, out))
    lse = jnp.where(w2 == 0.0, l1, jnp.where(w1 == 0.0, l2, lse))
    return out, lse


# ----------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------


def _paged_kernel(
    nb_ref, table_ref, *refs, scale, blocks_per_split, blk, blkp, d, dp, G, Gp, M, E, windowed=False,
):
    # nb_ref [1] (num_blocks of this row); table_ref [M]; windowed: then start_ref [1] (the window's first
    # position) and fp_ref [E] (each block's first position); q_ref [G, d];
    # k_ref, v_ref [E, blk, d] (this kv head's slice of the pool); o_ref [Gp, dp]; lse_ref [Gp]
    if windowed:
        start_ref, fp_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    split = pl.program_id(2)
    first = split * blocks_per_split
    n_here = jnp.clip(jnp.minimum(nb_ref[0], M) - first, 0, blocks_per_split)

    rows = jnp.arange(blkp, dtype=jnp.int32)
    cols = jnp.arange(dp, dtype=jnp.int32)
    row_ok = rows < blk
    msk = row_ok[:, None] & (cols < d)[None, :]
    q = load_padded(q_ref, Gp, dp, G, d).astype(k_ref.dtype)

    def body(i, carry):
        acc, m, l = carry
        e = jnp.clip(load(table_ref.at[first + i]), 0, E - 1)
        if (blkp, dp) == (blk, d):
            kb = load(k_ref.at[e])
            vb = load(v_ref.at[e])
        else:
            kb = load(k_ref.at[e, rows[:, None], cols[None, :]], mask=msk, other=0.0)
            vb = load(v_ref.at[e, rows[:, None], cols[None, :]], mask=msk, other=0.0)
        s = dot(q, kb, trans_b=True) * scale  # [Gp, blkp]
        ok = row_ok & (load(fp_ref.at[e]) + rows >= start_ref[0]) if windowed else row_ok
        m_new, l_new, p, alpha = online_softmax_step(m, l, s, ok)
        acc = acc * alpha[:, None] + dot(p.astype(vb.dtype), vb)
        return acc, m_new, l_new

    acc, m, l = jax.lax.fori_loop(
        0, n_here, body, (jnp.zeros((Gp, dp), jnp.float32), *online_softmax_init(Gp)))
    out, lse = softmax_stats_to_out(acc, l, m)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def paged_decode_attention_kernel(
    q, k_blocks, v_blocks, block_table, num_blocks, *, scale=None, interpret=False, poison=False,
    num_splits=None, num_warps=4, num_stages=2, programs_per_sm=2, first_pos=None, start=None,
):
    """Pallas (Triton) paged flash-decoding kernel; same semantics as the reference (first_pos and start: a
    sliding window's mask, keys at positions < start[b] not attended)."""
    B, H, d, E, n_kv, blk, M, G = check_paged_shapes(q, k_blocks, v_blocks, block_table,
                                                     num_blocks)
    if M == 0:
        return _no_keys(q)
    scale = default_scale(d, scale)
    dp, Gp, _ = decode_tiles(d, G, blk)
    blkp = max(16, next_pow2(blk))  # tl.dot wants every tile side >= 16
    blocks_per_split, num_splits = split_blocks(B, n_kv, M, num_splits, programs_per_sm)

    qg = q.reshape(B, n_kv, G, d)  # free; padded inside the kernel
    kernel = functools.partial(
        _paged_kernel, scale=scale, blocks_per_split=blocks_per_split, blk=blk, blkp=blkp, d=d,
        dp=dp, G=G, Gp=Gp, M=M, E=E, windowed=start is not None,
    )
    window, window_specs = [], []
    if start is not None:
        window = [start.astype(jnp.int32), first_pos.astype(jnp.int32)]
        window_specs = [pl.BlockSpec((1,), lambda b, h, s: (b,)), pl.BlockSpec((E,), lambda b, h, s: (0,))]
    return flash_decode(
        kernel, (num_blocks.astype(jnp.int32), block_table.astype(jnp.int32), *window, qg, k_blocks, v_blocks),
        [pl.BlockSpec((1,), lambda b, h, s: (b,)),
         pl.BlockSpec((None, M), lambda b, h, s: (b, 0))] + window_specs +
        [pl.BlockSpec((None, None, G, d), lambda b, h, s: (b, h, 0, 0)),
         pl.BlockSpec((E, None, blk, d), lambda b, h, s: (0, h, 0, 0)),
         pl.BlockSpec((E, None, blk, d), lambda b, h, s: (0, h, 0, 0))],
        q=q, n_kv=n_kv, num_splits=num_splits, Gp=Gp, dp=dp, name="kvo_paged_decode_attention",
        interpret=interpret, poison=poison, num_warps=num_warps, num_stages=num_stages)
