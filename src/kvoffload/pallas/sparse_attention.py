"""Sparse (top-k) decode attention over selected token positions or pages.

indices [B, n_kv, K] int32 per KV head: token positions (page_size == 1) or page
indices (page_size > 1; page p covers positions p*page_size ... p*page_size+page_size-1).
Only the first num_valid[b, h] entries count (all K if num_valid is None). Positions
>= S (or >= lengths[b] when given) are ignored. Entries should be unique; a duplicated
entry is attended twice (as if its key appeared twice).

The kernel gathers the selected K/V rows itself (pointer arithmetic from the indices),
so K/V may be arrays in ``pinned_host`` memory: on GPU with JAX's Triton lowering the
host pointer reaches the kernel and the rows are read over PCIe with no staging copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import (
    cdiv,
    default_scale,
    dot,
    load,
    next_pow2,
    online_softmax_init,
    online_softmax_step,
    softmax_stats_to_out,
    split_blocks,
)
from kvoffload.pallas.decode_attention import _attend_masked, flash_decode


def expand_indices(indices, num_valid, page_size, S, lengths=None):
    """-> positions [B, n_kv, K*page_size] int32 (clamped into range) and valid mask."""
    B, n_kv, K = indices.shape
    indices = indices.astype(jnp.int32)
    entry_ok = jnp.ones((B, n_kv, K), bool)
    if num_valid is not None:
        entry_ok = jnp.arange(K)[None, None, :] < num_valid.astype(jnp.int32)[:, :, None]
    if page_size > 1:
        pos = indices[..., None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
        ok = jnp.broadcast_to(entry_ok[..., None], pos.shape)
        pos = pos.reshape(B, n_kv, K * page_size)
        ok = ok.reshape(B, n_kv, K * page_size)
    else:
        pos, ok = indices, entry_ok
    limit = jnp.int32(S)
    if lengths is not None:
        limit = jnp.minimum(lengths.astype(jnp.int32), S)[:, None, None]
    ok = ok & (pos >= 0) & (pos < limit)
    pos = jnp.clip(pos, 0, S - 1)
    return pos, ok


def sparse_attention_reference(
    q, k, v, indices, *, num_valid=None, page_size=1, scale=None, lengths=None
):
    """Pure-jnp sparse attention (gathers the selected rows, then attends)."""
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    pos, ok = expand_indices(indices, num_valid, page_size, S, lengths)
    ks = jnp.take_along_axis(k, pos[..., None], axis=2)
    vs = jnp.take_along_axis(v, pos[..., None], axis=2)
    qg = q.reshape(B, n_kv, G, d)
    out, lse = _attend_masked(qg, ks, vs, ok, scale)
    return out.reshape(B, H, d).astype(q.dtype), lse.reshape(B, H)


def _split_tiles(B, n_kv, N, d, block_n=None, num_splits=None):
    """(block_n, blocks_per_split, num_splits) of a flash-decoding grid (B, n_kv, splits) over N rows of d
    channels a head."""
    if block_n is None:
        block_n = 64 if max(16, next_pow2(d)) <= 128 else 32
    block_n = min(block_n, max(16, next_pow2(N)))
    return (block_n, *split_blocks(B, n_kv, cdiv(N, block_n), num_splits))


def _flash_call(kernel, lead, q, k, v, *, num_splits, name, interpret, poison, num_warps, num_stages, **kw):
    """Launch a flash-decoding kernel on grid (B, n_kv, num_splits) and merge its splits: lead is
    [(array, BlockSpec)] before the query (the rows' positions or counts); the query goes in padded to [B, n_kv,
    Gp, dp] in k's dtype, k and v whole per (request, head). Returns (out [B, H, d], lse [B, H])."""
    B, H, d = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    G = H // n_kv
    dp, Gp = max(16, next_pow2(d)), max(16, next_pow2(G))
    qg = jnp.pad(q.reshape(B, n_kv, G, d), ((0, 0), (0, 0), (0, Gp - G), (0, dp - d))).astype(k.dtype)
    kv_spec = pl.BlockSpec((None, None, S, d), lambda b, h, s: (b, h, 0, 0))
    return flash_decode(
        functools.partial(kernel, d=d, dp=dp, **kw), (*[a for a, _ in lead], qg, k, v),
        [spec for _, spec in lead] + [pl.BlockSpec((None, None, Gp, dp), lambda b, h, s: (b, h, 0, 0)),
                                      kv_spec, kv_spec],
        q=q, n_kv=n_kv, num_splits=num_splits, Gp=Gp, dp=dp, name=name, interpret=interpret, poison=poison,
        num_warps=num_warps, num_stages=num_stages)


