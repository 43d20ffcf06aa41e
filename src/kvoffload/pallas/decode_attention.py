"""Decode attention (one query token per sequence) over a [B, n_kv, S, d] cache.

Flash-decoding kernel: the KV sequence of each (batch, kv head) is split into
``num_splits`` chunks processed by independent programs; each program walks its
chunk in blocks of ``block_s`` keys with an online softmax and writes a partial
(out, lse); the partials are merged exactly with log-sum-exp in a small jnp epilogue.
All query heads of a GQA group are processed together (one K/V read per group).

The pure-jnp reference has the same signature and semantics.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import (
    NEG_INF,
    cdiv,
    cdiv_traced,
    decode_tiles,
    default_scale,
    dot,
    load,
    next_pow2,
    online_softmax_init,
    online_softmax_step,
    pallas_call,
    softmax_stats_to_out,
    split_blocks,
    triton_params,
)

# ----------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------


def _attend_masked(qg, k, v, valid, scale):
    """qg [B, n_kv, G, d]; k, v [B, n_kv, S, d]; valid [B, n_kv or 1, S] bool.
    Returns out [B, n_kv, G, d] f32, lse [B, n_kv, G] f32.
    q is cast to k.dtype; fp32 matmuls run at HIGHEST precision (no tf32); with bf16
    K/V the probabilities are rounded to bf16 for p @ V (as in the kernel)."""
    prec = jax.lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    s = jnp.einsum(
        "bhgd,bhsd->bhgs", qg.astype(k.dtype), k, preferred_element_type=jnp.float32,
        precision=prec,
    ) * jnp.float32(scale)
    s = jnp.where(valid[:, :, None, :], s, NEG_INF)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, :, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    prec_v = jax.lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    acc = jnp.einsum(
        "bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32,
        precision=prec_v,
    )
    return softmax_stats_to_out(acc, l, m_safe)


def decode_attention_reference(q, k, v, lengths, *, scale=None, start=None):
    """Pure-jnp decode attention. See :func:`kvoffload.ops.decode_attention`."""
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    qg = q.reshape(B, n_kv, G, d)
    idx = jnp.arange(S)[None, None, :]
    valid = idx < lengths.astype(jnp.int32)[:, None, None]
    if start is not None:  # a sliding window's first key
        valid = valid & (idx >= start.astype(jnp.int32)[:, None, None])
    out, lse = _attend_masked(qg, k, v, valid, scale)
    return out.reshape(B, H, d).astype(q.dtype), lse.reshape(B, H)


def merge_attention(parts: Sequence[tuple]):
    """Exact merge of partial attentions over disjoint key sets.

    parts: sequence of (out [..., d], lse [...]) pairs. Parts with lse = -inf
    (no keys) contribute nothing; if every part is empty the result is (0, -inf).
    Returns (out in parts[0][0].dtype, lse float32).
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge_attention needs at least one part")
    if len(parts) == 1:
        o, l = parts[0]
        return o, l.astype(jnp.float32)
    dtype = parts[0][0].dtype
    lses = jnp.stack([p[1].astype(jnp.float32) for p in parts], axis=0)
    outs = jnp.stack([p[0].astype(jnp.float32) for p in parts], axis=0)
    return _merge_stacked(outs, lses, axis=0, out_dtype=dtype)


def _merge_stacked(outs, lses, axis, out_dtype):
    """outs [..., P at axis, ..., d], lses same without d."""
    m = jnp.max(lses, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lses), jnp.exp(lses - m_safe), 0.0)
    l = jnp.sum(w, axis=axis)
    acc = jnp.sum(outs * w[..., None], axis=axis)
    out, lse = softmax_stats_to_out(acc, l, jnp.squeeze(m_safe, axis))
    return out.astype(out_dtype), lse


# ----------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------


