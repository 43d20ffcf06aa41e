"""Checks of the attention kernels against float64 attention (`oracles.np_attend`): decode, paged decode, the
log-sum-exp merges, sparse attention, attention over row buffers, int4 decode and the prefill chunk."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload.pallas import decode_attention as _da
from kvoffload.pallas import paged_attention as _pa
from kvoffload.pallas import prefill_attention as _pf
from kvoffload.pallas import quant as _q
from kvoffload.pallas import sparse_attention as _sa
from kvoffload.pallas.common import next_pow2
from kvoffload.testing.oracles import TOL, _rand, _result, lse_err, np_attend, np_paged_dense, np_positions, rel_err


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