def _attend_block(q, kb, vb, row_ok, carry, scale):
    """One block of rows into the online softmax: carry (acc [Gp, dp], m, l) -> the same after kb, vb [bn, dp]."""
    acc, m, l = carry
    s = dot(q, kb, trans_b=True) * scale
    m_new, l_new, p, alpha = online_softmax_step(m, l, s, row_ok)
    return acc * alpha[:, None] + dot(p.astype(vb.dtype), vb), m_new, l_new


# ----------------------------------------------------------------------------
# kernel: gathers rows straight from k/v (device or pinned_host memory)
# ----------------------------------------------------------------------------


def _sparse_kernel(
    pos_ref, ok_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
    scale, block_n, blocks_per_split, d, dp,
):
    # pos_ref, ok_ref: [Np] (positions of this (b, h)); q_ref [Gp, dp];
    # k_ref, v_ref: [S, d]; o_ref [Gp, dp]; lse_ref [Gp]
    split = pl.program_id(2)
    q = q_ref[...]
    Gp = q.shape[0]
    cols = jnp.arange(dp, dtype=jnp.int32)
    col_ok = cols < d
    base = split * (blocks_per_split * block_n)

    def body(i, carry):
        start = base + i * block_n
        rows = load(pos_ref.at[pl.ds(start, block_n)])
        row_ok = load(ok_ref.at[pl.ds(start, block_n)]) != 0
        msk = row_ok[:, None] & col_ok[None, :]
        kb = load(k_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
        vb = load(v_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
        return _attend_block(q, kb, vb, row_ok, carry, scale)

    acc, m, l = jax.lax.fori_loop(0, blocks_per_split, body,
                                  (jnp.zeros((Gp, dp), jnp.float32), *online_softmax_init(Gp)))
    out, lse = softmax_stats_to_out(acc, l, m)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def sparse_attention_kernel(
    q, k, v, indices, *, num_valid=None, page_size=1, scale=None, lengths=None,
    interpret=False, poison=False, block_n=None, num_splits=None, num_warps=4, num_stages=2,
):
    """Pallas (Triton) sparse attention; same semantics as the reference.

    The (small) position list is expanded and padded on the device with jnp; the
    kernel gathers K/V rows by pointer arithmetic, so k/v are never copied whole.
    """
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    scale = default_scale(d, scale)
    pos, ok = expand_indices(indices, num_valid, page_size, S, lengths)
    N = pos.shape[-1]
    block_n, blocks_per_split, num_splits = _split_tiles(B, n_kv, N, d, block_n, num_splits)
    Np = num_splits * blocks_per_split * block_n
    pos = jnp.pad(pos, ((0, 0), (0, 0), (0, Np - N)))
    ok = jnp.pad(ok.astype(jnp.int32), ((0, 0), (0, 0), (0, Np - N)))
    row_spec = pl.BlockSpec((None, None, Np), lambda b, h, s: (b, h, 0))
    return _flash_call(_sparse_kernel, [(pos, row_spec), (ok, row_spec)], q, k, v, num_splits=num_splits,
                       name="kvo_sparse_attention", interpret=interpret, poison=poison, num_warps=num_warps,
                       num_stages=num_stages, scale=scale, block_n=block_n, blocks_per_split=blocks_per_split)


# ----------------------------------------------------------------------------
# row buffers: the first num_valid rows of each (request, head), contiguous
# ----------------------------------------------------------------------------


def rows_attention_reference(q, k, v, num_valid, rows: int, *, row_offset=None, scale=None):
    """Attention over the first num_valid [B, n_kv] rows of each (request, KV head)'s row buffer: k, v [B, n_kv,
    R, d], the buffer at rows [row_offset, row_offset + rows) (row_offset [] int32, traced; None: 0, R = rows).
    ``sparse_attention_reference`` at slot ids row_offset + 0..rows-1."""
    B, n_kv = k.shape[:2]
    slots = jnp.arange(rows, dtype=jnp.int32) + (0 if row_offset is None else jnp.asarray(row_offset, jnp.int32))
    return sparse_attention_reference(q, k, v, jnp.broadcast_to(slots, (B, n_kv, rows)), num_valid=num_valid,
                                      scale=scale)


def _rows_kernel(nv_ref, off_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_n, blocks_per_split, d, dp):
    # nv_ref [1]: this (b, h)'s valid rows; off_ref [1]: its layer's first row; q_ref [Gp, dp]; k_ref, v_ref
    # [R, d]; o_ref [Gp, dp]; lse_ref [Gp]. Rows are consecutive: their addresses need no index load (the
    # gather form's dependent load a block), and a split stops at the last valid row
    split = pl.program_id(2)
    n = nv_ref[0]
    off = off_ref[0]
    q = q_ref[...]
    Gp = q.shape[0]
    cols = jnp.arange(dp, dtype=jnp.int32)
    col_ok = cols < d
    base = split * (blocks_per_split * block_n)
    lane = jnp.arange(block_n, dtype=jnp.int32)

    def body(i, carry):
        idx = base + i * block_n + lane
        row_ok = idx < n
        msk = row_ok[:, None] & col_ok[None, :]
        at = (off + idx)[:, None], cols[None, :]
        kb = load(k_ref.at[at], mask=msk, other=0.0)
        vb = load(v_ref.at[at], mask=msk, other=0.0)
        return _attend_block(q, kb, vb, row_ok, carry, scale)

    n_here = jnp.clip((n - base + block_n - 1) // block_n, 0, blocks_per_split)
    acc, m, l = jax.lax.fori_loop(0, n_here, body, (jnp.zeros((Gp, dp), jnp.float32), *online_softmax_init(Gp)))
    out, lse = softmax_stats_to_out(acc, l, m)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def rows_attention_kernel(q, k, v, num_valid, rows: int, *, row_offset=None, scale=None, interpret=False,
                          poison=False, block_n=None, num_splits=None, num_warps=4, num_stages=2):
    """Pallas (Triton) ``rows_attention_reference``: flash decoding over each row buffer's valid rows, read in
    place (k, v may hold several layers' buffers along their rows: row_offset), split over the rows bound."""
    B, H, d = q.shape
    n_kv = k.shape[1]
    block_n, blocks_per_split, num_splits = _split_tiles(B, n_kv, rows, d, block_n, num_splits)
    nv = jnp.minimum(jnp.asarray(num_valid, jnp.int32), rows).reshape(B, n_kv, 1)
    off = jnp.reshape(jnp.asarray(0 if row_offset is None else row_offset, jnp.int32), (1,))
    lead = [(nv, pl.BlockSpec((None, None, 1), lambda b, h, s: (b, h, 0))),
            (off, pl.BlockSpec((1,), lambda b, h, s: (0,)))]
    return _flash_call(_rows_kernel, lead, q, k, v, num_splits=num_splits, name="kvo_rows_attention",
                       interpret=interpret, poison=poison, num_warps=num_warps, num_stages=num_stages,
                       scale=default_scale(d, scale), block_n=block_n, blocks_per_split=blocks_per_split)
