"""Top-k selection for sparse attention: scores per KV head (GQA group aggregated)
and index selection with forced sink / recent windows.

Score functions return float32 [B, n_kv, N] (N = tokens or pages), higher = more
relevant, -inf for invalid positions (>= lengths or >= num_pages). ``select_topk``
turns them into (indices [B, n_kv, K] int32 sorted ascending, num_valid [B, n_kv]
int32) ready for :func:`kvoffload.ops.sparse_attention`.

HATA packed sign codes
----------------------
A code of r bits (r a multiple of 32) for a vector x and projection W [d, r] is
bit_j = 1 if (x @ W)_j > 0 else 0, stored as uint32 words of shape [..., r // 32]:
bit j lives in word j // 32 at bit position j % 32 (LSB first), i.e.
word_w = sum_{i<32} bit_{32 w + i} << i. ``hata_encode`` produces this format;
the HATA trainer must produce the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import (
    NEG_INF,
    cdiv,
    default_scale,
    dot,
    load,
    next_pow2,
    pallas_call,
    triton_params,
)

# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _reduce_group(s, group_reduce):
    """s [B, n_kv, G, N] -> [B, n_kv, N]."""
    if group_reduce == "sum":
        return jnp.sum(s, axis=2)
    if group_reduce == "max":
        return jnp.max(s, axis=2)
    if group_reduce == "mean":
        return jnp.mean(s, axis=2)
    raise ValueError(f"group_reduce must be sum|max|mean, got {group_reduce!r}")


def _valid_mask(lengths, N, B):
    if lengths is None:
        return jnp.ones((B, 1, N), bool)
    return jnp.arange(N)[None, None, :] < lengths.astype(jnp.int32)[:, None, None]


# ----------------------------------------------------------------------------
# exact q.K scores
# ----------------------------------------------------------------------------


def topk_scores_exact_reference(q, k, lengths=None, *, scale=None, group_reduce="sum"):
    """q [B, n_heads, d], k [B, n_kv, S, d] -> scale * q.k aggregated over the group."""
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    qg = q.reshape(B, n_kv, G, d)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = _reduce_group(s, group_reduce)
    return jnp.where(_valid_mask(lengths, S, B), s, NEG_INF)


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
    gmask = (jnp.arange(s.shape[0]) < G)[:, None]
    if group_reduce == "max":
        r = jnp.max(jnp.where(gmask, s, -jnp.inf), axis=0)
    else:
        r = jnp.sum(jnp.where(gmask, s, 0.0), axis=0)
        if group_reduce == "mean":
            r = r / G
    o_ref[...] = jnp.where(row_ok, r, -jnp.inf)


def topk_scores_exact_kernel(q, k, lengths=None, *, scale=None, group_reduce="sum",
                             interpret=False, poison=False, block_s=128, num_warps=4):
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    dp = max(16, next_pow2(d))
    Gp = max(16, next_pow2(G))
    if lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    block_s = min(block_s, max(16, next_pow2(S)))
    ns = cdiv(S, block_s)
    qg = jnp.pad(q.reshape(B, n_kv, G, d), ((0, 0), (0, 0), (0, Gp - G), (0, dp - d))).astype(k.dtype)
    kernel = functools.partial(_scores_kernel, scale=scale, block_s=block_s, d=d, dp=dp,
                               G=G, group_reduce=group_reduce, S=S)
    out = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, ns),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, j: (b,)),
            pl.BlockSpec((None, None, Gp, dp), lambda b, h, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S, d), lambda b, h, j: (b, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_s), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, ns * block_s), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kvo_topk_scores",
    )(lengths.astype(jnp.int32), qg, k)
    return out[:, :, :S]


# ----------------------------------------------------------------------------
# Quest page bounds
# ----------------------------------------------------------------------------


def quest_page_minmax(k, page_size, lengths=None):
    """Per-page channel-wise min/max keys: k [B, n_kv, S, d] -> (kmin, kmax) [B, n_kv, P, d]
    with P = ceil(S / page_size); positions >= lengths are excluded (an empty page
    gets min=+inf, max=-inf, which quest_page_scores maps to -inf)."""
    B, n_kv, S, d = k.shape
    P = cdiv(S, page_size)
    pad = P * page_size - S
    kf = k.astype(jnp.float32)
    if pad:
        kf = jnp.pad(kf, ((0, 0), (0, 0), (0, pad), (0, 0)))
    valid = _valid_mask(lengths, P * page_size, B)
    if lengths is None:
        valid = jnp.arange(P * page_size)[None, None, :] < S
    valid = valid[..., None]
    kmin = jnp.where(valid, kf, jnp.inf).reshape(B, n_kv, P, page_size, d).min(axis=3)
    kmax = jnp.where(valid, kf, -jnp.inf).reshape(B, n_kv, P, page_size, d).max(axis=3)
    return kmin, kmax


def quest_page_scores_reference(q, kmin, kmax, num_pages=None, *, group_reduce="sum"):
    """Quest upper bound per page: sum_c max(q_c * min_c, q_c * max_c), per query head,
    aggregated over the GQA group. q [B, n_heads, d]; kmin/kmax [B, n_kv, P, d];
    num_pages [B] (valid pages) or None. Returns [B, n_kv, P] float32."""
    B, H, d = q.shape
    _, n_kv, P, _ = kmin.shape
    G = H // n_kv
    qg = q.reshape(B, n_kv, G, 1, d).astype(jnp.float32)
    lo = kmin.astype(jnp.float32)[:, :, None]
    hi = kmax.astype(jnp.float32)[:, :, None]
    empty = jnp.any(lo > hi, axis=-1)[:, :, 0]  # [B, n_kv, P]
    lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
    hi = jnp.where(jnp.isfinite(hi), hi, 0.0)
    s = jnp.sum(jnp.maximum(qg * lo, qg * hi), axis=-1)  # [B, n_kv, G, P]
    s = _reduce_group(s, group_reduce)
    s = jnp.where(empty, NEG_INF, s)
    return jnp.where(_valid_mask(num_pages, P, B), s, NEG_INF)


# ----------------------------------------------------------------------------
# HATA Hamming scores on packed sign codes
# ----------------------------------------------------------------------------


def hata_encode(x, w):
    """x [..., d], w [d, r] (r % 32 == 0) -> packed codes uint32 [..., r // 32]
    (bit j = (x @ w)_j > 0, in word j // 32 at bit j % 32, LSB first)."""
    r = w.shape[-1]
    if r % 32:
        raise ValueError(f"code bits r={r} must be a multiple of 32")
    proj = jnp.einsum("...d,dr->...r", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    bits = (proj > 0).astype(jnp.uint32).reshape(*proj.shape[:-1], r // 32, 32)
    shifts = jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)


def hamming_distance(a, b):
    """Number of differing bits between packed codes a, b (broadcasting) -> int32."""
    return jnp.sum(jax.lax.population_count(jnp.bitwise_xor(a, b)).astype(jnp.int32), axis=-1)


def hata_scores_reference(q_codes, k_codes, lengths=None, *, k_norm=None, group_reduce="sum"):
    """HATA similarity: r - hamming(q_code, k_code) per query head (higher = closer),
    optionally multiplied by the key norm, aggregated over the GQA group.
    q_codes [B, n_heads, W] uint32; k_codes [B, n_kv, S, W] uint32; k_norm [B, n_kv, S]
    or None. Returns [B, n_kv, S] float32."""
    B, H, W = q_codes.shape
    _, n_kv, S, _ = k_codes.shape
    G = H // n_kv
    r = 32 * W
    qc = q_codes.reshape(B, n_kv, G, 1, W)
    ham = hamming_distance(qc, k_codes[:, :, None])  # [B, n_kv, G, S]
    s = (r - ham).astype(jnp.float32)
    if k_norm is not None:
        s = s * k_norm.astype(jnp.float32)[:, :, None]
    s = _reduce_group(s, group_reduce)
    return jnp.where(_valid_mask(lengths, S, B), s, NEG_INF)


# ----------------------------------------------------------------------------
# TokenSelect soft vote
# ----------------------------------------------------------------------------


def tokenselect_scores_reference(q, k, lengths=None, *, scale=None, shared=False):
    """Soft vote: per query head softmax over valid positions of scale*q.K, summed over
    the heads of each GQA group ([B, n_kv, S]); with shared=True summed over all heads
    and broadcast to every KV head (one selection for all heads, as TokenSelect)."""
    B, H, d = q.shape
    _, n_kv, S, _ = k.shape
    G = H // n_kv
    scale = default_scale(d, scale)
    qg = q.reshape(B, n_kv, G, d)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    valid = _valid_mask(lengths, S, B)[:, :, None]
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


# ----------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------


def select_topk(scores, k, *, lengths=None, num_sink=0, num_recent=0, page_size=1,
                sort=True):
    """Pick the top-k entries per KV head, forcing sink and recent windows in.

    scores [B, n_kv, N] float32 (-inf = invalid); N tokens (page_size=1) or pages.
    lengths [B] (tokens; with page_size>1 the valid page count is ceil(len/page_size));
    num_sink / num_recent are in tokens and are converted to the pages covering them.
    Returns (indices [B, n_kv, k] int32, num_valid [B, n_kv] int32). Valid indices come
    first (ascending if sort), the rest are filled with 0 (in range, to be ignored via
    num_valid). If k exceeds the valid count, num_valid is the valid count.
    """
    B, n_kv, N = scores.shape
    k = int(min(k, N))
    scores = scores.astype(jnp.float32)
    pos = jnp.arange(N, dtype=jnp.int32)[None, None, :]
    if lengths is not None:
        L = lengths.astype(jnp.int32)[:, None, None]
        n_valid_entries = (L + page_size - 1) // page_size
        valid = pos < n_valid_entries
    else:
        L = jnp.full((B, 1, 1), N * page_size, jnp.int32)
        valid = jnp.ones((1, 1, N), bool)
    valid = valid & (scores > NEG_INF)
    force = jnp.zeros_like(valid)
    if num_sink:
        force = force | (pos * page_size < num_sink)
    if num_recent:
        force = force | ((pos + 1) * page_size > L - num_recent)
    force = force & (pos * page_size < L)
    pri = jnp.where(force, jnp.inf, scores)
    pri = jnp.where(valid | force, pri, NEG_INF)
    vals, idx = jax.lax.top_k(pri, k)
    ok = vals > NEG_INF
    num_valid = jnp.sum(ok, axis=-1).astype(jnp.int32)
    big = jnp.int32(2 ** 30)
    key = jnp.where(ok, idx, big)
    if sort:
        key = jnp.sort(key, axis=-1)
    indices = jnp.where(key < big, key, 0).astype(jnp.int32)
    return indices, num_valid