def _decode_kernel(
    len_ref, *refs, scale, block_s, blocks_per_split, d, dp, S, G, Gp, windowed=False,
):
    # len_ref: [1] (block of lengths for this batch element); windowed: then start_ref [1] (the first valid key)
    # q_ref: [G, d] (loaded zero-padded to [Gp, dp]); k_ref, v_ref: [S, d] (full sequence of this (b, h));
    # o_ref: [Gp, dp]; lse_ref: [Gp]
    if windowed:
        start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), start_ref = refs, None
    split = pl.program_id(2)
    length = jnp.minimum(len_ref[0], S)
    chunk_start = split * (blocks_per_split * block_s)
    # number of blocks of this chunk that hold valid keys
    n_valid = jnp.clip(cdiv_traced(length - chunk_start, block_s), 0, blocks_per_split)
    first_key = start_ref[0] if windowed else 0
    # the chunk's blocks wholly before the window's first key are skipped
    i0 = jnp.clip((first_key - chunk_start) // block_s, 0, n_valid) if windowed else 0

    cols = jnp.arange(dp, dtype=jnp.int32)
    col_ok = cols < d
    q = load_padded(q_ref, Gp, dp, G, d).astype(k_ref.dtype)

    def body(i, carry):
        acc, m, l = carry
        start = chunk_start + i * block_s
        rows = start + jnp.arange(block_s, dtype=jnp.int32)
        row_ok = rows < length
        if windowed:
            row_ok = row_ok & (rows >= first_key)
        if dp == d:
            kb = load(k_ref.at[pl.ds(start, block_s), :], mask=row_ok[:, None], other=0.0)
            vb = load(v_ref.at[pl.ds(start, block_s), :], mask=row_ok[:, None], other=0.0)
        else:
            msk = row_ok[:, None] & col_ok[None, :]
            kb = load(k_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
            vb = load(v_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
        s = dot(q, kb, trans_b=True) * scale  # [Gp, bs]
        m_new, l_new, p, alpha = online_softmax_step(m, l, s, row_ok)
        acc = acc * alpha[:, None] + dot(p.astype(vb.dtype), vb)
        return acc, m_new, l_new

    acc, m, l = jax.lax.fori_loop(i0, n_valid, body, (jnp.zeros((Gp, dp), jnp.float32), *online_softmax_init(Gp)))
    out, lse = softmax_stats_to_out(acc, l, m)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def load_padded(ref, R, C, r, c):
    """Load a [r, c] ref as a zero-padded [R, C] tile (R, C powers of two)."""
    if (R, C) == (r, c):
        return ref[...]
    rows = jnp.arange(R, dtype=jnp.int32)
    cols = jnp.arange(C, dtype=jnp.int32)
    msk = (rows < r)[:, None] & (cols < c)[None, :]
    return load(ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)


def _merge_splits_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, n_splits, d, NSp, dp):
    # one (request, KV head, query row): o_ref [NS, dp] f32, lse_ref [NS]; out_ref [d], lse_out_ref [1].
    # Every split in one tile: a loop over the splits was a chain of NS dependent loads (18-21 us a call at
    # 66 splits on an H200 with only B * n_kv programs), this is one load and two reductions.
    rows = jnp.arange(NSp, dtype=jnp.int32)
    live = rows < n_splits
    ls = load(lse_ref.at[rows], mask=live, other=NEG_INF)
    m = jnp.max(ls)
    m_safe = jnp.where(m > NEG_INF, m, 0.0)
    w = jnp.where(ls > NEG_INF, jnp.exp(ls - m_safe), 0.0)
    cols = jnp.arange(dp, dtype=jnp.int32)
    o = load(o_ref.at[rows[:, None], cols[None, :]], mask=live[:, None] & (cols < dp)[None, :], other=0.0)
    acc = jnp.sum(w[:, None] * o, axis=0)
    l = jnp.sum(w)
    safe_l = jnp.where(l > 0, l, 1.0)
    lse = jnp.where(l > 0, m_safe + jnp.log(safe_l), NEG_INF)
    store_padded(out_ref, (acc / safe_l).astype(out_ref.dtype), d)
    lse_out_ref[...] = jnp.broadcast_to(lse, (1,))


def store_padded(ref, val, r, c=None):
    """Store the leading [r(, c)] part of a padded tile into a [r(, c)] ref."""
    from jax.experimental.pallas import triton as plgpu

    if val.ndim == 1:
        if val.shape[0] == r:
            ref[...] = val
            return
        rows = jnp.arange(val.shape[0], dtype=jnp.int32)
        plgpu.store(ref.at[rows], val, mask=rows < r)
        return
    if val.shape == (r, c):
        ref[...] = val
        return
    rows = jnp.arange(val.shape[0], dtype=jnp.int32)
    cols = jnp.arange(val.shape[1], dtype=jnp.int32)
    msk = (rows < r)[:, None] & (cols < c)[None, :]
    plgpu.store(ref.at[rows[:, None], cols[None, :]], val, mask=msk)


def split_partials(B, n_kv, num_splits, Gp, dp, dtype=jnp.float32):
    """(out_specs, out_shape) of a flash-decoding kernel on grid (B, n_kv, splits): each program writes
    its split's partial out [Gp, dp] and lse [Gp]; `merge_splits` combines them."""
    return ([pl.BlockSpec((None, None, None, Gp, dp), lambda b, h, s: (b, h, s, 0, 0)),
             pl.BlockSpec((None, None, None, Gp), lambda b, h, s: (b, h, s, 0))],
            [jax.ShapeDtypeStruct((B, n_kv, num_splits, Gp, dp), dtype),
             jax.ShapeDtypeStruct((B, n_kv, num_splits, Gp), jnp.float32)])


def merge_splits(o, lse, *, G, d, out_dtype, interpret=False, poison=False):
    """Pallas merge of per-split partials o [B, n_kv, NS, Gp, dp], lse [B, n_kv, NS, Gp]
    -> (out [B, n_kv, G, d] out_dtype, lse [B, n_kv, G] f32), one launch, a program per query row."""
    B, n_kv, NS, Gp, dp = o.shape
    kernel = functools.partial(_merge_splits_kernel, n_splits=NS, d=d, NSp=next_pow2(NS), dp=dp)
    out, lse = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, G),
        in_specs=[
            pl.BlockSpec((None, None, NS, None, dp), lambda b, h, g: (b, h, 0, g, 0)),
            pl.BlockSpec((None, None, NS, None), lambda b, h, g: (b, h, 0, g)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, d), lambda b, h, g: (b, h, g, 0)),
            pl.BlockSpec((None, None, None, 1), lambda b, h, g: (b, h, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, n_kv, G, d), out_dtype),
            jax.ShapeDtypeStruct((B, n_kv, G, 1), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kvo_merge_splits",
    )(o, lse)
    return out, lse[..., 0]


def flash_decode(kernel, args, in_specs, *, q, n_kv, num_splits, Gp, dp, name, interpret=False, poison=False,
                 num_warps=4, num_stages=2, merge="pallas"):
    """Launch a flash-decoding kernel on grid (B, n_kv, num_splits), each program writing its split's partial
    out [Gp, dp] and lse [Gp] (`split_partials`), and merge the splits (`merge_splits`; merge="xla": XLA ops, for
    comparison). The one launcher of the decode, paged, int4, sparse and rows kernels: in_specs / args are
    the kernel's inputs. Returns (out [B, H, d] in q's dtype, lse [B, H] float32)."""
    B, H, d = q.shape
    G = H // n_kv
    out_specs, out_shape = split_partials(B, n_kv, num_splits, Gp, dp)
    o, lse = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    if merge == "xla":
        out, lse = _merge_stacked(o[:, :, :, :G, :d], lse[:, :, :, :G], axis=2, out_dtype=q.dtype)
    else:
        out, lse = merge_splits(o, lse, G=G, d=d, out_dtype=q.dtype, interpret=interpret, poison=poison)
    return out.reshape(B, H, d), lse.reshape(B, H)


def decode_attention_kernel(
    q, k, v, lengths, *, scale=None, interpret=False, poison=False, block_s=None, num_splits=None,
    num_warps=None, num_stages=2, programs_per_sm=2, merge="pallas", start=None,
):
    """Pallas (Triton) flash-decoding kernel; same semantics as the reference (start: keys before it masked,
    the blocks wholly before it skipped)."""
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    # H200 sweep (BENCHMARKS.md): block 128 / 4 warps / 2 programs per SM was best
    dp, Gp, block_s = decode_tiles(d, G, S, block_s)
    blocks_per_split, num_splits = split_blocks(B, n_kv, cdiv(S, block_s), num_splits, programs_per_sm)
    if num_warps is None:
        num_warps = 4

    qg = q.reshape(B, n_kv, G, d)  # free (contiguous); padded inside the kernel
    lengths = lengths.astype(jnp.int32)

    kernel = functools.partial(
        _decode_kernel, scale=scale, block_s=block_s,
        blocks_per_split=blocks_per_split, d=d, dp=dp, S=S, G=G, Gp=Gp, windowed=start is not None,
    )
    window = [] if start is None else [start.astype(jnp.int32)]
    return flash_decode(
        kernel, (lengths, *window, qg, k, v),
        [pl.BlockSpec((1,), lambda b, h, s: (b,))] * (1 + len(window)) +
        [pl.BlockSpec((None, None, G, d), lambda b, h, s: (b, h, 0, 0)),
         pl.BlockSpec((None, None, S, d), lambda b, h, s: (b, h, 0, 0)),
         pl.BlockSpec((None, None, S, d), lambda b, h, s: (b, h, 0, 0))],
        q=q, n_kv=n_kv, num_splits=num_splits, Gp=Gp, dp=dp, name="kvo_decode_attention", interpret=interpret,
        poison=poison, num_warps=num_warps, num_stages=num_stages, merge=merge)
