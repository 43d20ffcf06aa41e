"""Checks of the selection kernels: the scores that rank tokens or pages (exact, Quest's page bounds, HATA's hash
codes, TokenSelect's soft vote) against float64 NumPy, and the top-k that picks from them."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload.pallas import scores as _sc
from kvoffload.pallas import topk as _tk
from kvoffload.testing.oracles import TOL, _rand, _result, np_hata_encode, rel_err


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
        out = _sc.topk_scores_exact_reference(q, k, L, group_reduce=group_reduce)
    else:
        out = _sc.topk_scores_exact_kernel(q, k, L, group_reduce=group_reduce,
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
    kmin, kmax = _sc.quest_page_minmax(k, page_size, jnp.asarray(lengths))
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
        out = _sc.quest_page_scores_reference(q, kmin, kmax, np_arg, group_reduce=group_reduce)
    else:
        out = _sc.quest_page_scores_kernel(q, kmin, kmax, np_arg, group_reduce=group_reduce,
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
        out = _sc.quest_block_bounds_reference(q, jnp.asarray(owner), *stacked, **off)
    else:
        out = _sc.quest_block_bounds_kernel(q, jnp.asarray(owner), *stacked, interpret=(mode == "interpret"), **off,
                                            **kw)
    out = np.asarray(out, np.float64)
    err = float(np.max(np.abs(np.where(dead, 1.0, out) - ref)) / np.max(np.abs(ref)))
    err = err if np.all(np.isneginf(out[dead])) else float("inf")
    return _result(f"quest_blocks B{B} E{E} kv{n_kv} G{G} P{P} d{d} {dtype} int8={int8}"
                   + (f" layer {layers // 2} of {layers}" if layers > 1 else "") + (" active" if active else ""),
                   mode, dict(err_rel=err), 1e-5)


def check_hata(B=2, n_kv=2, G=4, S=100, d=64, r=128, seed=0, with_norm=True,
               group_reduce="sum", lengths=None, mode="reference", **kw):
    rng = np.random.default_rng(seed)
    H = n_kv * G
    q, q64 = _rand(rng, (B, H, d), "float32")
    k, k64 = _rand(rng, (B, n_kv, S, d), "float32")
    w, w64 = _rand(rng, (d, r), "float32")
    qc = _sc.hata_encode(q, w)
    kc = _sc.hata_encode(k, w)
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
        out = _sc.hata_scores_reference(*args, k_norm=kn_arg, group_reduce=group_reduce)
    else:
        out = _sc.hata_scores_kernel(*args, k_norm=kn_arg, group_reduce=group_reduce,
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
    got_u = np.asarray(_sc.popcount_swar(jnp.asarray(x)))
    got_i = np.asarray(_sc.popcount_swar(jnp.asarray(x.view(np.int32))))
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
        out = _sc.tokenselect_scores_reference(q, k, L, shared=shared)
    else:
        out = _sc.tokenselect_scores_kernel(q, k, L, shared=shared, **_mode_kw(mode, kw))
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
