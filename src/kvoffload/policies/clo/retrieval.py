"""clo's retrieval: how tokens are scored per KV head (exact keys, Quest page bounds, HATA hash codes) and the
GPU-side metadata each keeps of the pool's keys (`key_metadata`), and how a KV group's query similarities combine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.plan.deploy import encode_keys, encode_queries, group_similarity
from kvoffload.policies.selection.space import TokenSpace, token_space


RETRIEVALS = ("exact", "quest", "hata")
QUEST_DTYPES = ("keys", "int8")  # the pages' min / max: in the keys' dtype, or int8 with a scale per page
SCORING = {"exact": "max over the group of q.k", "quest": "max over the group of the page's Quest bound",
           "hata": "max over the group of bits - hamming(code(q), code(k))"}
AGGREGATIONS = ("harmonic", "min")
DEFAULT_HATA_BITS = 128  # random projections without hata_weights (trained weights bring their own width)


def exact_scores(q, keys, tables, space: TokenSpace | None = None, skip=None):
    """[B, n_kv, T] f32 over the token space (`token_space`; default the pool's, T = N in block-id order):
    max over each KV head's query heads of q.k / sqrt(d); -inf where the request owns no token.
    keys: per extent [E, n_kv, blk, d]. Each extent's blocks go to the scores kernel as a batch of E, each
    with its owner's query: one read of K in place, no transpose of it (the einsum of q against the extent
    made XLA transpose the whole extent first: 80 us a layer at 32K on an H100, more than the scores
    themselves), and no request scores another's blocks (1x the pool's flops at any batch).
    skip [B, n_kv] bool (optional): heads whose scores are not needed (they reuse their selection): the
    kernel reads none of their keys (their scores come back -inf)."""
    blk = keys[0].shape[2]
    space = token_space(tables, blk) if space is None else space
    qb = space.owner_rows(q)
    lengths = None if skip is None else space.owner_rows(jnp.where(skip, 0, blk).astype(jnp.int32))  # [blocks, n_kv]
    out, start = [], 0
    for k in keys:
        E = k.shape[0]
        out.append(ops.topk_scores_exact(qb[start:start + E].astype(k.dtype), k,
                                         None if lengths is None else lengths[start:start + E], group_reduce="max"))
        start += E
    return space.per_request(jnp.concatenate(out))


def quest_bounds(q, kmin, kmax, scale=None, owner=None, active=None):
    """[E, n_kv, P] f32: per page, max over each KV head's query heads of Quest's upper bound
    sum_c max(q_c min_c, q_c max_c) = q+ . max + q- . min (`ops.quest_block_bounds`: the kernel on the GPU).
    owner None: q [E, H, d], each block's query; else q [B, H, d] and owner [E] each block's request.
    kmin, kmax [E, n_kv, P, d]; int8 pages (``quest_int8``) with their scale [E, n_kv, P], applied to the
    page's dot products (a scale per page factors out of the sum over channels: no dequantized copy).
    Operands in q's dtype (the model's), products and sums in f32: int8 pages are exact in bf16, and bf16
    operands took half the f32 form's time on an H100 in XLA's matmul form (2026-11-27). active [B, n_kv]
    or None: an inactive (request, head) gets -inf and its pages are not read."""
    if owner is None:
        owner = jnp.arange(kmin.shape[0], dtype=jnp.int32)
    return ops.quest_block_bounds(q, owner, kmin, kmax, scale, active=active)


def quest_int8(kmin, kmax):
    """One scale per page and head, (qmin, qmax) int8 [..., P, d] and scale f32 [..., P], with
    qmin * scale <= kmin and qmax * scale >= kmax channel by channel (min rounded down, max up): the bound
    over the dequantized pages stays an upper bound of every key's q.k, only looser, by at most one step
    (the page's largest |key| / 126) per channel. Pages are finite: metadata is taken of whole blocks."""
    kmin, kmax = kmin.astype(jnp.float32), kmax.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(kmin), -1), jnp.max(jnp.abs(kmax), -1))
    scale = jnp.where(amax > 0, amax / 126.0, 1.0)  # 126: |k| / scale stays inside int8 through rounding
    s = scale[..., None]
    qmin, qmax = jnp.floor(kmin / s), jnp.ceil(kmax / s)
    # the division may land just past an integer (kmin / scale = -126 exactly gave -126.00001 -> -127 on an H200)
    # and the product q * scale may round past the key (the channel of the page's largest |key|, by an ulp): fix
    # both in the arithmetic the bound is used in, so q is the tightest integer whose q * scale bounds the key
    qmin = jnp.where((qmin + 1) * s <= kmin, qmin + 1, qmin)
    qmin = jnp.where(qmin * s > kmin, qmin - 1, qmin)
    qmax = jnp.where((qmax - 1) * s >= kmax, qmax - 1, qmax)
    qmax = jnp.where(qmax * s < kmax, qmax + 1, qmax)
    return jnp.clip(qmin, -127, 127).astype(jnp.int8), jnp.clip(qmax, -127, 127).astype(jnp.int8), scale


