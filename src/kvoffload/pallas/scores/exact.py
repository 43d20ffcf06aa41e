"""Exact scores: scale * q.K per KV head, aggregated over the GQA group (`topk_scores_exact_*`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import NEG_INF, cdiv, default_scale, dot, load, next_pow2, pallas_call, triton_params
from kvoffload.pallas.scores.common import group_logits, check_group_reduce, reduce_group, reduce_group_rows, valid_mask


def topk_scores_exact_reference(q, k, lengths=None, *, scale=None, group_reduce="sum"):
    """q [B, n_heads, d], k [B, n_kv, S, d] -> scale * q.k aggregated over the group; -inf at positions >=
    lengths ([B], or [B, n_kv] per KV head: a head of length 0 is not scored, e.g. one that reuses a selection)."""
    B, _, d = q.shape
    S = k.shape[2]
    s = group_logits(q, k, default_scale(d, scale))
    s = reduce_group(s, group_reduce)
    return jnp.where(valid_mask(lengths, S, B), s, NEG_INF)


def _scores_kernel(len_ref, q_ref, k_ref, o_ref, *, scale, block_s, d, dp, G, group_reduce, S):
    # q_ref [Gp, dp]; k_ref [S, d]; o_ref [block_s]
    j = pl.program_id(2)
    length = len_ref[0]
    rows = j * block_s + jnp.arange(block_s, dtype=jnp.int32)
    cols = jnp.arange(dp, dtype=jnp.int32)
    row_ok = rows < jnp.minimum(length, S)
    msk = row_ok[:, None] & (cols < d)[None, :]
    kb = load(k_ref.at[rows[:, None], cols[None, :]], mask=msk, other=0.0)
    s = dot(q_ref[...], kb, trans_b=True) * scale  # [Gp, bs]
    o_ref[...] = jnp.where(row_ok, reduce_group_rows(s, G, group_reduce), -jnp.inf)


# batch items per program of the exact scores kernel over pool blocks (`topk_scores_exact_kernel`): one, so that
# a scored head's blocks spread over every SM while a skipped head's programs only store -inf. H100, one 32K
# extent of 64-token blocks, one head of 8 scored, 10 calls in a jit: 28 us (1 item) vs 40 (the per-block
# grid without the skip) and 46 (8 items); every head scored: 60-64 us for all three (2026-11-27).
SCORE_ITEMS = 1


def _scores_items_kernel(len_ref, q_ref, k_ref, o_ref, *, scale, items, B, S, Sp, d, dp, G, group_reduce, n_kv):
    # Whole arrays: len_ref [B * n_kv]; q_ref [B, n_kv, Gp, dp]; k_ref [B, n_kv, S, d]; o_ref [B, n_kv, Sp].
    # One program: `items` consecutive batch items of one KV head (S <= Sp rows each).
    i0, h = pl.program_id(0) * items, pl.program_id(1)
    rows = jnp.arange(Sp, dtype=jnp.int32)
    cols = jnp.arange(dp, dtype=jnp.int32)

    def one(i, _):
        b = jnp.minimum(i0 + i, B - 1)  # past the batch: redo the last item (same values, no stray write)
        length = jnp.minimum(len_ref[b * n_kv + h], S)
        row_ok = rows < length

        @pl.when(length > 0)
        def _():
            kb = load(k_ref.at[b, h, rows[:, None], cols[None, :]],
                      mask=row_ok[:, None] & (cols < d)[None, :], other=0.0)
            s = dot(q_ref[b, h], kb, trans_b=True) * scale  # [Gp, Sp]
            o_ref[b, h, :] = jnp.where(row_ok, reduce_group_rows(s, G, group_reduce), -jnp.inf)

        @pl.when(length <= 0)  # a head that is not scored: its keys are not read
        def _():
            o_ref[b, h, :] = jnp.full((Sp,), -jnp.inf, jnp.float32)

        return 0

    jax.lax.fori_loop(0, items, one, 0)


def topk_scores_exact_kernel(q, k, lengths=None, *, scale=None, group_reduce="sum",
                             interpret=False, poison=False, block_s=128, num_warps=4, items="auto"):
    """The exact scores kernel. Two layouts of the grid:
    * items=None: programs over (batch, KV head, blocks of block_s keys).
    * items=n (S <= block_s only, as the pool's blocks are: a `clo` extent is E blocks of blk tokens, a batch
      of E): each program scores n batch items of one KV head, and an item of length 0 (a head that reuses
      its selection) costs a store of -inf: no load, no dot, no reduction, all of which the other grid runs
      (masked) for every program (an H100, a 32K-token extent with one head of 8 scored: 28 vs 40 us).
    "auto": SCORE_ITEMS items where S <= block_s, else None. The same values either way (same tile, same dot)."""
    if items == "auto":
        items = SCORE_ITEMS if k.shape[2] <= block_s else None
    check_group_reduce(group_reduce)
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    dp = max(16, next_pow2(d))
    Gp = max(16, next_pow2(G))
    if lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    per_head = lengths.ndim == 2  # [B, n_kv]: a length per (b, KV head); 0 skips the head (its K is never read)
    qg = jnp.pad(q.reshape(B, n_kv, G, d), ((0, 0), (0, 0), (0, Gp - G), (0, dp - d))).astype(k.dtype)
    if items is not None and S <= block_s:
        Sp = max(16, next_pow2(S))
        L = (lengths if per_head else jnp.broadcast_to(lengths[:, None], (B, n_kv))).astype(jnp.int32)
        kernel = functools.partial(_scores_items_kernel, scale=scale, items=int(items), B=B, S=S, Sp=Sp, d=d,
                                   dp=dp, G=G, group_reduce=group_reduce, n_kv=n_kv)
        whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))
        out = pallas_call(
            kernel, poison=poison,
            grid=(cdiv(B, int(items)), n_kv),
            in_specs=[whole((B * n_kv,)), whole((B, n_kv, Gp, dp)), whole((B, n_kv, S, d))],
            out_specs=whole((B, n_kv, Sp)),
            out_shape=jax.ShapeDtypeStruct((B, n_kv, Sp), jnp.float32),
            compiler_params=triton_params(num_warps=num_warps, num_stages=2),
            interpret=interpret,
            name="kvo_topk_scores",
        )(L.reshape(-1), qg, k)
        return out[:, :, :S]
    block_s = min(block_s, max(16, next_pow2(S)))
    ns = cdiv(S, block_s)
    kernel = functools.partial(_scores_kernel, scale=scale, block_s=block_s, d=d, dp=dp,
                               G=G, group_reduce=group_reduce, S=S)
    out = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, ns),
        in_specs=[
            pl.BlockSpec((1,), (lambda b, h, j: (b * n_kv + h,)) if per_head else (lambda b, h, j: (b,))),
            pl.BlockSpec((None, None, Gp, dp), lambda b, h, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S, d), lambda b, h, j: (b, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_s), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, ns * block_s), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kvo_topk_scores",
    )(lengths.astype(jnp.int32).reshape(-1), qg, k)
    return out[:, :, :S]
