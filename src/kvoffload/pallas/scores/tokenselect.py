"""The TokenSelect soft vote: per query head softmax of scale * q.K over the valid keys, summed over each GQA
group's heads (or over all heads, shared). The kernel is exact, in two passes: logits + per-split softmax
statistics, then the merged statistics normalise the logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import (
    MASK_VALUE,
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
    split_blocks,
    triton_params,
)
from kvoffload.pallas.decode_attention import load_padded, store_padded
from kvoffload.pallas.scores.common import group_logits, load_rows, valid_mask


def tokenselect_scores_reference(q, k, lengths=None, *, scale=None, shared=False):
    """Soft vote: per query head softmax over valid positions of scale*q.K, summed over
    the heads of each GQA group ([B, n_kv, S]); with shared=True summed over all heads
    and broadcast to every KV head (one selection for all heads, as TokenSelect)."""
    B, _, d = q.shape
    S = k.shape[2]
    s = group_logits(q, k, default_scale(d, scale))
    valid = valid_mask(lengths, S, B)[:, :, None]
    s = jnp.where(valid, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid, jnp.exp(s - m), 0.0)
    z = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(z > 0, z, 1.0)
    vote = jnp.sum(p, axis=2)
    if shared:
        vote = jnp.broadcast_to(jnp.sum(vote, axis=1, keepdims=True), vote.shape)
    return jnp.where(valid[:, :, 0], vote, NEG_INF)


def _ts_logits_kernel(len_ref, q_ref, k_ref, s_ref, m_ref, l_ref, *, scale, block_s,
                      blocks_per_split, d, dp, S, G, Gp):
    # pass 1, one program per (batch, kv head, split of the keys).
    # len_ref [1]; q_ref [G, d]; k_ref [S, d]; s_ref [G, chunk] logits of this split;
    # m_ref, l_ref [G]: running max and sum of exp(s - max) over this split's valid keys.
    from jax.experimental.pallas import triton as plgpu

    split = pl.program_id(2)
    length = jnp.minimum(len_ref[0], S)
    chunk_start = split * (blocks_per_split * block_s)
    n_valid = jnp.clip(cdiv_traced(length - chunk_start, block_s), 0, blocks_per_split)
    q = load_padded(q_ref, Gp, dp, G, d).astype(k_ref.dtype)
    grow = jnp.arange(Gp, dtype=jnp.int32)

    def body(i, carry):
        m, l = carry
        start = chunk_start + i * block_s
        row_ok = start + jnp.arange(block_s, dtype=jnp.int32) < length
        kb = load_rows(k_ref, start, block_s, row_ok, d, dp, 0.0)
        s = dot(q, kb, trans_b=True) * scale  # [Gp, block_s] f32
        cols = i * block_s + jnp.arange(block_s, dtype=jnp.int32)
        plgpu.store(s_ref.at[grow[:, None], cols[None, :]], s, mask=(grow < G)[:, None])
        m_new, l_new, _, _ = online_softmax_step(m, l, s, row_ok)
        return m_new, l_new

    m, l = jax.lax.fori_loop(0, n_valid, body, online_softmax_init(Gp))
    store_padded(m_ref, m, G)
    store_padded(l_ref, l, G)


def _ts_vote_kernel(len_ref, s_ref, m_ref, l_ref, o_ref, *, block_s, S, NS, NSp, R, Rp):
    # pass 2, one program per (batch, kv head or all heads, block of keys).
    # s_ref [R, S_pad] logits of the R query heads voting here; m_ref, l_ref [NS, R]
    # per-split stats, merged exactly here; o_ref [block_s] = sum over the R heads of
    # exp(s - m) / l.
    j = pl.program_id(2)
    length = jnp.minimum(len_ref[0], S)
    srow = jnp.arange(NSp, dtype=jnp.int32)
    rrow = jnp.arange(Rp, dtype=jnp.int32)
    smask = (srow < NS)[:, None] & (rrow < R)[None, :]
    ms = load(m_ref.at[srow[:, None], rrow[None, :]], mask=smask, other=MASK_VALUE)
    ls = load(l_ref.at[srow[:, None], rrow[None, :]], mask=smask, other=0.0)
    m = jnp.max(ms, axis=0)  # [Rp]
    l = jnp.sum(ls * jnp.exp(ms - m[None, :]), axis=0)
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    cols = j * block_s + jnp.arange(block_s, dtype=jnp.int32)
    col_ok = cols < length
    msk = (rrow < R)[:, None] & col_ok[None, :]
    s = load(s_ref.at[rrow[:, None], cols[None, :]], mask=msk, other=MASK_VALUE)
    p = jnp.where(msk, jnp.exp(s - m[:, None]) * inv_l[:, None], 0.0)
    o_ref[...] = jnp.where(col_ok, jnp.sum(p, axis=0), -jnp.inf)


def tokenselect_scores_kernel(q, k, lengths=None, *, scale=None, shared=False,
                              interpret=False, poison=False, block_s=None, num_splits=None,
                              block_v=None, num_warps=4, num_stages=2, programs_per_sm=2):
    """Pallas (Triton) TokenSelect soft vote, exact, in two passes.

    Pass 1 (flash-decoding layout, grid batch x kv head x split): q.K logits of the
    group's heads are written once ([B, H, S_pad] f32, H*4 bytes per key, vs d*2 bytes
    of K) and each split keeps the softmax statistics (running max, sum of exp) per head.
    Pass 2 (grid batch x kv head x key block; shared: batch x 1 x key block): each
    program merges the per-split statistics of its heads exactly (max, then
    sum l_i exp(m_i - m)), reads its logits and writes sum_heads exp(s - m) / l.
    K is read once; nothing is approximated."""
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    dp, Gp, block_s = decode_tiles(d, G, S, block_s)
    n_blocks = cdiv(S, block_s)
    blocks_per_split, NS = split_blocks(B, n_kv, n_blocks, num_splits, programs_per_sm)
    chunk = blocks_per_split * block_s
    if lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    qg = q.reshape(B, n_kv, G, d)
    kernel1 = functools.partial(_ts_logits_kernel, scale=scale, block_s=block_s,
                                blocks_per_split=blocks_per_split, d=d, dp=dp, S=S, G=G, Gp=Gp)
    logits, m, l = pallas_call(
        kernel1, poison=poison,
        grid=(B, n_kv, NS),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, G, d), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S, d), lambda b, h, s: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, G, None, chunk), lambda b, h, s: (b, h, 0, s, 0)),
            pl.BlockSpec((None, None, None, G), lambda b, h, s: (b, s, h, 0)),
            pl.BlockSpec((None, None, None, G), lambda b, h, s: (b, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, n_kv, G, NS, chunk), jnp.float32),
            jax.ShapeDtypeStruct((B, NS, n_kv, G), jnp.float32),
            jax.ShapeDtypeStruct((B, NS, n_kv, G), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvo_tokenselect_logits",
    )(lengths, qg, k)
    S_pad = NS * chunk
    logits = logits.reshape(B, H, S_pad)  # free: row h*G+g, column split*chunk+c
    m = m.reshape(B, NS, H)
    l = l.reshape(B, NS, H)
    R, NH = (H, 1) if shared else (G, n_kv)
    Rp = max(16, next_pow2(R))
    NSp = max(2, next_pow2(NS))
    if block_v is None:
        block_v = max(16, min(512, 4096 // Rp))
    block_v = min(block_v, max(16, next_pow2(S)))
    nb = cdiv(S, block_v)
    kernel2 = functools.partial(_ts_vote_kernel, block_s=block_v, S=S, NS=NS, NSp=NSp, R=R,
                                Rp=Rp)
    out = pallas_call(
        kernel2, poison=poison,
        grid=(B, NH, nb),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, j: (b,)),
            pl.BlockSpec((None, R, S_pad), lambda b, h, j: (b, h, 0)),
            pl.BlockSpec((None, NS, R), lambda b, h, j: (b, 0, h)),
            pl.BlockSpec((None, NS, R), lambda b, h, j: (b, 0, h)),
        ],
        out_specs=pl.BlockSpec((None, None, block_v), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, NH, nb * block_v), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kvo_tokenselect_vote",
    )(lengths, logits, m, l)
    out = out[:, :, :S]
    return jnp.broadcast_to(out, (B, n_kv, S)) if shared else out