def quest_token_scores(q, meta, tables, blk, space: TokenSpace | None = None, active=None):
    """[B, n_kv, T] f32 over the token space (default the pool's): each token its page's bound
    (``quest_bounds``, each block against its owner's query); -inf where the request owns no token.
    meta: per extent (kmin, kmax) [E, n_kv, P, d] or their int8 form (``quest_int8``); active: `quest_bounds`'."""
    space = token_space(tables, blk) if space is None else space
    out, start = [], 0
    for m in meta:  # (kmin, kmax) or (qmin, qmax, scale)
        E, P = m[0].shape[0], m[0].shape[2]
        bounds = quest_bounds(q, *m, owner=space.owner[start:start + E], active=active)  # against its owner's query
        out.append(jnp.repeat(bounds, blk // P, axis=-1))  # [E, n_kv, blk]
        start += E
    return space.per_request(jnp.concatenate(out))


def hata_token_scores(q, meta, w, tables, space: TokenSpace | None = None):
    """[B, n_kv, T] f32 over the token space (default the pool's): max over each KV head's query heads of
    r - hamming(code(q), code(k)) (codes by ``ops.hata_encode`` with the head's W [n_kv, d, r]), each block
    against its owner's query; -inf where the request owns no token. meta: per extent (codes [E, n_kv, blk,
    r/32],)."""

    B, H, d = q.shape
    n_kv, r = w.shape[0], w.shape[-1]
    blk = meta[0][0].shape[2]
    space = token_space(tables, blk) if space is None else space
    qc = space.owner_rows(encode_queries(w, q, H // n_kv).reshape(B, n_kv, H // n_kv, 1, r // 32))
    out, start = [], 0
    for (codes,) in meta:
        E = codes.shape[0]
        ham = jnp.min(ops.hamming_distance(qc[start:start + E], codes[:, :, None]), axis=2)  # [E, n_kv, blk]
        out.append((r - ham).astype(jnp.float32))
        start += E
    return space.per_request(jnp.concatenate(out))


@functools.partial(jax.jit, static_argnames=("retrieval", "page", "quest_dtype"))
def key_metadata(k_blocks, w, retrieval, page, quest_dtype="keys"):
    """The retrieval metadata of K blocks [n, n_kv, blk, d] (device memory): quest (min, max)
    [n, n_kv, blk/page, d] in the keys' dtype or (quest_dtype int8) ``quest_int8``'s (min, max, scale),
    hata (codes [n, n_kv, blk, r/32],)."""
    if retrieval == "quest":
        kmin, kmax = ops.quest_page_minmax(k_blocks, page)
        if quest_dtype == "int8":
            return quest_int8(kmin, kmax)
        return kmin.astype(k_blocks.dtype), kmax.astype(k_blocks.dtype)

    return (encode_keys(w, k_blocks),)


@functools.partial(jax.jit, static_argnames=("retrieval", "page", "quest_dtype"))
def key_metadata_layers(k_blocks, ws, retrieval, page, quest_dtype="keys"):
    """`key_metadata` of several layers' K blocks (each with its own HATA projections ws[j]) in one program."""
    return tuple(key_metadata(kb, w, retrieval, page, quest_dtype) for kb, w in zip(k_blocks, ws))


def aggregate_similarity(cos, weights, how: str):
    """[B, n_kv]: the group's similarity from per-query-head cosines cos [B, n_kv, G]."""
    return group_similarity(cos, weights[None]) if how == "harmonic" else jnp.min(cos, axis=-1)
