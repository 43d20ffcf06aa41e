"""Correctness checks of every kernel and reference against float64 NumPy.

Used by tests/test_kernels*.py (CPU: references, and kernels with interpret=True) and by
benchmarks/check_kernels.py (GPU: compiled Triton kernels). Each ``check_*`` draws fresh
random inputs (never zeros), runs one implementation and returns a dict with the
relative error(s) and pass/fail. Kernel outputs are poisoned (NaN-initialised via
aliasing) so unwritten elements fail.

mode: "reference" (pure jnp), "kernel" (compiled Pallas), "interpret" (Pallas interpret).
"""

from __future__ import annotations


import numpy as np
import jax
import jax.numpy as jnp

from kvoffload.pallas import decode_attention as _da
from kvoffload.pallas import gather as _ga
from kvoffload.pallas import paged_attention as _pa
from kvoffload.pallas import prefill_attention as _pf
from kvoffload.pallas import quant as _q
from kvoffload.pallas import recompute as _rc
from kvoffload.pallas import sparse_attention as _sa
from kvoffload.pallas import stacked_linear as _sl
from kvoffload.pallas import topk as _tk
from kvoffload.pallas.common import next_pow2

TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# The kernels' bf16 path rounds p to bf16 before p @ V (as every flash kernel does);
# the float64 NumPy reference does not, hence the bf16 tolerance.


def _dt(name):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _rand(rng, shape, dtype, scale=1.0):
    x = rng.standard_normal(shape) * scale
    x = np.where(np.abs(x) < 1e-3, 1e-3, x)  # never exact zeros
    a = jnp.asarray(x, _dt(dtype))
    return a, np.asarray(a.astype(jnp.float32), np.float64)


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("nan")
    den = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((out - ref).ravel()) / max(den, 1e-30))


def lse_err(lse, ref):
    lse = np.asarray(lse, np.float64)
    ref = np.asarray(ref, np.float64)
    if lse.shape != ref.shape or np.any(np.isnan(lse)):
        return float("nan")
    fin = np.isfinite(ref)
    if np.any(np.isfinite(lse) != fin) or np.any(lse[~fin] != ref[~fin]):
        return float("inf")
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(lse[fin] - ref[fin]) / np.maximum(1.0, np.abs(ref[fin]))))


def _result(name, mode, errs, tol, **info):
    worst = max(errs.values()) if errs else 0.0
    ok = bool(np.isfinite(worst) and worst < tol)
    return dict(name=name, mode=mode, err=worst, tol=tol, ok=ok, **errs, **info)


# ----------------------------------------------------------------------------
# float64 NumPy references
# ----------------------------------------------------------------------------


def np_attend(q, k, v, valid, scale):
    """q [B, H, d]; k, v [B, n_kv, N, d]; valid [B, n_kv, N] -> out [B,H,d], lse [B,H]."""
    B, H, d = q.shape
    n_kv = k.shape[1]
    G = H // n_kv
    out = np.zeros((B, H, d))
    lse = np.full((B, H), -np.inf)
    for b in range(B):
        for h in range(H):
            kh = h // G
            m = valid[b, kh]
            if not m.any():
                continue
            s = (k[b, kh][m] @ q[b, h]) * scale
            mx = s.max()
            p = np.exp(s - mx)
            out[b, h] = p @ v[b, kh][m] / p.sum()
            lse[b, h] = mx + np.log(p.sum())
    return out, lse


def np_positions(indices, num_valid, page_size, S, lengths=None):
    B, n_kv, K = indices.shape
    N = K * page_size
    pos = np.zeros((B, n_kv, N), np.int64)
    ok = np.zeros((B, n_kv, N), bool)
    for b in range(B):
        lim = S if lengths is None else min(S, int(lengths[b]))
        for h in range(n_kv):
            nv = K if num_valid is None else int(num_valid[b, h])
            for e in range(K):
                for j in range(page_size):
                    p = int(indices[b, h, e]) * page_size + j
                    pos[b, h, e * page_size + j] = min(max(p, 0), S - 1)
                    ok[b, h, e * page_size + j] = e < nv and 0 <= p < lim
    return pos, ok


def np_recompute_kv(x, wk, bk, wv, bv, cos, sin, n_kv):
    """K, V [B, n_kv, T, d] = x @ W + b, RoPE (HF split-half) on K where cos/sin are given."""
    B, T, _ = x.shape
    d = wk.shape[1] // n_kv
    k = (x @ wk + bk).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
    v = (x @ wv + bv).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
    if cos is not None:
        c, s = cos[:, None], sin[:, None]
        k1, k2 = k[..., : d // 2], k[..., d // 2:]
        k = np.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], -1)
    return k, v


# ----------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------


def check_decode(B=3, n_kv=2, G=4, S=200, d=128, dtype="float32", lengths=None,
                 mode="reference", seed=0, **kw):
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, S, d), dtype)
    v, v64 = _rand(rng, (B, n_kv, S, d), dtype)
    if lengths is None:
        lengths = [S, 1] + list(rng.integers(1, S + 1, B - 2)) if B >= 2 else [S]
    lengths = np.asarray(lengths[:B], np.int32)
    scale = d ** -0.5
    valid = np.arange(S)[None, None, :] < lengths[:, None, None]
    valid = np.broadcast_to(valid, (B, n_kv, S))
    ro, rl = np_attend(q64, k64, v64, valid, scale)
    L = jnp.asarray(lengths)
    if mode == "reference":
        o, l = jax.jit(_da.decode_attention_reference)(q, k, v, L)
    else:
        o, l = jax.jit(lambda *a: _da.decode_attention_kernel(
            *a, interpret=(mode == "interpret"), poison=True, **kw))(q, k, v, L)
    errs = dict(err_out=rel_err(o, ro), err_lse=lse_err(l, rl))
    ok_dtype = o.dtype == q.dtype
    r = _result(f"decode B{B} kv{n_kv} G{G} S{S} d{d} {dtype}", mode, errs, TOL[dtype])
    r["ok"] = r["ok"] and ok_dtype
    return r


def np_paged_dense(blocks64, table, num_blocks):
    """float64 pool [E, n_kv, blk, d] + table -> dense [B, n_kv, M*blk, d] and valid mask."""
    E, n_kv, blk, d = blocks64.shape
    B, M = table.shape
    dense = np.zeros((B, n_kv, M * blk, d))
    for b in range(B):
        for j in range(int(num_blocks[b])):
            dense[b, :, j * blk:(j + 1) * blk] = blocks64[int(table[b, j])]
    valid = np.arange(M * blk)[None, None, :] < (np.asarray(num_blocks) * blk)[:, None, None]
    return dense, np.broadcast_to(valid, (B, n_kv, M * blk))


def random_block_table(rng, B, M, E, num_blocks):
    """Each row lists distinct random blocks; entries past num_blocks hold random junk in [0, E)."""
    table = rng.integers(0, E, (B, M)).astype(np.int32)
    for b in range(B):
        n = int(num_blocks[b])
        table[b, :n] = rng.permutation(E)[:n]
    return table


def check_paged(B=4, n_kv=2, G=4, d=128, blk=16, M=5, E=13, dtype="float32", num_blocks=None,
                mode="reference", seed=0, **kw):
    """Paged decode attention over a random pool and random ragged tables (rows with 0 and M
    blocks by default) vs float64 attention over the rows' blocks laid out densely."""
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (E, n_kv, blk, d), dtype)
    v, v64 = _rand(rng, (E, n_kv, blk, d), dtype)
    if num_blocks is None:
        num_blocks = [M, 0] + list(rng.integers(1, M + 1, max(0, B - 2)))
    num_blocks = np.asarray(num_blocks[:B], np.int32)
    table = random_block_table(rng, B, M, E, num_blocks)
    kd, valid = np_paged_dense(k64, table, num_blocks)
    vd, _ = np_paged_dense(v64, table, num_blocks)
    ro, rl = np_attend(q64, kd, vd, valid, d ** -0.5)
    args = (q, k, v, jnp.asarray(table), jnp.asarray(num_blocks))
    if mode == "reference":
        o, l = jax.jit(_pa.paged_decode_attention_reference)(*args)
    else:
        o, l = jax.jit(lambda *a: _pa.paged_decode_attention_kernel(
            *a, interpret=(mode == "interpret"), poison=True, **kw))(*args)
    errs = dict(err_out=rel_err(o, ro), err_lse=lse_err(l, rl))
    # an empty row is exactly (0, -inf)
    empty = num_blocks == 0
    exact_empty = bool(np.all(np.asarray(o.astype(jnp.float32))[empty] == 0)
                       and np.all(np.isneginf(np.asarray(l)[empty])))
    r = _result(f"paged B{B} kv{n_kv} G{G} d{d} blk{blk} M{M} E{E} {dtype}", mode, errs,
                TOL[dtype])
    r["ok"] = r["ok"] and exact_empty and o.dtype == q.dtype
    return r


