"""Quest page bounds: per-page channel-wise min / max keys (`quest_page_minmax`), each page's upper bound
against the batch's queries (two fp32 matmuls on the sign-split query, `quest_page_scores_*`) and a pool's blocks
against their owners' queries (f32 products summed row by row, `quest_block_bounds_*`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.pallas.common import NEG_INF, cdiv, dot, load, next_pow2, pallas_call, triton_params
from kvoffload.pallas.decode_attention import load_padded
from kvoffload.pallas.scores.common import check_group_reduce, load_rows, reduce_group, reduce_group_rows, valid_mask


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
    valid = valid_mask(lengths, P * page_size, B)
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
    s = reduce_group(s, group_reduce)
    s = jnp.where(empty, NEG_INF, s)
    return jnp.where(valid_mask(num_pages, P, B), s, NEG_INF)


def _quest_kernel(np_ref, q_ref, lo_ref, hi_ref, o_ref, *, block_p, P, G, Gp, d, dp,
                  group_reduce):
    # np_ref [1]; q_ref [G, d]; lo_ref, hi_ref [P, d]; o_ref [block_p]
    j = pl.program_id(2)
    start = j * block_p
    rows = start + jnp.arange(block_p, dtype=jnp.int32)
    row_ok = rows < jnp.minimum(np_ref[0], P)
    lo = load_rows(lo_ref, start, block_p, row_ok, d, dp, 0.0).astype(jnp.float32)
    hi = load_rows(hi_ref, start, block_p, row_ok, d, dp, 0.0).astype(jnp.float32)
    empty = jnp.max(jnp.where(lo > hi, 1.0, 0.0), axis=1) > 0.0  # min=+inf, max=-inf pages
    lo = jnp.where(jnp.abs(lo) < jnp.inf, lo, 0.0)
    hi = jnp.where(jnp.abs(hi) < jnp.inf, hi, 0.0)
    q = load_padded(q_ref, Gp, dp, G, d).astype(jnp.float32)
    # max(q*lo, q*hi) = max(q, 0)*hi + min(q, 0)*lo for lo <= hi: two fp32 matmuls
    s = (dot(jnp.maximum(q, 0.0), hi, trans_b=True)
         + dot(jnp.minimum(q, 0.0), lo, trans_b=True))  # [Gp, block_p]
    r = reduce_group_rows(s, G, group_reduce)
    o_ref[...] = jnp.where(row_ok & jnp.logical_not(empty), r, -jnp.inf)


def quest_page_scores_kernel(q, kmin, kmax, num_pages=None, *, group_reduce="sum",
                             interpret=False, poison=False, block_p=None, num_warps=4):
    """Pallas (Triton) Quest page bounds; same semantics as the reference.

    One program per (batch, kv head, block of pages): the group's queries (fp32) against
    a [block_p, d] tile of kmin and kmax, as max(q,0) @ kmax^T + min(q,0) @ kmin^T
    (exact for kmin <= kmax), reduced over the group; empty pages (kmin > kmax, e.g.
    +inf/-inf from ``quest_page_minmax``) and pages >= num_pages give -inf."""
    check_group_reduce(group_reduce)
    B, H, d = q.shape
    _, n_kv, P, _ = kmin.shape
    G = H // n_kv
    dp = max(16, next_pow2(d))
    Gp = max(16, next_pow2(G))
    if block_p is None:
        block_p = 64 if dp <= 128 else 32
    block_p = min(block_p, max(16, next_pow2(P)))
    n_blocks = cdiv(P, block_p)
    if num_pages is None:
        num_pages = jnp.full((B,), P, jnp.int32)
    qg = q.reshape(B, n_kv, G, d)
    kernel = functools.partial(_quest_kernel, block_p=block_p, P=P, G=G, Gp=Gp, d=d, dp=dp,
                               group_reduce=group_reduce)
    page_spec = pl.BlockSpec((None, None, P, d), lambda b, h, j: (b, h, 0, 0))
    out = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, n_blocks),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, j: (b,)),
            pl.BlockSpec((None, None, G, d), lambda b, h, j: (b, h, 0, 0)),
            page_spec,
            page_spec,
        ],
        out_specs=pl.BlockSpec((None, None, block_p), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, n_blocks * block_p), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kvo_quest_page_scores",
    )(jnp.asarray(num_pages, jnp.int32), qg, kmin, kmax)
    return out[:, :, :P]


def quest_block_bounds_reference(q, owner, kmin, kmax, scale=None, block_offset=0, active=None):
    """[E, n_kv, P] f32: per page of each pool block, max over its KV head's query heads of Quest's upper bound
    sum_c max(q_c min_c, q_c max_c) = q+ . max + q- . min, against the block's owner's query. q [B, H, d];
    owner [E] int32 (-1, a free block: request 0's); kmin, kmax [E, n_kv, P, d] (or int8 pages with their
    scale [E, n_kv, P], applied to each page's dot products: a scale per page factors out of the channel sum);
    longer arrays are read from row block_offset on (E rows); active [B, n_kv] (or None: all): where False, the
    (request, head)'s bounds are -inf (the kernel does not read its pages: a head that reuses its selection).
    Operands in q's dtype (int8 pages are exact in bf16), products and sums in f32."""
    E, n_kv = owner.shape[0], kmin.shape[1]
    if kmin.shape[0] != E or not isinstance(block_offset, int) or block_offset:
        kmin, kmax, scale = (None if a is None else jax.lax.dynamic_slice_in_dim(a, block_offset, E)
                             for a in (kmin, kmax, scale))
    qb = q[jnp.maximum(owner, 0)]
    H, d = qb.shape[1:]
    qg = qb.reshape(E, n_kv, H // n_kv, d)
    kw = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("ehgd,ehpd->ehgp", jnp.maximum(qg, 0), kmax.astype(q.dtype), **kw) + \
        jnp.einsum("ehgd,ehpd->ehgp", jnp.minimum(qg, 0), kmin.astype(q.dtype), **kw)
    if scale is not None:
        s = s * scale[:, :, None, :]
    s = jnp.max(s, axis=2)
    if active is not None:
        s = jnp.where(jnp.asarray(active, bool)[jnp.maximum(owner, 0)][:, :, None], s, -jnp.inf)
    return s


def _quest_blocks_kernel(owner_ref, base_ref, active_ref, q_ref, lo_ref, hi_ref, *rest, E, P, G, d, dp, R, scaled):
    # whole refs, addressed row by row: owner [E]; base [1]; active [B, n_kv] int32; q [B, H, d]; lo, hi
    # [>= base + E, n_kv, P, d]; scale [>= base + E, n_kv, P]; out [E, n_kv, P]. A program: R consecutive
    # (block, page) rows of one KV head; block e's pages are row base + e of lo / hi / scale. The rows of an
    # inactive (request, head) are -inf and their pages are not read (masked loads)
    from jax.experimental.pallas import triton as plgpu

    sc_ref, o_ref = rest if scaled else (None, rest[0])
    h = pl.program_id(1)
    row = pl.program_id(0) * R + jnp.arange(R, dtype=jnp.int32)
    blk, page = row // P, row % P
    head = jnp.zeros((R, 1), jnp.int32) + h
    own = jnp.maximum(load(owner_ref.at[blk], mask=blk < E, other=0), 0)
    live = (blk < E) & (load(active_ref.at[own, head[:, 0]], mask=blk < E, other=0) != 0)
    at = blk + load(base_ref.at[jnp.zeros((R,), jnp.int32)])
    dc = jnp.arange(dp, dtype=jnp.int32)
    tile_ok = live[:, None] & (dc < d)[None, :]
    hi = load(hi_ref.at[at[:, None], head, page[:, None], dc[None, :]], mask=tile_ok, other=0).astype(jnp.float32)
    lo = load(lo_ref.at[at[:, None], head, page[:, None], dc[None, :]], mask=tile_ok, other=0).astype(jnp.float32)
    best = jnp.full((R,), -jnp.inf, jnp.float32)
    for g in range(G):  # the group's query heads one by one: [R, d] products, no tensor-core padding of G
        qr = load(q_ref.at[own[:, None], head * G + g, dc[None, :]], mask=tile_ok, other=0).astype(jnp.float32)
        best = jnp.maximum(best, jnp.sum(jnp.maximum(qr, 0) * hi + jnp.minimum(qr, 0) * lo, axis=1))
    if scaled:
        best = best * load(sc_ref.at[at, head[:, 0], page], mask=live, other=1)
    plgpu.store(o_ref.at[blk, head[:, 0], page], jnp.where(live, best, -jnp.inf), mask=blk < E)


def quest_block_bounds_kernel(q, owner, kmin, kmax, scale=None, *, block_offset=0, active=None, rows=32,
                              num_warps=4, interpret=False):
    """Pallas (Triton) ``quest_block_bounds_reference``, reading the pages in place: one program per `rows`
    (block, page) rows of one KV head, each row against its block's owner's query rows (loaded by index: no
    per-block copy of the query), products and sums in f32 (the reference's up to summation order). XLA's
    form is a batched matmul of E x n_kv products of [G, d] x [d, P]: tiny tiles, ~27 us a call on an H200 for
    4 MB of int8 pages at 128K (2026-11-28). E = len(owner): block e's pages are row
    block_offset + e of kmin / kmax / scale (int32, may be traced), so a loop over layers reads its layer's
    pages inside an [n E, ...] stack without slicing them out. active [B, n_kv]: see the reference (in a `clo`
    step most heads reuse their selection: their programs read nothing)."""
    n_kv, P, d = kmin.shape[1:]
    E = owner.shape[0]
    H = q.shape[1]
    R = int(rows)
    if R < 1 or R & (R - 1):
        raise ValueError(f"rows must be a power of two, got {rows}")
    scaled = scale is not None
    full = lambda a: pl.BlockSpec(a.shape, lambda i, h, n=a.ndim: (0,) * n)  # noqa: E731
    base = jnp.reshape(jnp.asarray(block_offset, jnp.int32), (1,))
    act = jnp.ones((q.shape[0], n_kv), jnp.int32) if active is None else jnp.asarray(active).astype(jnp.int32)
    args = [jnp.asarray(owner, jnp.int32), base, act, q, kmin, kmax] + ([scale.astype(jnp.float32)] if scaled else [])
    kernel = functools.partial(_quest_blocks_kernel, E=E, P=P, G=H // n_kv, d=d, dp=next_pow2(d), R=R,
                               scaled=scaled)
    return pl.pallas_call(
        kernel, grid=(cdiv(E * P, R), n_kv),
        in_specs=[full(a) for a in args],
        out_specs=pl.BlockSpec((E, n_kv, P), lambda i, h: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((E, n_kv, P), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="kvo_quest_block_bounds",
    )(*args)
