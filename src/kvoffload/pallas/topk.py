"""Top-k selection for sparse attention: scores per KV head (GQA group aggregated)
and index selection with forced sink / recent windows.

Score functions return float32 [B, n_kv, N] (N = tokens or pages), higher = more
relevant, -inf for invalid positions (>= lengths or >= num_pages). ``select_topk``
turns them into (indices [B, n_kv, K] int32 sorted ascending, num_valid [B, n_kv]
int32) ready for :func:`kvoffload.ops.sparse_attention`.

Every score function has a pure-jnp ``*_reference`` and a Pallas (Triton) ``*_kernel`` of
the same signature (plus ``interpret``, ``poison`` and launch parameters): exact q.K
scores, Quest page bounds (two fp32 matmuls on the sign-split query; a pool's blocks against their owners'
queries: f32 products summed row by row, `quest_block_bounds_*`), HATA Hamming scores
(xor + popcount on int32 words; ``popcount="swar"`` is a shift/mask fallback) and the
TokenSelect soft vote (exact, two passes: logits + per-split softmax statistics, then
the merged statistics normalise the logits). All tiles are powers of two; other sizes
are padded in registers with masked loads and stores.

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
    MASK_VALUE,
    NEG_INF,
    cdiv,
    cdiv_traced,
    decode_tiles,
    default_scale,
    dot,
    load,
    next_pow2,
    on_gpu,
    online_softmax_init,
    online_softmax_step,
    pallas_call,
    split_blocks,
    triton_params,
)
from kvoffload.pallas.decode_attention import load_padded, store_padded

# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _check_group_reduce(group_reduce):
    if group_reduce not in ("sum", "max", "mean"):
        raise ValueError(f"group_reduce must be sum|max|mean, got {group_reduce!r}")


def _reduce_group(s, group_reduce):
    """s [B, n_kv, G, N] -> [B, n_kv, N]."""
    _check_group_reduce(group_reduce)
    return {"sum": jnp.sum, "max": jnp.max, "mean": jnp.mean}[group_reduce](s, axis=2)


def _reduce_group_rows(s, G, group_reduce):
    """In-kernel twin of _reduce_group: reduce the first G rows of a row-padded tile
    s [Gp, N] (rows >= G are padding and ignored) -> [N]."""
    gmask = (jnp.arange(s.shape[0]) < G)[:, None]
    if group_reduce == "max":
        return jnp.max(jnp.where(gmask, s, -jnp.inf), axis=0)
    r = jnp.sum(jnp.where(gmask, s, 0.0), axis=0)
    return r / G if group_reduce == "mean" else r


def _load_rows(ref, start, block, row_ok, c, cp, other):
    """Load rows start..start+block (masked by row_ok) of a [N, c] ref as a [block, cp]
    tile (cp = c padded to a power of two; padded columns read as ``other``)."""
    if cp == c:
        return load(ref.at[pl.ds(start, block), :], mask=row_ok[:, None], other=other)
    rows = start + jnp.arange(block, dtype=jnp.int32)
    cols = jnp.arange(cp, dtype=jnp.int32)
    msk = row_ok[:, None] & (cols < c)[None, :]
    return load(ref.at[rows[:, None], cols[None, :]], mask=msk, other=other)


def _valid_mask(lengths, N, B):
    """[B, 1 or n_kv, N]: positions < lengths ([B], or per KV head [B, n_kv])."""
    if lengths is None:
        return jnp.ones((B, 1, N), bool)
    lengths = lengths.astype(jnp.int32)
    return jnp.arange(N)[None, None, :] < (lengths[:, :, None] if lengths.ndim == 2 else lengths[:, None, None])


# ----------------------------------------------------------------------------
# exact q.K scores
# ----------------------------------------------------------------------------


def topk_scores_exact_reference(q, k, lengths=None, *, scale=None, group_reduce="sum"):
    """q [B, n_heads, d], k [B, n_kv, S, d] -> scale * q.k aggregated over the group; -inf at positions >=
    lengths ([B], or [B, n_kv] per KV head: a head of length 0 is not scored, e.g. one that reuses a selection)."""
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
    o_ref[...] = jnp.where(row_ok, _reduce_group_rows(s, G, group_reduce), -jnp.inf)


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
            o_ref[b, h, :] = jnp.where(row_ok, _reduce_group_rows(s, G, group_reduce), -jnp.inf)

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
    _check_group_reduce(group_reduce)
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


def _quest_kernel(np_ref, q_ref, lo_ref, hi_ref, o_ref, *, block_p, P, G, Gp, d, dp,
                  group_reduce):
    # np_ref [1]; q_ref [G, d]; lo_ref, hi_ref [P, d]; o_ref [block_p]
    j = pl.program_id(2)
    start = j * block_p
    rows = start + jnp.arange(block_p, dtype=jnp.int32)
    row_ok = rows < jnp.minimum(np_ref[0], P)
    lo = _load_rows(lo_ref, start, block_p, row_ok, d, dp, 0.0).astype(jnp.float32)
    hi = _load_rows(hi_ref, start, block_p, row_ok, d, dp, 0.0).astype(jnp.float32)
    empty = jnp.max(jnp.where(lo > hi, 1.0, 0.0), axis=1) > 0.0  # min=+inf, max=-inf pages
    lo = jnp.where(jnp.abs(lo) < jnp.inf, lo, 0.0)
    hi = jnp.where(jnp.abs(hi) < jnp.inf, hi, 0.0)
    q = load_padded(q_ref, Gp, dp, G, d).astype(jnp.float32)
    # max(q*lo, q*hi) = max(q, 0)*hi + min(q, 0)*lo for lo <= hi: two fp32 matmuls
    s = (dot(jnp.maximum(q, 0.0), hi, trans_b=True)
         + dot(jnp.minimum(q, 0.0), lo, trans_b=True))  # [Gp, block_p]
    r = _reduce_group_rows(s, G, group_reduce)
    o_ref[...] = jnp.where(row_ok & jnp.logical_not(empty), r, -jnp.inf)


def quest_page_scores_kernel(q, kmin, kmax, num_pages=None, *, group_reduce="sum",
                             interpret=False, poison=False, block_p=None, num_warps=4):
    """Pallas (Triton) Quest page bounds; same semantics as the reference.

    One program per (batch, kv head, block of pages): the group's queries (fp32) against
    a [block_p, d] tile of kmin and kmax, as max(q,0) @ kmax^T + min(q,0) @ kmin^T
    (exact for kmin <= kmax), reduced over the group; empty pages (kmin > kmax, e.g.
    +inf/-inf from ``quest_page_minmax``) and pages >= num_pages give -inf."""
    _check_group_reduce(group_reduce)
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


def popcount_swar(x):
    """Population count of int32/uint32 words with shifts, masks and one multiply only
    (the SWAR bit trick); wraps modulo 2**32, so it is exact for every bit pattern."""
    x = x.astype(jnp.int32)
    sr = jax.lax.shift_right_logical
    x = x - (sr(x, jnp.int32(1)) & jnp.int32(0x55555555))
    x = (x & jnp.int32(0x33333333)) + (sr(x, jnp.int32(2)) & jnp.int32(0x33333333))
    x = (x + sr(x, jnp.int32(4))) & jnp.int32(0x0F0F0F0F)
    return sr(x * jnp.int32(0x01010101), jnp.int32(24))


def _popcount(x, popcount):
    if popcount == "native":  # int32 -> libdevice __nv_popc in the Triton lowering
        return jax.lax.population_count(x)
    if popcount == "swar":
        return popcount_swar(x)
    raise ValueError(f"popcount must be native|swar, got {popcount!r}")


def _hata_kernel(len_ref, q_ref, k_ref, *rest, block_s, S, G, W, Wp, r_bits, with_norm,
                 group_reduce, popcount):
    # len_ref [1]; q_ref [G, Wp] int32 (zero-padded words); k_ref [S, W] int32;
    # n_ref [S] (with_norm); o_ref [block_s]
    n_ref, o_ref = rest if with_norm else (None, rest[0])
    j = pl.program_id(2)
    start = j * block_s
    rows = start + jnp.arange(block_s, dtype=jnp.int32)
    row_ok = rows < jnp.minimum(len_ref[0], S)
    kb = _load_rows(k_ref, start, block_s, row_ok, W, Wp, 0)  # [block_s, Wp] int32
    nrm = load(n_ref.at[rows], mask=row_ok, other=0.0).astype(jnp.float32) if with_norm else None
    acc = None
    for g in range(G):  # static: G is small, each head is a [block_s, Wp] xor + popcount
        ham = jnp.sum(_popcount(jnp.bitwise_xor(kb, q_ref[g, :][None, :]), popcount), axis=1)
        s = (r_bits - ham).astype(jnp.float32)
        if with_norm:
            s = s * nrm
        if acc is None:
            acc = s
        elif group_reduce == "max":
            acc = jnp.maximum(acc, s)
        else:
            acc = acc + s
    if group_reduce == "mean":
        acc = acc / G
    o_ref[...] = jnp.where(row_ok, acc, -jnp.inf)


def hata_scores_kernel(q_codes, k_codes, lengths=None, *, k_norm=None, group_reduce="sum",
                       interpret=False, poison=False, block_s=None, popcount="native",
                       num_warps=4):
    """Pallas (Triton) HATA scores; same semantics as the reference.

    One program per (batch, kv head, block of keys): a [block_s, W] tile of key codes
    (bit-cast to int32, which the Triton popcount takes), xor with each query head's
    code, popcount (``popcount="native"``: lax.population_count -> __nv_popc;
    ``"swar"``: shifts/masks/multiply only), summed over words, times the key norm,
    reduced over the group."""
    _check_group_reduce(group_reduce)  # (a bad popcount name raises while tracing)
    B, H, W = q_codes.shape
    _, n_kv, S, _ = k_codes.shape
    G = H // n_kv
    Wp = max(2, next_pow2(W))
    if block_s is None:
        block_s = 256
    block_s = min(block_s, max(16, next_pow2(S)))
    n_blocks = cdiv(S, block_s)
    if lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    def as_i32(x):  # same bits; the Triton popcount takes int32
        return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)

    qc = as_i32(q_codes).reshape(B, n_kv, G, W)
    if Wp != W:
        qc = jnp.pad(qc, ((0, 0), (0, 0), (0, 0), (0, Wp - W)))
    with_norm = k_norm is not None
    kernel = functools.partial(_hata_kernel, block_s=block_s, S=S, G=G, W=W, Wp=Wp,
                               r_bits=32 * W, with_norm=with_norm, group_reduce=group_reduce,
                               popcount=popcount)
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, j: (b,)),
        pl.BlockSpec((None, None, G, Wp), lambda b, h, j: (b, h, 0, 0)),
        pl.BlockSpec((None, None, S, W), lambda b, h, j: (b, h, 0, 0)),
    ]
    args = [jnp.asarray(lengths, jnp.int32), qc, as_i32(k_codes)]
    if with_norm:
        in_specs.append(pl.BlockSpec((None, None, S), lambda b, h, j: (b, h, 0)))
        args.append(k_norm)
    out = pallas_call(
        kernel, poison=poison,
        grid=(B, n_kv, n_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_s), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, n_kv, n_blocks * block_s), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kvo_hata_scores",
    )(*args)
    return out[:, :, :S]


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
        kb = _load_rows(k_ref, start, block_s, row_ok, d, dp, 0.0)
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


# ----------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------


def orderable_keys(x):
    """float32 -> uint32 keys with the same order (larger float, larger key; -inf lowest, +inf highest;
    -0.0 and 0.0 one key: equal values tie)."""
    x = x.astype(jnp.float32)
    u = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(0x80000000))


def kth_largest_key(keys, k, *, digit_bits=4):
    """Radix select, most significant digit first: (T [R] uint32, take [R] int32) such that the k-th largest
    of keys [R, N] (uint32) is T and the top k are every key > T plus the first `take` keys == T (in index
    order). k [R] int32 in [1, N]. Each of the 32 / digit_bits rounds counts, for every candidate digit, the
    keys that share the prefix found so far and have a digit at least as large: one fused compare-and-sum
    over the row, no sort and no atomics. A row with k outside [1, N] gives an unspecified T (callers mask)."""
    assert 32 % digit_bits == 0, digit_bits
    R, N = keys.shape
    width = 1 << digit_bits
    cands = jnp.arange(1, width, dtype=jnp.uint32)
    prefix = jnp.zeros((R,), jnp.uint32)
    remaining = k.astype(jnp.int32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        above = shift + digit_bits
        digit = (keys >> shift) & jnp.uint32(width - 1)
        if above < 32:
            match = (keys >> above) == (prefix >> above)[:, None]
        else:
            match = jnp.ones_like(keys, dtype=bool)
        # counts[:, c - 1] = #(match & digit >= c), c = 1..width-1: non-increasing in c. Candidates major and
        # the row minor: a row reduction per (row, candidate), which XLA spreads over the GPU's SMs (candidates
        # minor measured 1.6x slower on an H100)
        counts = jnp.sum(match[:, None, :] & (digit[:, None, :] >= cands[None, :, None]), axis=2,
                         dtype=jnp.int32)
        d = jnp.sum(counts >= remaining[:, None], axis=1, dtype=jnp.int32)  # the largest c still holding k
        higher = jnp.take_along_axis(jnp.pad(counts, ((0, 0), (0, 1))), d[:, None], axis=1)[:, 0]  # > d
        remaining = remaining - higher
        prefix = prefix | (d.astype(jnp.uint32) << shift)
    return prefix, remaining


def prefix_count(mask, chunk=128):
    """Inclusive running count of True along the last axis of mask [R, N], as int32. Within chunks of
    `chunk` a 0/1 matmul with a triangular matrix (exact: bf16 0/1 inputs, fp32 sums <= chunk), across chunks
    a cumsum over N / chunk totals: a long cumsum is XLA's reduce-window scan, slow on the GPU at 1M."""
    R, N = mask.shape
    n_chunks = -(-N // chunk)
    m = jnp.pad(mask, ((0, 0), (0, n_chunks * chunk - N))).reshape(R, n_chunks, chunk)
    tri = jnp.triu(jnp.ones((chunk, chunk), jnp.bfloat16))  # tri[i, j] = 1 for i <= j
    within = jnp.einsum("rnc,cj->rnj", m.astype(jnp.bfloat16), tri,
                        preferred_element_type=jnp.float32).astype(jnp.int32)
    before = jnp.cumsum(within[:, :, -1], axis=1) - within[:, :, -1]  # exclusive, over chunks
    return (within + before[:, :, None]).reshape(R, n_chunks * chunk)[:, :N]


TOPK_METHODS = ("auto", "sort", "radix", "kernel")
# Off the GPU "auto" takes the XLA radix select from this many candidates per row, the sort below (on the CPU
# the Pallas kernels would run interpreted). A clo decode step on an H100 at 128K: radix 22.45 vs sort 25.68 ms
# per 32-layer step (2026-11-27).
RADIX_MIN_CANDIDATES = 1 << 17
# On the GPU "auto" takes the Pallas select ("kernel") from this many candidates: at 8 x 128K with one row
# selecting (a clo layer at a hit rate of ~0.86) 87 us against the XLA radix's 206 and the sort's 318, in a
# jit of 10 calls; the 128K clo step 18.7-19.8 ms against radix's 22.9. At 32K the sort's step was faster
# (19.7 vs 22.8 ms), so the sort below 128K (H100, BENCHMARKS 'Kernel timings') ...
KERNEL_MIN_CANDIDATES = 1 << 17
# ... except for short rows (page-level votes: a clo head's 128K tokens in pages of 32 are 4096 candidates), where
# the kernel's launches are short and the sort's are not: H200, 8 x 4096 44.6-53 us against the sort's 65-80,
# 8 x 16384 46.5 against 107-118, 512 x 256 (b64) 22-36 against 34-38 (2026-11-28)
KERNEL_MAX_SHORT = 1 << 14


def resolve_topk_method(method: str, n_candidates: int, gpu: bool | None = None) -> str:
    """The method `top_count_ascending` runs for `method` over rows of n_candidates (static) entries; gpu: the
    default backend is a GPU (None: ask JAX)."""
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method must be one of {TOPK_METHODS}, got {method!r}")
    if method == "auto":
        if on_gpu() if gpu is None else gpu:
            return "kernel" if n_candidates >= KERNEL_MIN_CANDIDATES or n_candidates <= KERNEL_MAX_SHORT else "sort"
        return "radix" if n_candidates >= RADIX_MIN_CANDIDATES else "sort"
    return method


def top_count_ascending(pri, counts, k, *, method="auto", digit_bits=4):
    """The top counts[r] entries of each row of pri [R, N] float32 (-inf = never), as (indices [R, k] int32
    ascending, then 0; num_valid [R] = min(counts, entries > -inf, k)). Ties go to the lower index; +inf
    entries (forced) come first. Two exact methods, the same indices:

    * "sort": ``jax.lax.top_k`` of k (XLA sorts each row), the first counts[r] kept, then sorted ascending.
    * "radix": the k-th largest value by a radix select (`kth_largest_key`), then an order-keeping compaction
      (`prefix_count` and a scatter of unique slots), all in XLA: no sort, but ~40 kernels, each over every row.
    * "kernel": the same radix select and compaction as Pallas kernels (`pallas/select.py`: 8 count launches
      and one compaction, many programs per row; rows of up to 16K keys one launch, a program a row; a row of
      count 0 exits at once). On an H100, 8 x 128K with
      one row selecting: 87 us against radix's 206 and the sort's 318. Off the GPU it runs interpreted (slow).
    * "auto" (the default): on the GPU "kernel" from KERNEL_MIN_CANDIDATES (128K) per row and up to
      KERNEL_MAX_SHORT (16K), else the sort; off it
      radix from RADIX_MIN_CANDIDATES (128K), else the sort."""
    R, N = pri.shape
    method = resolve_topk_method(method, N)
    k = int(min(k, N))
    pri = jnp.where(pri == 0, jnp.float32(0), pri.astype(jnp.float32))  # -0.0 ties 0.0 (lax.top_k orders them)
    n_ok = jnp.sum(pri > NEG_INF, axis=1, dtype=jnp.int32)
    want = jnp.clip(jnp.minimum(counts.astype(jnp.int32), n_ok), 0, k)
    if method == "kernel":
        from kvoffload.pallas.select import select_rows_kernel

        return select_rows_kernel(orderable_keys(pri), want, k, interpret=not on_gpu()), want
    if method == "sort":
        _, idx = jax.lax.top_k(pri, k)
        big = jnp.int32(2 ** 30)
        key = jnp.sort(jnp.where(jnp.arange(k)[None] < want[:, None], idx, big), axis=-1)
        return jnp.where(key < big, key, 0).astype(jnp.int32), want
    keys = orderable_keys(pri)
    T, take = kth_largest_key(keys, jnp.maximum(want, 1), digit_bits=digit_bits)
    gt = keys > T[:, None]
    eq = keys == T[:, None]
    eq_rank = prefix_count(eq)
    chosen = (gt | (eq & (eq_rank <= take[:, None]))) & (want > 0)[:, None]
    slot = prefix_count(chosen) - 1
    slot = jnp.where(chosen, slot, k)  # k: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, N))
    idx = jnp.zeros((R, k), jnp.int32).at[rows, slot].set(
        jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (R, N)), mode="drop", unique_indices=True)
    return idx, want


def select_topk(scores, k, *, lengths=None, num_sink=0, num_recent=0, page_size=1, counts=None, method="auto"):
    """Pick the top-k entries per KV head, forcing sink and recent windows in.

    scores [B, n_kv, N] float32 (-inf = invalid); N tokens (page_size=1) or pages.
    lengths [B] (tokens; with page_size>1 the valid page count is ceil(len/page_size));
    num_sink / num_recent are in tokens and are converted to the pages covering them.
    counts [B, n_kv] int32 (optional, each <= k): how many to pick per row instead of k.
    Returns (indices [B, n_kv, k] int32, num_valid [B, n_kv] int32). Valid indices come
    first, ascending, the rest are filled with 0 (in range, to be ignored via num_valid).
    If k exceeds the valid count, num_valid is the valid count. method: `top_count_ascending`'s.
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
    counts = jnp.full((B, n_kv), k, jnp.int32) if counts is None else jnp.minimum(counts, k)
    idx, nv = top_count_ascending(pri.reshape(B * n_kv, N), counts.reshape(B * n_kv), k, method=method)
    return idx.reshape(B, n_kv, k), nv.reshape(B, n_kv)