def check_merge(dtype="float32", seed=0):
    """Split the keys into 3 disjoint sources (one empty for some rows), attend each with
    the reference, merge, compare with attention over the union."""
    rng = np.random.default_rng(seed)
    B, n_kv, G, S, d = 2, 2, 3, 96, 64
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, S, d), dtype)
    v, v64 = _rand(rng, (B, n_kv, S, d), dtype)
    lengths = np.array([S, 10], np.int32)
    valid = np.broadcast_to(np.arange(S)[None, None] < lengths[:, None, None], (B, n_kv, S))
    ro, rl = np_attend(q64, k64, v64, valid, d ** -0.5)
    cuts = [0, 8, 40, S]
    parts = []
    for a, b_ in zip(cuts[:-1], cuts[1:]):
        ln = np.clip(lengths - a, 0, b_ - a).astype(np.int32)
        parts.append(_da.decode_attention_reference(q, k[:, :, a:b_], v[:, :, a:b_],
                                                    jnp.asarray(ln)))
    o, l = _da.merge_attention(parts)
    errs = dict(err_out=rel_err(o, ro), err_lse=lse_err(l, rl))
    # all-empty merge -> (0, -inf)
    e = [(jnp.ones((2, 3, 4)), jnp.full((2, 3), -jnp.inf))] * 2
    eo, el = _da.merge_attention(e)
    empty_ok = bool(np.all(np.asarray(eo) == 0) and np.all(np.isneginf(np.asarray(el))))
    r = _result(f"merge 3 sources {dtype}", "reference", errs, TOL[dtype])
    r["ok"] = r["ok"] and empty_ok
    return r


def check_merge_splits(B=2, n_kv=3, NS=66, G=7, d=80, mode="reference", seed=0):
    """The flash-decoding merge (`decode_attention.merge_splits`, one program per query row) of random
    partials [B, n_kv, NS, Gp, dp] against float64 NumPy, with empty splits (lse -inf) and one row empty in
    every split (out 0, lse -inf); mode reference is the jnp merge (`merge_attention`) of the same splits."""
    rng = np.random.default_rng(seed)
    Gp, dp = max(16, next_pow2(G)), max(16, next_pow2(d))
    o = rng.standard_normal((B, n_kv, NS, Gp, dp)).astype(np.float32)
    lse = (rng.standard_normal((B, n_kv, NS, Gp)) * 4).astype(np.float32)
    lse[rng.random(lse.shape) < 0.2] = -np.inf
    lse[0, 0, :, G - 1] = -np.inf
    o[np.isneginf(lse)] = 0.0
    o64, l64 = o.astype(np.float64), lse.astype(np.float64)
    m = np.max(l64, axis=2, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isfinite(l64), np.exp(l64 - m), 0.0)
    tot = np.sum(w, axis=2)
    want_o = (np.sum(w[..., None] * o64, axis=2) / np.where(tot > 0, tot, 1.0)[..., None])[:, :, :G, :d]
    want_l = np.where(tot > 0, m[:, :, 0] + np.log(np.where(tot > 0, tot, 1.0)), -np.inf)[:, :, :G]
    if mode == "reference":
        parts = [(jnp.asarray(o[:, :, s, :G, :d]), jnp.asarray(lse[:, :, s, :G])) for s in range(NS)]
        got_o, got_l = _da.merge_attention(parts)
    else:
        got_o, got_l = jax.jit(lambda o, l: _da.merge_splits(o, l, G=G, d=d, out_dtype=jnp.float32,
                                                             interpret=(mode == "interpret")))(o, lse)
    errs = dict(err_out=rel_err(got_o, want_o), err_lse=lse_err(got_l, want_l))
    return _result(f"merge_splits B{B} kv{n_kv} NS{NS} G{G} d{d}", mode, errs, TOL["float32"])


def check_sparse(B=2, n_kv=2, G=4, S=256, d=128, K=24, page_size=1, dtype="float32",
                 mode="reference", seed=0, with_lengths=False, **kw):
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, S, d), dtype)
    v, v64 = _rand(rng, (B, n_kv, S, d), dtype)
    n_entries = -(-S // page_size)
    K = min(K, n_entries)
    idx = np.stack([np.stack([rng.permutation(n_entries)[:K] for _ in range(n_kv)])
                    for _ in range(B)]).astype(np.int32)
    nv = rng.integers(1, K + 1, (B, n_kv)).astype(np.int32)
    nv[0, 0] = K
    if B > 1:
        nv[-1, -1] = 0  # an empty selection -> out 0, lse -inf
    lengths = None
    if with_lengths:
        lengths = rng.integers(S // 2, S + 1, B).astype(np.int32)
    pos, ok = np_positions(idx, nv, page_size, S, lengths)
    kg = np.take_along_axis(k64, pos[..., None], axis=2)
    vg = np.take_along_axis(v64, pos[..., None], axis=2)
    ro, rl = np_attend(q64, kg, vg, ok, d ** -0.5)
    args = (q, k, v, jnp.asarray(idx))
    kwargs = dict(num_valid=jnp.asarray(nv), page_size=page_size,
                  lengths=None if lengths is None else jnp.asarray(lengths))
    if mode == "reference":
        o, l = _sa.sparse_attention_reference(*args, **kwargs)
    else:
        o, l = _sa.sparse_attention_kernel(*args, **kwargs, interpret=(mode == "interpret"),
                                           poison=True, **kw)
    errs = dict(err_out=rel_err(o, ro), err_lse=lse_err(l, rl))
    return _result(f"sparse B{B} kv{n_kv} G{G} S{S} d{d} K{K} page{page_size} {dtype}",
                   mode, errs, TOL[dtype])


def check_rows_attention(B=2, n_kv=2, G=4, K=300, d=128, layers=1, dtype="float32", mode="reference", seed=0, **kw):
    """Attention over row buffers (`sparse_attention.rows_attention_*`): each (request, head)'s first num_valid
    rows (one full, one empty, the rest random) of a [B, n_kv, layers K, d] buffer at layer layers // 2's rows
    (a loop over stacked layers), against float64 NumPy."""
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, layers * K, d), dtype)
    v, v64 = _rand(rng, (B, n_kv, layers * K, d), dtype)
    nv = rng.integers(1, K + 1, (B, n_kv)).astype(np.int32)
    nv[0, 0] = K
    if B > 1:
        nv[-1, -1] = 0
    at = (layers // 2) * K
    ok = np.arange(K)[None, None] < nv[..., None]
    ro, rl = np_attend(q64, k64[:, :, at:at + K], v64[:, :, at:at + K], ok, d ** -0.5)
    off = jnp.int32(at) if layers > 1 else None
    if mode == "reference":
        o, l = _sa.rows_attention_reference(q, k, v, jnp.asarray(nv), K, row_offset=off)
    else:
        o, l = _sa.rows_attention_kernel(q, k, v, jnp.asarray(nv), K, row_offset=off, interpret=(mode == "interpret"),
                                         poison=True, **kw)
    errs = dict(err_out=rel_err(o, ro), err_lse=lse_err(l, rl))
    return _result(f"rows_attention B{B} kv{n_kv} G{G} K{K} d{d} {dtype}"
                   + (f" layer {layers // 2} of {layers}" if layers > 1 else ""), mode, errs, TOL[dtype])


def check_recompute(B=2, T=40, H=128, n_kv=2, d=64, dtype="float32", bias=True, rope=True,
                    mode="reference", seed=0, **kw):
    rng = np.random.default_rng(seed)
    x, x64 = _rand(rng, (B, T, H), dtype)
    wk, wk64 = _rand(rng, (H, n_kv * d), dtype, scale=H ** -0.5)
    wv, wv64 = _rand(rng, (H, n_kv * d), dtype, scale=H ** -0.5)
    if bias:
        bk, bk64 = _rand(rng, (n_kv * d,), dtype)
        bv, bv64 = _rand(rng, (n_kv * d,), dtype)
    else:
        bk = bv = None
        bk64 = bv64 = np.zeros(n_kv * d)
    if rope:
        ang = rng.uniform(0, 2 * np.pi, (B, T, d // 2))
        cos, cos64 = _rand(rng, (B, T, d // 2), dtype)
        cos = jnp.asarray(np.cos(ang), _dt(dtype))
        sin = jnp.asarray(np.sin(ang), _dt(dtype))
        cos64 = np.asarray(cos.astype(jnp.float32), np.float64)
        sin64 = np.asarray(sin.astype(jnp.float32), np.float64)
    else:
        cos = sin = None
    k64, v64 = np_recompute_kv(x64, wk64, bk64, wv64, bv64, cos64 if rope else None,
                               sin64 if rope else None, n_kv)
    args = (x, wk, bk, wv, bv, cos, sin)
    if mode == "reference":
        k, v = _rc.recompute_kv_reference(*args, n_kv=n_kv)
    else:
        k, v = _rc.recompute_kv_kernel(*args, n_kv=n_kv, interpret=(mode == "interpret"),
                                       poison=True, **kw)
    errs = dict(err_k=rel_err(k, k64), err_v=rel_err(v, v64))
    r = _result(f"recompute B{B} T{T} H{H} kv{n_kv} d{d} bias{int(bias)} rope{int(rope)} "
                f"{dtype}", mode, errs, TOL[dtype])
    r["ok"] = r["ok"] and k.dtype == x.dtype and v.dtype == x.dtype
    return r


def check_scores_exact(B=2, n_kv=2, G=4, S=150, d=96, dtype="float32", group_reduce="sum",
                       mode="reference", seed=0, per_head=False):
    """per_head: lengths [B, n_kv] (one head of length 0: not scored, -inf everywhere)."""
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, S, d), dtype)
    if per_head:
        lengths = rng.integers(1, S + 1, (B, n_kv)).astype(np.int32)
        lengths[0, 0], lengths[-1, -1] = S, 0
    else:
        lengths = np.array([S] + list(rng.integers(1, S + 1, B - 1)), np.int32)
    s = np.einsum("bhgd,bhsd->bhgs", q64.reshape(B, n_kv, G, d), k64) * d ** -0.5
    red = {"sum": np.sum, "max": np.max, "mean": np.mean}[group_reduce]
    ref = red(s, axis=2)
    valid = np.arange(S)[None, None] < (lengths[:, :, None] if per_head else lengths[:, None, None])
    L = jnp.asarray(lengths)
    if mode == "reference":
        out = _tk.topk_scores_exact_reference(q, k, L, group_reduce=group_reduce)
    else:
        out = _tk.topk_scores_exact_kernel(q, k, L, group_reduce=group_reduce,
                                           interpret=(mode == "interpret"), poison=True)
    out = np.asarray(out, np.float64)
    inval_ok = bool(np.all(np.isneginf(out[~np.broadcast_to(valid, out.shape)])))
    vm = np.broadcast_to(valid, out.shape)
    errs = dict(err_scores=rel_err(out[vm], ref[vm]) if inval_ok else float("inf"))
    return _result(f"scores_exact {group_reduce} B{B} kv{n_kv} G{G} S{S} d{d} {dtype}"
                   + (" per-head lengths" if per_head else ""), mode, errs, TOL[dtype])


def _mode_kw(mode, kw):
    return dict(interpret=(mode == "interpret"), poison=True, **kw)


def _check_scores(name, mode, out, ref, valid, tol):
    """Scores [B, n_kv, N]: -inf exactly where not valid, relative error where valid."""
    out = np.asarray(out, np.float64)
    vm = np.broadcast_to(valid, out.shape)
    ok_inf = bool(out.shape == ref.shape and np.all(np.isneginf(out[~vm])))
    errs = dict(err_scores=rel_err(out[vm], ref[vm]) if ok_inf else float("inf"))
    return _result(name, mode, errs, tol)


_NP_REDUCE = {"sum": np.sum, "max": np.max, "mean": np.mean}


def check_quest(B=2, n_kv=2, G=3, S=200, d=64, page_size=16, dtype="float32",
                group_reduce="sum", with_num_pages=True, mode="reference", seed=0, **kw):
    """Quest page bounds from quest_page_minmax metadata (ragged lengths: partial and
    empty pages) against a float64 loop over pages and heads."""
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, S, d), dtype)
    lengths = np.array([S, 37] + list(rng.integers(1, S + 1, max(0, B - 2))), np.int32)[:B]
    kmin, kmax = _tk.quest_page_minmax(k, page_size, jnp.asarray(lengths))
    P = -(-S // page_size)
    ref = np.full((B, n_kv, P), -np.inf)
    for b in range(B):
        for h in range(n_kv):
            for p in range(P):
                a, e = p * page_size, min((p + 1) * page_size, lengths[b])
                if a >= e:
                    continue
                mn, mx = k64[b, h, a:e].min(0), k64[b, h, a:e].max(0)
                per_head = [np.maximum(q64[b, h * G + g] * mn, q64[b, h * G + g] * mx).sum()
                            for g in range(G)]
                ref[b, h, p] = _NP_REDUCE[group_reduce](per_head)
    # with num_pages the pages past it are cut even where they hold keys (here: the last
    # page of row 0); without, the empty pages alone give -inf
    npages = -(-lengths // page_size)
    if with_num_pages:
        npages[0] = max(0, npages[0] - 1)
        ref[0, :, npages[0]:] = -np.inf
    np_arg = jnp.asarray(npages) if with_num_pages else None
    if mode == "reference":
        out = _tk.quest_page_scores_reference(q, kmin, kmax, np_arg, group_reduce=group_reduce)
    else:
        out = _tk.quest_page_scores_kernel(q, kmin, kmax, np_arg, group_reduce=group_reduce,
                                           **_mode_kw(mode, kw))
    return _check_scores(f"quest {group_reduce} B{B} kv{n_kv} G{G} S{S} d{d} page{page_size} "
                         f"{dtype} np{int(with_num_pages)}", mode, out, ref,
                         np.isfinite(ref), 1e-5)


def check_quest_blocks(B=2, E=13, n_kv=2, G=3, P=2, d=64, dtype="float32", int8=True, layers=1, active=False,
                       mode="reference", seed=0, **kw):
    """Quest's page bounds of pool blocks against their owners' queries (`quest_block_bounds_*`: int8 pages with
    a scale per page, or pages in the query's dtype; free blocks, owner -1, scored against request 0) against a
    float64 loop over blocks, heads and pages. layers > 1: the pages of that many layers stacked [layers E, ...],
    layer layers // 2's read at block_offset (a loop over stacked layers reading its layer's pages in place).
    active: about half the (request, head)s inactive (reusing heads): -inf there, exactly."""
    from kvoffload.policies.clo import quest_int8

    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    owner = rng.integers(-1, B, E).astype(np.int32)
    lo, _ = _rand(rng, (layers * E, n_kv, P, d), dtype)
    hi = lo + jnp.abs(_rand(rng, (layers * E, n_kv, P, d), dtype)[0])
    stacked = quest_int8(lo, hi) if int8 else (lo, hi, None)
    at = (layers // 2) * E
    pages = tuple(None if a is None else a[at:at + E] for a in stacked)
    mn64, mx64 = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64) for a in pages[:2])
    sc64 = np.ones((E, n_kv, P)) if pages[2] is None else np.asarray(pages[2], np.float64)
    ref = np.zeros((E, n_kv, P))
    for e in range(E):
        for h in range(n_kv):
            qs = q64[max(owner[e], 0), h * G:(h + 1) * G]  # [G, d]
            for p in range(P):
                ref[e, h, p] = sc64[e, h, p] * np.max(np.maximum(qs * mn64[e, h, p], qs * mx64[e, h, p]).sum(-1))
    off = dict(block_offset=jnp.int32(at)) if layers > 1 else {}
    dead = np.zeros((E, n_kv, P), bool)
    if active:
        act = rng.random((B, n_kv)) < 0.5
        act[0, 0], act[-1, -1] = True, False
        off["active"] = jnp.asarray(act)
        dead = np.broadcast_to(~act[np.maximum(owner, 0)][:, :, None], dead.shape)
    ref = np.where(dead, 1.0, ref)
    if mode == "reference":
        out = _tk.quest_block_bounds_reference(q, jnp.asarray(owner), *stacked, **off)
    else:
        out = _tk.quest_block_bounds_kernel(q, jnp.asarray(owner), *stacked, interpret=(mode == "interpret"), **off,
                                            **kw)
    out = np.asarray(out, np.float64)
    err = float(np.max(np.abs(np.where(dead, 1.0, out) - ref)) / np.max(np.abs(ref)))
    err = err if np.all(np.isneginf(out[dead])) else float("inf")
    return _result(f"quest_blocks B{B} E{E} kv{n_kv} G{G} P{P} d{d} {dtype} int8={int8}"
                   + (f" layer {layers // 2} of {layers}" if layers > 1 else "") + (" active" if active else ""),
                   mode, dict(err_rel=err), 1e-5)


def np_hata_encode(x64, w64):
    proj = x64 @ w64
    bits = (proj > 0).astype(np.uint64)
    r = w64.shape[1]
    bits = bits.reshape(*bits.shape[:-1], r // 32, 32)
    return (bits << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def check_hata(B=2, n_kv=2, G=4, S=100, d=64, r=128, seed=0, with_norm=True,
               group_reduce="sum", lengths=None, mode="reference", **kw):
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), "float32")
    k, k64 = _rand(rng, (B, n_kv, S, d), "float32")
    w, w64 = _rand(rng, (d, r), "float32")
    qc = _tk.hata_encode(q, w)
    kc = _tk.hata_encode(k, w)
    qc_ref = np_hata_encode(q64, w64)
    kc_ref = np_hata_encode(k64, w64)
    codes_ok = bool(np.array_equal(np.asarray(qc), qc_ref) and
                    np.array_equal(np.asarray(kc), kc_ref))
    # explicit bit-layout check: bit j in word j//32 at position j%32
    proj = q64[0, 0] @ w64
    j = int(rng.integers(0, r))
    layout_ok = bool(((int(qc_ref[0, 0, j // 32]) >> (j % 32)) & 1) == int(proj[j] > 0))
    kn = np.linalg.norm(k64, axis=-1) if with_norm else None
    if lengths is None:
        lengths = [S, 7] + [S // 2] * max(0, B - 2)
    lengths = np.asarray(lengths[:B], np.int32)
    ham = np.zeros((B, n_kv, G, S))
    for b in range(B):
        for h in range(n_kv):
            for g in range(G):
                x = np.bitwise_xor(qc_ref[b, h * G + g][None, :], kc_ref[b, h])
                ham[b, h, g] = np.unpackbits(x.view(np.uint8), axis=-1).sum(-1)
    sc = r - ham
    if with_norm:
        sc = sc * kn[:, :, None]
    ref = _NP_REDUCE[group_reduce](sc, axis=2)
    args = (qc, kc, jnp.asarray(lengths))
    kn_arg = None if kn is None else jnp.asarray(kn, jnp.float32)
    if mode == "reference":
        out = _tk.hata_scores_reference(*args, k_norm=kn_arg, group_reduce=group_reduce)
    else:
        out = _tk.hata_scores_kernel(*args, k_norm=kn_arg, group_reduce=group_reduce,
                                     **_mode_kw(mode, kw))
    valid = np.arange(S)[None, None] < lengths[:, None, None]
    pc = kw.get("popcount", "")
    r_ = _check_scores(f"hata {group_reduce} B{B} kv{n_kv} G{G} S{S} d{d} r{r} "
                       f"norm{int(with_norm)} {pc}".rstrip(), mode, out, ref, valid, 1e-5)
    r_["ok"] = r_["ok"] and codes_ok and layout_ok
    return r_


def check_popcount(seed=0):
    """popcount_swar (the Triton-safe fallback) == lax.population_count == NumPy, on
    random words and the edge patterns (0, 1, sign bit, all ones)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32),
                        np.array([0, 1, 0x80000000, 0xFFFFFFFF, 0x7FFFFFFF], np.uint32)])
    want = np.unpackbits(x.view(np.uint8).reshape(-1, 4), axis=-1).sum(-1)
    got_u = np.asarray(_tk.popcount_swar(jnp.asarray(x)))
    got_i = np.asarray(_tk.popcount_swar(jnp.asarray(x.view(np.int32))))
    native = np.asarray(jax.lax.population_count(jnp.asarray(x.view(np.int32))))
    ok = bool(np.array_equal(got_u, want) and np.array_equal(got_i, want)
              and np.array_equal(native, want))
    return _result("popcount swar/native vs numpy", "reference", {}, 1.0) | {"ok": ok}


def check_tokenselect(B=2, n_kv=2, G=4, S=120, d=64, shared=False, dtype="float32",
                      lengths=None, mode="reference", seed=0, **kw):
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, S, d), dtype)
    if lengths is None:
        lengths = [S, 9] + list(rng.integers(1, S + 1, max(0, B - 2)))
    lengths = np.asarray(lengths[:B], np.int32)
    s = np.einsum("bhgd,bhsd->bhgs", q64.reshape(B, n_kv, G, d), k64) * d ** -0.5
    valid = np.arange(S)[None, None, None] < lengths[:, None, None, None]
    s = np.where(valid, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    p = np.where(valid, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    vote = p.sum(2)
    if shared:
        vote = np.broadcast_to(vote.sum(1, keepdims=True), vote.shape)
    L = jnp.asarray(lengths)
    if mode == "reference":
        out = _tk.tokenselect_scores_reference(q, k, L, shared=shared)
    else:
        out = _tk.tokenselect_scores_kernel(q, k, L, shared=shared, **_mode_kw(mode, kw))
    tol = 1e-5 if dtype == "float32" else 1e-4  # bf16 products are exact in fp32
    return _check_scores(f"tokenselect B{B} kv{n_kv} G{G} S{S} d{d} shared{int(shared)} "
                         f"{dtype}", mode, out, vote, valid[:, :, 0], tol)


def check_select(B=3, n_kv=2, N=300, k=40, num_sink=4, num_recent=16, page_size=1, seed=0):
    """select_topk: forced sink/recent included, remaining slots = best other scores,
    indices unique, in range, ascending, num_valid right."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((B, n_kv, N)).astype(np.float32)
    lengths = np.array([N * page_size, 3, 100][:B], np.int32)
    idx, nv = _tk.select_topk(jnp.asarray(scores), k, lengths=jnp.asarray(lengths),
                              num_sink=num_sink, num_recent=num_recent, page_size=page_size)
    idx, nv = np.asarray(idx), np.asarray(nv)
    ok = True
    for b in range(B):
        n_ent = -(-int(lengths[b]) // page_size)
        n_ent = min(n_ent, N)
        ent = np.arange(n_ent)
        forced = set(ent[(ent * page_size < num_sink) |
                         ((ent + 1) * page_size > lengths[b] - num_recent)].tolist())
        for h in range(n_kv):
            want_n = min(k, n_ent)
            got = idx[b, h, : nv[b, h]]
            ok &= nv[b, h] == want_n
            ok &= len(set(got.tolist())) == len(got)
            ok &= bool(np.all(np.diff(got) > 0))
            ok &= forced.issubset(set(got.tolist())) or len(forced) > want_n
            rest = [e for e in np.argsort(-scores[b, h, :n_ent]) if e not in forced]
            want = set(list(forced)[:want_n]) | set(rest[: max(0, want_n - len(forced))])
            ok &= set(got.tolist()) == want
            ok &= bool(np.all(idx[b, h, nv[b, h]:] == 0))
    return _result(f"select_topk B{B} N{N} k{k} sink{num_sink} recent{num_recent} "
                   f"page{page_size}", "reference", {}, 1.0, ) | {"ok": bool(ok)}


def check_select_rows(R=8, N=131072, ratio=0.1, kind="normal", mode="reference", seed=0, **kw):
    """The selection's top-k by the Pallas kernels (`pallas/select.py`, mode kernel / interpret) or by the XLA radix
    select (mode reference) against `jax.lax.top_k` + sort (`top_count_ascending(method="sort")`), with
    per-row counts, forced +inf entries and (kind "ties") integer scores: the same indices, exactly."""
    rng = np.random.default_rng(seed)
    k = max(1, int(N * ratio))
    pri = rng.standard_normal((R, N)).astype(np.float32)
    if kind == "ties":
        pri = rng.integers(0, 64, (R, N)).astype(np.float32)
    pri[:, :4] = np.inf
    pri[rng.random((R, N)) < 0.05] = -np.inf
    counts = rng.integers(k // 2, k + 1, R).astype(np.int32)
    counts[R // 2] = 0  # a row that reuses its selection: skipped, zeros out
    p, c = jnp.asarray(pri), jnp.asarray(counts)
    want, nv = jax.jit(lambda p, c: _tk.top_count_ascending(p, c, k, method="sort"))(p, c)
    if mode == "reference":
        got, gnv = jax.jit(lambda p, c: _tk.top_count_ascending(p, c, k, method="radix"))(p, c)
    else:
        from kvoffload.pallas.select import select_rows_kernel

        got = jax.jit(lambda p, n: select_rows_kernel(_tk.orderable_keys(p), n, k, interpret=(mode == "interpret"),
                                                      **kw))(p, nv)
        gnv = nv
    bad = float(np.mean(np.asarray(got) != np.asarray(want))) + float(np.any(np.asarray(gnv) != np.asarray(nv)))
    return _result(f"select_rows R{R} N{N} k{k} {kind}", mode, dict(err_mismatch=bad), 1e-12)


def check_quantize(shape=(2, 3, 50, 128), group_size=64, bits=4, seed=0):
    """quantize_int4 / quantize_int8 against NumPy: codes (15 or 255 steps a group), step and min, and every
    dequantized value within half a step of its input; int4's split-half packing round trip and layout."""
    rng = np.random.default_rng(seed)
    x, x64 = _rand(rng, shape, "float32", scale=2.0)
    top = 15 if bits == 4 else 255
    qx = (_q.quantize_int4 if bits == 4 else _q.quantize_int8)(x, group_size)
    D = shape[-1]
    xg = x64.reshape(*shape[:-1], D // group_size, group_size)
    mn = xg.min(-1)
    step = (xg.max(-1) - mn) / top
    codes_ref = np.clip(np.round((xg - mn[..., None]) / step[..., None]), 0, top).reshape(shape)
    codes = np.asarray(_q.unpack_int4(qx.codes) if bits == 4 else qx.codes).astype(np.float64)
    mism = np.abs(codes - codes_ref)
    codes_ok = bool(qx.bits == bits and codes.shape == shape and mism.max() <= 1 and (mism > 0).mean() < 1e-3)
    deq = np.asarray(_q.dequantize(qx), np.float64)
    bound = np.repeat(step, group_size, axis=-1).reshape(shape) * 0.5 * (1 + 1e-4) + 1e-6
    deq_ok = bool(np.all(np.abs(deq - x64) <= bound))
    packing_ok = True
    if bits == 4:  # pack/unpack round trip and layout (byte j = code j | code j+D/2 << 4)
        c = jnp.asarray(rng.integers(0, 16, shape), jnp.uint8)
        pk = _q.pack_int4(c)
        packing_ok = bool(np.array_equal(np.asarray(_q.unpack_int4(pk)), np.asarray(c))
                          and np.array_equal(np.asarray(pk) & 15, np.asarray(c)[..., : D // 2]))
    errs = dict(err_step=rel_err(qx.step, step), err_min=rel_err(qx.mn, mn))
    r = _result(f"quantize_int{bits} {shape} g{group_size}", "reference", errs, 1e-5)
    r["ok"] = r["ok"] and codes_ok and deq_ok and packing_ok
    return r


def check_int4_decode(B=3, n_kv=2, G=4, S=150, d=128, group_size=64, dtype="float32",
                      mode="reference", seed=0, **kw):
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), dtype)
    k, _ = _rand(rng, (B, n_kv, S, d), "float32")
    v, _ = _rand(rng, (B, n_kv, S, d), "float32")
    kq = _q.quantize_int4(k, group_size)
    vq = _q.quantize_int4(v, group_size)
    k64 = np.asarray(_q.dequantize(kq), np.float64)
    v64 = np.asarray(_q.dequantize(vq), np.float64)
    lengths = np.array([S, 1] + list(rng.integers(1, S + 1, max(0, B - 2))), np.int32)[:B]
    valid = np.broadcast_to(np.arange(S)[None, None] < lengths[:, None, None], (B, n_kv, S))
    ro, rl = np_attend(q64, k64, v64, valid, d ** -0.5)
    L = jnp.asarray(lengths)
    if mode == "reference":
        o, l = _q.decode_attention_int4_reference(q, kq, vq, L)
    else:
        o, l = _q.decode_attention_int4_kernel(q, kq, vq, L, interpret=(mode == "interpret"),
                                               poison=True, **kw)
    errs = dict(err_out=rel_err(o, ro), err_lse=lse_err(l, rl))
    return _result(f"int4_decode B{B} kv{n_kv} G{G} S{S} d{d} g{group_size} {dtype}", mode,
                   errs, TOL[dtype])


def check_gather(B=2, n_kv=2, E=5, blk=24, d=80, K=37, dtype="float32", mode="reference", seed=0,
                 host=False, **kw):
    """Rows x[block, head, offset] of one extent vs NumPy indexing, exactly (a gather does no
    arithmetic): random x (never zeros; dtype uint8: int4 codes 1..255), blocks drawn from
    [-2, E + 3) so some rows are outside the extent (must come back 0), random offsets.
    host=True: the extent in pinned_host memory, gathered inside a jit (the zero-copy path)."""
    rng = np.random.default_rng(seed)
    if dtype == "uint8":
        x64 = rng.integers(1, 256, (E, n_kv, blk, d)).astype(np.float64)
        x = jnp.asarray(x64, jnp.uint8)
    else:
        x, x64 = _rand(rng, (E, n_kv, blk, d), dtype)
    block = rng.integers(-2, E + 3, (B, n_kv, K)).astype(np.int32)
    block[0, 0, 0] = E - 1  # the last block and (below) a row outside, whatever the draw
    block[-1, -1, -1] = E
    offset = rng.integers(0, blk, (B, n_kv, K)).astype(np.int32)
    inside = (block >= 0) & (block < E)
    want = np.where(inside[..., None],
                    x64[np.clip(block, 0, E - 1), np.arange(n_kv)[None, :, None], offset], 0.0)
    if host:
        dev = jax.devices()[0]
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    args = (x, jnp.asarray(block), jnp.asarray(offset))
    if mode == "reference":
        fn = _ga.gather_rows_reference_host if host else _ga.gather_rows_reference
        out = jax.jit(fn)(*args)
    else:
        out = jax.jit(lambda *a: _ga.gather_rows_kernel(*a, interpret=(mode == "interpret"),
                                                       poison=True, **kw))(*args)
    got = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    bad = float(np.mean(got != want)) if got.shape == want.shape else float("inf")
    r = _result(f"gather E{E} blk{blk} B{B} kv{n_kv} K{K} d{d} {dtype}{' host' if host else ''}", mode,
                dict(err_mismatch=bad), 1e-12)
    r["ok"] = r["ok"] and out.dtype == x.dtype and str(getattr(out.sharding, "memory_kind", "device")) == "device"
    return r


def _np_dequantize(qx) -> np.ndarray:
    """A per-token-group QuantizedInt's values in NumPy float64 of float32 arithmetic: codes * step + min."""
    codes = np.asarray(qx.codes)
    if qx.bits == 4:  # split-half packing: low nibbles the first half of the columns
        codes = np.concatenate([codes & 15, codes >> 4], axis=-1)
    c = codes.astype(np.float32).reshape(*codes.shape[:-1], -1, qx.group_size)
    x = c * np.asarray(qx.step, np.float32)[..., None] + np.asarray(qx.mn, np.float32)[..., None]
    return x.reshape(codes.shape).astype(np.float64)


def check_refill(B=2, n_kv=2, sizes=(5, 3), blk=24, d=80, K=37, dtype="float32", mode="reference", seed=0,
                 host=False, ext_dtype=None, bits=None, group_size=16, layers=1, layer=0, **kw):
    """A row buffer refilled from extents (``refill_rows_kernel``) vs NumPy, exactly: random buffer and extents
    (never zeros), per (request, head) a random count of rows replaced by random pool tokens spread over every
    extent (-1 past the count, and one head keeping all its rows: a hit), a few tokens past the last extent
    (kept). host=True: the extents in pinned_host memory (read in place). ext_dtype: the extents' dtype when
    it differs from the buffer's (cast on the way). bits 4 / 8: the extents group-quantized (``QuantizedInt``,
    per-token groups of group_size; ``refill_rows_int_kernel``), against their dequantized values in NumPy
    (codes * step + min in float32, as ``quant.dequantize``): within one rounding of the buffer's dtype, since
    the kernel may fuse the multiply-add. layers > 1: the buffer holds that many layers' K rows a head and
    layer `layer`'s are refilled (the row offset layer x K, traced); every other row must stay as it was."""
    rng = np.random.default_rng(seed)
    buf, full64 = _rand(rng, (B, n_kv, layers * K, d), dtype)
    rows_at = slice(layer * K, (layer + 1) * K)
    buf64 = full64[:, :, rows_at]
    row_offset = None if layers == 1 else jnp.int32(layer * K)
    exts, exts64 = zip(*[_rand(rng, (E, n_kv, blk, d), ext_dtype or dtype) for E in sizes])
    if bits:
        quantize = _q.quantize_int4 if bits == 4 else _q.quantize_int8
        exts = tuple(quantize(jnp.asarray(x, jnp.float32), group_size) for x in exts64)
        exts64 = tuple(_np_dequantize(x) for x in exts)
    N = sum(sizes) * blk
    tokens = rng.integers(0, N + 2 * blk, (B, n_kv, K)).astype(np.int32)  # some past the last extent
    count = rng.integers(0, K + 1, (B, n_kv))
    count[0, 0] = K
    count[-1, -1] = 0  # a hit: every row kept
    tokens = np.where(np.arange(K)[None, None] < count[..., None], tokens, -1).astype(np.int32)
    flat = np.concatenate(exts64)  # [sum E, n_kv, blk, d]: block-id order
    blocks, offs = tokens // blk, tokens % blk
    inside = (tokens >= 0) & (blocks < sum(sizes))
    got_rows = flat[np.clip(blocks, 0, sum(sizes) - 1), np.arange(n_kv)[None, :, None], offs]
    want = np.where(inside[..., None], got_rows, buf64)
    if ext_dtype or bits:  # the extents' (dequantized) values as the buffer's dtype holds them
        want = np.asarray(jnp.asarray(want, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)
    want = np.concatenate([full64[:, :, :rows_at.start], want, full64[:, :, rows_at.stop:]], axis=2)
    if host:
        dev = jax.devices()[0]
        exts = jax.device_put(exts, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    if mode == "reference":  # host or quantized extents: the op's fallback (a gather per extent, dequantized)
        from kvoffload import ops

        ref = (lambda b_, t_, o_, *xs: ops.refill_block_rows(b_, xs, t_, blk, impl="reference", row_offset=o_)) if (
            host or bits) else (lambda b_, t_, o_, *xs: _ga.refill_rows_reference(b_, xs, t_, blk, row_offset=o_))
        out = jax.jit(ref)(buf, jnp.asarray(tokens), row_offset, *exts)
    else:
        refill = _ga.refill_rows_int_kernel if bits else _ga.refill_rows_kernel
        out = jax.jit(lambda b_, t_, o_, *xs: refill(b_, xs, t_, blk, interpret=(mode == "interpret"), row_offset=o_,
                                                     **kw), donate_argnums=0)(buf, jnp.asarray(tokens), row_offset, *exts)
    got = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    if bits:  # within a rounding of the buffer's dtype (a bf16 ulp is up to 2**-7 of a value), relative to the
        # values' scale; a wrong row, nibble or group scale is off by a quantization step (~1/15 of a range) or more
        ulp = 2.0 ** -6 if jnp.dtype(_dt(dtype)) == jnp.bfloat16 else 2.0 ** -20
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want))) if got.shape == want.shape else float("inf")
        errs, tol = dict(err_rel=err), ulp
    else:
        errs, tol = dict(err_mismatch=float(np.mean(got != want)) if got.shape == want.shape else float("inf")), 1e-12
    r = _result(f"refill E{sizes} blk{blk} B{B} kv{n_kv} K{K} d{d} {dtype}{f' int{bits}' if bits else ''}"
                f"{' host' if host else ''}{f' layer {layer}/{layers}' if layers > 1 else ''}", mode, errs, tol)
    r["ok"] = r["ok"] and out.dtype == buf.dtype
    return r


def check_prefill(B=2, n_kv=2, G=4, T=300, Tc=70, q_start=150, d=128, dtype="float32", lengths=None,
                  mode="reference", seed=0, **kw):
    """A prefill chunk's causal attention (q at positions q_start + [0, Tc) over keys < its position and
    < lengths[b]) against float64 NumPy; the rows inside each prompt are compared (padding rows attend the
    same keys in both, but a prompt of length <= q_start gives them none)."""
    from kvoffload.models.common import prefill_attention_chunk

    impl = kw.pop("impl", "kernel")  # mode kernel: the Pallas kernel, or cuDNN's flash attention
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, Tc, d), dtype)
    k, k64 = _rand(rng, (B, n_kv, T, d), dtype)
    v, v64 = _rand(rng, (B, n_kv, T, d), dtype)
    if lengths is None:
        lengths = [min(T, q_start + Tc)] + list(rng.integers(q_start + 1, T + 1, B - 1))
    lengths = np.asarray(lengths[:B], np.int32)
    scale = d ** -0.5
    want = np.zeros((B, H, Tc, d))
    for b in range(B):
        for h in range(H):
            kh, vh = k64[b, h // G], v64[b, h // G]
            for t in range(Tc):
                n = min(q_start + t + 1, int(lengths[b]))
                if n <= 0:
                    continue
                s = kh[:n] @ q64[b, h, t] * scale
                p = np.exp(s - s.max())
                want[b, h, t] = p @ vh[:n] / p.sum()
    args = (q, k, v, jnp.int32(q_start), jnp.asarray(lengths))
    if mode == "reference":  # the semantics in full fp32 (a GPU's default fp32 matmul is TF32)
        with jax.default_matmul_precision("highest"):
            out = jax.jit(prefill_attention_chunk)(*args)
    elif impl == "cudnn":  # GPU only (gpu_cases)
        out = jax.jit(_pf.prefill_attention_chunk_cudnn)(*args)
    else:
        out = jax.jit(lambda *a: _pf.prefill_attention_chunk_kernel(*a, interpret=(mode == "interpret"),
                                                                    **kw))(*args)
    rows = (q_start + np.arange(Tc))[None, :] < lengths[:, None]  # [B, Tc]
    got = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    err = rel_err(got[rows[:, None, :, None].repeat(H, 1).repeat(d, 3)].reshape(-1),
                  want[rows[:, None, :, None].repeat(H, 1).repeat(d, 3)].reshape(-1))
    r = _result(f"prefill B{B} kv{n_kv} G{G} T{T} Tc{Tc} start{q_start} d{d} {dtype}"
                + (" cudnn" if impl == "cudnn" else ""), mode,
                dict(err_out=err), TOL[dtype])
    r["ok"] = r["ok"] and out.dtype == q.dtype and out.shape == q.shape
    return r


def check_stacked_linear(L=3, M=1, K=300, N=130, dtype="float32", mode="reference", seed=0, **kw):
    """x @ w[layer] for every layer of a stacked w, the layer a traced index (as in a loop over layers), vs
    float64 NumPy: random x and w (never zeros), odd K and N (masked edges), several K splits."""
    rng = np.random.default_rng(seed)
    x, x64 = _rand(rng, (M, K), dtype)
    w, w64 = _rand(rng, (L, K, N), dtype, scale=K ** -0.5)
    if mode == "reference":
        fn = jax.jit(_sl.stacked_linear_reference)
    else:
        fn = jax.jit(lambda x, w, i: _sl.stacked_linear_kernel(x, w, i, interpret=(mode == "interpret"),
                                                               poison=True, **kw))
    errs, ok = {}, True
    for layer in range(L):
        out = fn(x, w, jnp.int32(layer))
        errs[f"err_layer{layer}"] = rel_err(out, x64 @ w64[layer])
        ok = ok and out.dtype == x.dtype and out.shape == (M, N)
    r = _result(f"stacked_linear L{L} M{M} K{K} N{N} {dtype}", mode, errs, TOL[dtype])
    r["ok"] = r["ok"] and ok
    return r


def gather_cases(full=False):
    """Row gather: every head dim x K (1, 37, 300) x dtype over odd extents (E 5 / 13, blk 24 / 16),
    int4 codes and group scales, and a tile size other than the default."""
    shapes = [(d, K, dt) for d in HEAD_DIMS for K in (1, 37, 300) for dt in DTYPES]
    if not full:
        shapes = [(64, 1, "bfloat16"), (80, 37, "float32"), (96, 300, "bfloat16"), (128, 37, "bfloat16")]
    cases = [(check_gather, dict(d=d, K=K, dtype=dt, E=(5, 13)[i % 2], blk=(24, 16)[i % 2]))
             for i, (d, K, dt) in enumerate(shapes)]
    cases += [(check_gather, dict(d=64, K=37, dtype="uint8")),  # int4 codes [..., d / 2]
              (check_gather, dict(d=2, K=37, dtype="float32")),  # int4 group scales [..., d / group]
              (check_gather, dict(blk=1, d=64, K=37, dtype="float32")),  # int4 K per-channel scales [E, n_kv, 1, d]
              (check_gather, dict(B=1, n_kv=3, d=128, K=300, block_k=16))]
    return cases


# ----------------------------------------------------------------------------
# suites
# ----------------------------------------------------------------------------

GROUPS = (1, 3, 4, 7, 8)
HEAD_DIMS = (64, 80, 96, 128)
DTYPES = ("float32", "bfloat16")


def kernel_cases(full=False):
    """(fn, kwargs) for every kernel check; full=True is the exhaustive sweep."""
    cases = []
    if full:
        dec = [(g, d, dt) for g in GROUPS for d in HEAD_DIMS for dt in DTYPES]
    else:
        dec = [(1, 64, "float32"), (3, 80, "bfloat16"), (4, 96, "float32"),
               (7, 128, "bfloat16"), (8, 80, "float32")]
    for g, d, dt in dec:
        cases.append((check_decode, dict(G=g, d=d, dtype=dt, S=200 if not full else 333)))
    cases.append((check_decode, dict(B=2, G=4, d=128, S=1, lengths=[1, 0])))
    cases.append((check_decode, dict(B=2, G=4, d=64, S=300, num_splits=2, block_s=32)))
    cases += paged_cases(full)
    sp = ([(g, d, dt, ps) for g in (1, 4, 7) for d in HEAD_DIMS for dt in DTYPES
           for ps in (1, 16)] if full else
          [(4, 128, "float32", 1), (3, 80, "bfloat16", 16), (8, 96, "float32", 4),
           (1, 64, "bfloat16", 1)])
    for g, d, dt, ps in sp:
        cases.append((check_sparse, dict(G=g, d=d, dtype=dt, page_size=ps,
                                         with_lengths=(ps > 1))))
    cases += [(check_rows_attention, dict()),
              (check_rows_attention, dict(G=7, d=80, K=100, layers=3, dtype="bfloat16")),
              (check_rows_attention, dict(B=1, n_kv=3, G=1, K=40, d=64, num_splits=3, block_n=16))]
    rc = ([(d, dt, b, r) for d in (64, 128) for dt in DTYPES for b in (True, False)
           for r in (True, False)] if full else
          [(64, "float32", True, True), (128, "bfloat16", False, False)])
    for d, dt, b, r in rc:
        cases.append((check_recompute, dict(d=d, dtype=dt, bias=b, rope=r, T=40 if not full else 77)))
    for g, d, dt, red in ([(4, 96, "float32", "sum"), (7, 64, "bfloat16", "max")] if not full
                          else [(g, d, dt, red) for g in GROUPS for d in HEAD_DIMS
                                for dt in DTYPES for red in ("sum", "max")]):
        cases.append((check_scores_exact, dict(G=g, d=d, dtype=dt, group_reduce=red)))
    cases.append((check_scores_exact, dict(G=4, d=128, dtype="bfloat16", group_reduce="max", per_head=True, S=256)))
    # pool blocks as a batch (S <= 128: several blocks per program, `SCORE_ITEMS`), a head of length 0
    cases.append((check_scores_exact, dict(B=19, n_kv=3, G=3, S=64, d=64, group_reduce="max", per_head=True)))
    if full:
        # every group x head dim x dtype (x code width x popcount for HATA); the other
        # options (reduction, page size, num_pages, norm, shared) cycle along
        reds = ("sum", "max", "mean")
        qu = [dict(G=g, d=d, dtype=dt, group_reduce=reds[i % 3], page_size=(16, 32)[i % 2],
                   with_num_pages=bool(i % 4 < 2))
              for i, (g, d, dt) in enumerate((g, d, dt) for g in GROUPS for d in HEAD_DIMS
                                             for dt in DTYPES)]
        ha = [dict(G=g, r=r, with_norm=bool(i % 2), group_reduce=reds[i % 3], popcount=pc)
              for i, (g, r, pc) in enumerate((g, r, pc) for g in GROUPS
                                             for r in (32, 64, 96, 128, 256)
                                             for pc in ("native", "swar"))]
        ts = [dict(G=g, d=d, dtype=dt, shared=bool(i % 2), S=333)
              for i, (g, d, dt) in enumerate((g, d, dt) for g in GROUPS for d in HEAD_DIMS
                                             for dt in DTYPES)]
    else:
        qu = [dict(), dict(G=1, d=128, page_size=32, dtype="bfloat16", group_reduce="max",
                           with_num_pages=False),
              dict(G=4, d=80, S=200, page_size=8, group_reduce="mean", block_p=16)]
        ha = [dict(), dict(G=7, r=64, with_norm=False, group_reduce="max"),
              dict(B=3, G=3, r=96, group_reduce="mean", lengths=[100, 0, 55], popcount="swar",
                   block_s=32),
              dict(G=1, r=32, popcount="swar")]
        ts = [dict(), dict(G=3, d=80, dtype="bfloat16", shared=True),
              dict(B=3, G=1, d=96, S=300, lengths=[300, 0, 57], block_s=32, num_splits=3,
                   block_v=64),
              dict(G=3, d=128, S=70, shared=True, block_s=16, num_splits=2)]
    cases += [(check_quest, kw) for kw in qu]
    cases += [(check_quest_blocks, dict()), (check_quest_blocks, dict(B=1, int8=False, d=80, G=4, P=4, rows=16)),
              (check_quest_blocks, dict(B=3, E=7, n_kv=1, G=1, P=1, d=16, dtype="bfloat16", rows=8)),
              (check_quest_blocks, dict(E=5, layers=3)), (check_quest_blocks, dict(E=6, layers=4, int8=False)),
              (check_quest_blocks, dict(B=3, E=9, n_kv=3, active=True)),
              (check_quest_blocks, dict(E=5, layers=3, active=True, int8=False))]
    cases += [(check_hata, kw) for kw in ha]
    cases += [(check_tokenselect, kw) for kw in ts]
    for d, gs, dt, g in ([(128, 64, "float32", 4), (64, 64, "bfloat16", 3)] if not full else
                         [(d, gs, dt, g) for d in (64, 128) for gs in (32, 64) for dt in DTYPES
                          for g in (1, 4, 7)]):
        cases.append((check_int4_decode, dict(d=d, group_size=gs, dtype=dt, G=g)))
    cases += gather_cases(full)
    cases += [(check_refill, dict()), (check_refill, dict(sizes=(3, 1, 4), blk=16, d=64, K=300, dtype="bfloat16")),
              (check_refill, dict(B=1, sizes=(2,), d=128, K=5, dtype="bfloat16", ext_dtype="float32", block_k=16)),
              (check_refill, dict(bits=4)), (check_refill, dict(bits=8, d=64, dtype="bfloat16", group_size=32)),
              (check_refill, dict(bits=4, sizes=(3, 1, 4), blk=16, d=128, K=300, dtype="bfloat16", group_size=64)),
              (check_refill, dict(layers=3, layer=1)), (check_refill, dict(layers=2, layer=1, K=20, d=64)),
              (check_refill, dict(bits=8, d=64, dtype="bfloat16", group_size=32, layers=3, layer=2))]
    pf = ([(g, d, dt) for g in (1, 4, 7) for d in HEAD_DIMS for dt in DTYPES] if full else
          [(4, 128, "bfloat16"), (3, 80, "float32"), (1, 64, "float32")])
    for i, (g, d, dt) in enumerate(pf):
        cases.append((check_prefill, dict(G=g, d=d, dtype=dt, T=(300, 129)[i % 2], Tc=(70, 33)[i % 2],
                                          q_start=(150, 96)[i % 2])))
    cases.append((check_prefill, dict(G=2, d=64, T=200, Tc=64, q_start=0, block_q=32, block_k=16)))
    cases += [(check_select_rows, dict(R=3, N=300, kind="normal")), (check_select_rows, dict(R=2, N=77, kind="ties")),
              (check_select_rows, dict(R=3, N=300, kind="normal", fused_max=0)),  # the multi-launch path
              (check_select_rows, dict(R=2, N=77, kind="ties", fused_max=0)),
              (check_select_rows, dict(R=3, N=200, ratio=0.3, chunk=32, count_piece=16, compact_piece=8, fused_max=0)),
              (check_select_rows, dict(R=3, N=200, ratio=0.3, fused_warps=8)),  # one launch: the row in registers
              (check_select_rows, dict(R=2, N=1500, ratio=0.2, kind="ties", fused_max=2048))]
    cases += [(check_merge_splits, dict()), (check_merge_splits, dict(B=1, n_kv=2, NS=4, G=4, d=64))]
    cases += [(check_stacked_linear, dict()), (check_stacked_linear, dict(M=5, K=1100, N=48, dtype="bfloat16")),
              (check_stacked_linear, dict(L=2, M=70, K=64, N=200, block_n=32, block_k=16))]
    return cases


def paged_cases(full=False):
    """Paged decode attention: the default two shapes, or (full) every GQA group x head dim x
    block size x dtype, plus a non-power-of-two block, one split walking the whole table, and
    a long table over a large pool."""
    if not full:
        return [(check_paged, dict(G=3, d=80, blk=64, dtype="bfloat16")),
                (check_paged, dict(G=4, d=64, blk=16, num_splits=1))]
    cases = [(check_paged, dict(G=g, d=d, blk=blk, dtype=dt))
             for g in (1, 3, 4, 8) for d in HEAD_DIMS for blk in (16, 64) for dt in DTYPES]
    cases += [(check_paged, dict(G=4, d=128, blk=24, M=4)),
              (check_paged, dict(G=4, d=64, blk=16, num_splits=1)),
              (check_paged, dict(B=5, n_kv=8, G=4, d=128, blk=64, M=40, E=512, dtype="bfloat16",
                                 num_blocks=[40, 0, 1, 17, 33])),
              (check_paged, dict(B=3, n_kv=8, G=8, d=128, blk=16, M=200, E=700,
                                 num_blocks=[200, 3, 0]))]
    return cases


def reference_cases(full=False):
    launch = ("num_splits", "block_s", "block_p", "block_v", "popcount", "block_k")
    cases = [(fn, kw) for fn, kw in kernel_cases(full) if not any(a in kw for a in launch)]
    if not full:  # the default run: two shapes per reference (the kernels cover all)
        picked, count = [], {}
        for fn, kw in cases:
            if count.get(fn, 0) < 2:
                picked.append((fn, kw))
                count[fn] = count.get(fn, 0) + 1
        cases = picked
    cases += [
        (check_merge, dict(dtype="float32")), (check_merge, dict(dtype="bfloat16")),
        (check_popcount, dict()),
        (check_select, dict()), (check_select, dict(page_size=16, N=30, k=8)),
        (check_quantize, dict()), (check_quantize, dict(shape=(4, 96), group_size=32)),
        (check_quantize, dict(bits=8)),
        (check_int4_decode, dict(d=96, group_size=32)),
    ]
    return cases


def case_id(fn, kw):
    return fn.__name__.replace("check_", "") + "-" + "-".join(f"{k}{v}" for k, v in kw.items())


def gpu_cases():
    """The GPU suite: the default subset, the full decode sweep (every group x head dim x
    dtype), every head dim for the other kernels, and larger sequences (many splits)."""
    cases = list(kernel_cases(full=False))
    seen = {(f, repr(sorted(k.items()))) for f, k in cases}

    def add(f, kw):
        key = (f, repr(sorted(kw.items())))
        if key not in seen:
            seen.add(key)
            cases.append((f, kw))

    for g in GROUPS:
        for d in HEAD_DIMS:
            for dt in DTYPES:
                add(check_decode, dict(G=g, d=d, dtype=dt, S=333))
    for d in HEAD_DIMS:
        for dt in DTYPES:
            add(check_sparse, dict(G=4, d=d, dtype=dt, page_size=1))
            add(check_sparse, dict(G=7, d=d, dtype=dt, page_size=16, with_lengths=True))
            add(check_scores_exact, dict(G=3, d=d, dtype=dt))
            add(check_scores_exact, dict(G=4, d=d, dtype=dt, group_reduce="max", per_head=True, S=256))
            add(check_scores_exact, dict(B=37, n_kv=8, G=4, d=d, dtype=dt, group_reduce="max", per_head=True, S=64))
    for d in (64, 128):
        for dt in DTYPES:
            for b in (True, False):
                add(check_recompute, dict(d=d, dtype=dt, bias=b, rope=True, T=77, H=256))
            add(check_int4_decode, dict(d=d, dtype=dt, G=8, group_size=64))
            add(check_int4_decode, dict(d=d, dtype=dt, G=1, group_size=32))
    for d in HEAD_DIMS:
        for dt in DTYPES:
            add(check_quest, dict(G=4, d=d, dtype=dt, S=1000, page_size=16))
            add(check_tokenselect, dict(G=4, d=d, dtype=dt, S=333))
            add(check_tokenselect, dict(G=7, d=d, dtype=dt, S=333, shared=True))
    for r in (32, 64, 96, 128, 256):
        for pc in ("native", "swar"):
            add(check_hata, dict(G=4, r=r, S=333, popcount=pc))
    for fn, kw in paged_cases(full=True):
        add(fn, kw)
    # long sequences / many splits / batch
    add(check_decode, dict(B=4, n_kv=8, G=4, d=128, dtype="bfloat16", S=5000,
                           lengths=[5000, 1, 4097, 63]))
    add(check_decode, dict(B=2, n_kv=2, G=8, d=96, dtype="float32", S=3000))
    add(check_sparse, dict(B=2, n_kv=8, G=4, d=128, dtype="bfloat16", S=8192, K=900))
    add(check_sparse, dict(B=1, n_kv=4, G=4, d=128, dtype="bfloat16", S=8192, K=64,
                           page_size=16, with_lengths=True))
    add(check_recompute, dict(B=2, T=300, H=1024, n_kv=4, d=128, dtype="bfloat16"))
    add(check_int4_decode, dict(B=2, n_kv=8, G=4, d=128, dtype="bfloat16", S=4000))
    add(check_quest, dict(B=2, n_kv=8, G=4, d=128, S=8192, page_size=16))
    add(check_quest_blocks, dict(B=1, E=2048, n_kv=8, G=4, P=2, d=128, dtype="bfloat16"))  # 128K, pages of 32
    add(check_quest_blocks, dict(B=64, E=8192, n_kv=8, G=4, P=2, d=128, dtype="bfloat16"))  # b64 at 8K
    add(check_quest_blocks, dict(B=1, E=2048, n_kv=8, G=4, P=2, d=128, dtype="bfloat16", layers=31))  # the loop's
    add(check_quest_blocks, dict(B=1, E=2048, n_kv=4, G=7, P=2, d=128, dtype="bfloat16", layers=27, active=True))
    add(check_quest_blocks, dict(B=2, E=100, n_kv=4, G=7, P=4, d=80, dtype="bfloat16", int8=False))
    add(check_hata, dict(B=2, n_kv=8, G=4, S=8192, r=128, lengths=[8192, 5000]))
    add(check_hata, dict(B=2, n_kv=8, G=4, S=8192, r=128, lengths=[8192, 5000],
                         popcount="swar"))
    add(check_tokenselect, dict(B=4, n_kv=8, G=4, d=128, dtype="bfloat16", S=5000,
                                lengths=[5000, 1, 4097, 0]))
    add(check_tokenselect, dict(B=1, n_kv=8, G=4, d=128, dtype="bfloat16", S=8192,
                                shared=True))
    for fn, kw in gather_cases(full=True):
        add(fn, kw)
    for d in HEAD_DIMS:  # the extent in pinned_host memory: the kernel reads it in place
        add(check_gather, dict(d=d, K=300, dtype="bfloat16", E=13, blk=16, host=True))
    add(check_gather, dict(B=2, n_kv=8, E=40, blk=64, d=128, K=2000, dtype="bfloat16", host=True))
    add(check_gather, dict(n_kv=8, E=40, blk=1, d=128, K=2000, dtype="float32", host=True))  # per-channel K scales
    for d in HEAD_DIMS:  # the extents in pinned_host memory, and a clo-sized buffer (13K rows of 8 heads)
        add(check_refill, dict(d=d, K=300, dtype="bfloat16", sizes=(13, 5, 7), blk=16, host=True))
        for bits in (4, 8):  # int4 / int8 extents, dequantized in the kernel
            add(check_refill, dict(d=d, K=300, dtype="bfloat16", sizes=(13, 5, 7), blk=16, host=True, bits=bits))
    add(check_refill, dict(B=1, n_kv=8, sizes=(2048,), blk=64, d=128, K=13107, dtype="bfloat16", host=True, bits=8,
                           group_size=64))
    add(check_refill, dict(B=1, n_kv=8, sizes=(256, 256, 256, 256), blk=128, d=128, K=13107, dtype="bfloat16",
                           host=True))
    for bits in (None, 4, 8):  # one layer's rows of a buffer holding several layers' (a loop over stacked layers)
        add(check_refill, dict(d=128, K=300, dtype="bfloat16", sizes=(13, 5), blk=16, host=True, bits=bits,
                               layers=4, layer=3, group_size=64))
    add(check_prefill, dict(B=1, n_kv=8, G=4, d=128, dtype="bfloat16", T=6000, Tc=1024, q_start=4500))
    for d, T, Tc, start in ((128, 6000, 1024, 4500), (64, 300, 70, 150), (80, 129, 33, 96), (128, 200, 64, 0)):
        add(check_prefill, dict(B=2, n_kv=2, G=4, d=d, dtype="bfloat16", T=T, Tc=Tc, q_start=start, impl="cudnn"))
    for n_kv, g, K, layers in ((4, 7, 13107, 27), (8, 4, 13107, 31), (8, 4, 1638, 1)):  # 128K and 16K at 10%
        add(check_rows_attention, dict(B=1, n_kv=n_kv, G=g, K=K, layers=layers, dtype="bfloat16"))
    add(check_rows_attention, dict(B=4, n_kv=2, G=8, K=500, d=64, dtype="float32"))
    for ns, g, d in ((66, 7, 128), (128, 4, 128), (33, 8, 80), (1, 1, 64)):  # Qwen2.5-7B's and Llama-3-8B's at 128K
        add(check_merge_splits, dict(B=1, n_kv=4, NS=ns, G=g, d=d))
    add(check_select_rows, dict(R=8, N=131072))
    add(check_select_rows, dict(R=8, N=131072, kind="ties"))
    add(check_select_rows, dict(R=8, N=4096))  # a clo head's 128K tokens in pages of 32
    add(check_select_rows, dict(R=8, N=4096, kind="ties"))
    for n, w in ((4096, 4), (16384, 8)):  # the one launch with other warps than `fused_num_warps`
        add(check_select_rows, dict(R=8, N=n, fused_warps=w))
    add(check_select_rows, dict(R=512, N=256, ratio=0.2))  # fused: b64 x 8 heads at 8K in pages of 32
    add(check_select_rows, dict(R=8, N=16384, ratio=0.05))
    add(check_select_rows, dict(R=16, N=20000, ratio=0.5))
    add(check_select_rows, dict(R=8, N=1048576))  # 64 programs of 16K keys per row
    for M in (1, 64):  # Llama-3-8B's q / K / V, o, gate / up and down shapes, decode batch 1 and 64
        for K, N in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)):
            add(check_stacked_linear, dict(L=3, M=M, K=K, N=N, dtype="bfloat16"))
    for M in (1, 16):  # the few-row linear's tiles (ops.matmul_f32: decode at batch 1), K|V to a wide lm_head
        for K, N in ((4096, 1024), (4096, 2048), (4096, 14336), (14336, 4096), (4096, 32768)):
            add(check_stacked_linear, dict(L=1, M=M, K=K, N=N, dtype="bfloat16", **_sl.FEW_ROWS_TILES))
    return cases


KERNEL_FNS = (check_decode, check_paged, check_sparse, check_recompute, check_scores_exact,
              check_int4_decode, check_quest, check_quest_blocks, check_hata, check_tokenselect, check_gather, check_prefill,
              check_select_rows, check_refill, check_stacked_linear, check_merge_splits, check_rows_attention)


def run_case(fn, kw, mode):
    return fn(mode=mode, **kw) if fn in KERNEL_FNS else fn(**kw)
