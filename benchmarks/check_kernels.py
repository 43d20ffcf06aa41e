#!/usr/bin/env python3
"""Run every kernel-vs-float64 check on this machine (GPU: compiled Triton kernels).

    PYTHONPATH=src python3 benchmarks/check_kernels.py [--full] [--out DIR] [--only SUBSTR,...]
    PYTHONPATH=src python3 benchmarks/check_kernels.py --interpret   # CPU: Pallas interpret mode
    PYTHONPATH=src python3 benchmarks/check_kernels.py --lower-only  # CPU: Triton lowering only

Prints a table, writes check_kernels.json / .md to --out (default $OUT or .), exits
non-zero if any check fails or errors. Also checks the ops dispatch (impl="auto" must
pick the kernel on GPU), the zero-copy pinned_host sparse-attention path, the
quest / hata / tokenselect ops with impl="auto" against their references, and paged decode
attention through ops with the bitwise identities of the fp32 accumulator fold.
"""

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.testing.cases import case_id, gpu_cases, kernel_cases, reference_cases, run_case
from kvoffload.testing.oracles import _result, lse_err, rel_err


def pinned_host_check():
    """sparse attention with K/V in pinned_host: which path ran, and is it right."""
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        return dict(name="sparse pinned_host", mode="auto", ok=True, err=0.0, tol=1e-2,
                    path="n/a (no pinned_host memory)")
    rng = np.random.default_rng(7)
    B, n_kv, G, S, d, K = 2, 4, 4, 4096, 128, 200
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, n_kv, S, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, n_kv, S, d)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([np.stack([rng.permutation(S)[:K] for _ in range(n_kv)])
                                for _ in range(B)]), jnp.int32)
    ref = ops.sparse_attention(q, k, v, idx, impl="reference")
    sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    kh, vh = jax.device_put(k, sh), jax.device_put(v, sh)
    out = ops.sparse_attention(q, kh, vh, idx)
    path = ops.sparse_attention_path()
    err = max(rel_err(out[0], np.asarray(ref[0].astype(jnp.float32))),
              lse_err(np.asarray(out[1]), np.asarray(ref[1])))
    ok = bool(np.isfinite(err) and err < 1e-2)
    return dict(name="sparse pinned_host K/V (auto)", mode="auto", ok=ok, err=err, tol=1e-2,
                path=path)


def dispatch_check():
    rng = np.random.default_rng(8)
    q = jnp.asarray(rng.standard_normal((1, 8, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 2, 64, 128)), jnp.bfloat16)
    _ = ops.decode_attention(q, k, k, jnp.array([64]))
    on_gpu = ops.kernel_default()
    return dict(name="ops impl=auto picks kernel on GPU", mode="auto",
                ok=bool(on_gpu or jax.default_backend() != "gpu"), err=0.0, tol=1.0,
                path=f"backend={jax.default_backend()} kernel_default={on_gpu}")


def topk_ops_check():
    """quest / hata / tokenselect through ops with impl="auto" (the compiled kernel on GPU,
    via the ops' jit wrappers) against impl="reference"."""
    rng = np.random.default_rng(9)
    B, n_kv, G, S, d = 2, 8, 4, 1000, 128
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, n_kv, S, d)), jnp.bfloat16)
    L = jnp.array([S, 333], jnp.int32)
    kmin, kmax = ops.quest_page_minmax(k, 16, L)
    w = jnp.asarray(rng.standard_normal((d, 128)), jnp.float32)
    qc, kc = ops.hata_encode(q, w), ops.hata_encode(k, w)
    kn = jnp.linalg.norm(k.astype(jnp.float32), axis=-1)
    calls = dict(
        quest=lambda impl: ops.quest_page_scores(q, kmin, kmax, (L + 15) // 16, impl=impl),
        hata=lambda impl: ops.hata_scores(qc, kc, L, k_norm=kn, impl=impl),
        tokenselect=lambda impl: ops.tokenselect_scores(q, k, L, impl=impl),
        tokenselect_shared=lambda impl: ops.tokenselect_scores(q, k, L, shared=True, impl=impl))
    errs = {}
    for name, f in calls.items():
        ref = np.asarray(f("reference"), np.float64)
        out = np.asarray(f("auto"), np.float64)
        fin = np.isfinite(ref)
        same_inf = out.shape == ref.shape and np.array_equal(np.isneginf(out), ~fin)
        errs[f"err_{name}"] = rel_err(out[fin], ref[fin]) if same_inf else float("inf")
    r = _result("ops quest/hata/tokenselect impl=auto vs reference", "auto", errs, 1e-4)
    r["path"] = f"kernel_default={ops.kernel_default()}"
    return r


def paged_ops_check():
    """ops.paged_decode_attention with impl="auto" (the compiled kernel on GPU) against the
    reference, and the fp32 accumulator fold on this device: folding an empty extent is a
    bitwise no-op, folding into the empty accumulator returns the part bitwise, two extents
    fold to the whole sequence."""
    rng = np.random.default_rng(10)
    B, n_kv, G, d, blk, M, E = 4, 8, 4, 128, 64, 6, 40
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.bfloat16)
    kb = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), jnp.bfloat16)
    vb = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(E)[:B * M].reshape(B, M), jnp.int32)
    nb = jnp.array([M, 0, 3, 1], jnp.int32)
    ref = ops.paged_decode_attention(q, kb, vb, table, nb, impl="reference")
    out = ops.paged_decode_attention(q, kb, vb, table, nb)
    err = max(rel_err(out[0], np.asarray(ref[0].astype(jnp.float32))),
              lse_err(np.asarray(out[1]), np.asarray(ref[1])))
    bits = lambda x: np.asarray(x, np.float32).view(np.uint32)
    acc = ops.merge_attention_into(ops.empty_attention(q), out)
    first_exact = (np.array_equal(bits(acc[0]), bits(out[0].astype(jnp.float32)))
                   and np.array_equal(bits(acc[1]), bits(out[1])))
    none = ops.paged_decode_attention(q, kb, vb, table, jnp.zeros(B, jnp.int32))
    again = ops.merge_attention_into(acc, none)
    noop_exact = (np.array_equal(bits(again[0]), bits(acc[0]))
                  and np.array_equal(bits(again[1]), bits(acc[1])))
    # rows split over two extents (the first 3 table columns, then the rest) fold to the whole
    na = jnp.minimum(nb, 3)
    two = ops.merge_attention_into(ops.empty_attention(q),
                                   ops.paged_decode_attention(q, kb, vb, table[:, :3], na))
    two = ops.merge_attention_into(two, ops.paged_decode_attention(q, kb, vb, table[:, 3:],
                                                                   nb - na))
    err_two = max(rel_err(two[0], np.asarray(out[0].astype(jnp.float32))),
                  lse_err(np.asarray(two[1]), np.asarray(out[1])))
    r = _result("ops paged_decode_attention impl=auto + merge_attention_into", "auto",
                  dict(err_vs_reference=err, err_two_extents=err_two), 1e-2)
    r["ok"] = r["ok"] and first_exact and noop_exact
    r["path"] = (f"kernel_default={ops.kernel_default()} fold_into_empty_bitwise={first_exact} "
                 f"empty_fold_noop_bitwise={noop_exact}")
    return r


def lower_only_checks():
    """CPU pre-flight (no GPU needed): lower every kernel to Triton IR with JAX's Triton
    lowering (CC 9.0 fallback) by routing pallas_call's CPU lowering to it, so unsupported
    primitives and non-power-of-two shapes fail here. Uses JAX internals (jax._src); does
    not run Triton's backend passes or the kernels, so it never replaces the GPU run."""
    import dataclasses
    from jax._src.interpreters import mlir
    from jax._src.pallas import pallas_call as pc
    from jax._src.pallas.triton import pallas_call_registration as reg
    from kvoffload.pallas import decode_attention as _da, quant as _q, recompute as _rc
    from kvoffload.pallas import paged_attention as _pa
    from kvoffload.pallas import gather as _ga, scores as _sc, sparse_attention as _sa, topk as _tk
    from kvoffload.pallas import prefill_attention as _pf

    def cuda_rule(ctx, *a, **p):
        mc = dataclasses.replace(ctx.module_context, platforms=("cuda",))
        return reg.pallas_call_lowering(dataclasses.replace(ctx, module_context=mc), *a, **p)

    mlir.register_lowering(pc.pallas_call_p, cuda_rule, platform="cpu")
    rng = np.random.default_rng(0)
    cases = []
    shapes = [(2, 2, 4, 200, 128, jnp.bfloat16), (1, 8, 3, 333, 80, jnp.float32),
              (2, 2, 1, 100, 64, jnp.float32), (1, 2, 7, 50, 96, jnp.bfloat16)]
    for B, n_kv, G, S, d, dt in shapes:
        q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), dt)
        k = jnp.asarray(rng.standard_normal((B, n_kv, S, d)), dt)
        L = jnp.full((B,), S, jnp.int32)
        idx = jnp.zeros((B, n_kv, 24), jnp.int32)
        kmin, kmax = _sc.quest_page_minmax(k, 16, L)
        tag = f"B{B} kv{n_kv} G{G} S{S} d{d} {jnp.dtype(dt).name}"
        cases += [
            (f"decode {tag}", lambda q, k, L: _da.decode_attention_kernel(q, k, k, L), (q, k, L)),
            (f"decode window start {tag}", lambda q, k, L: _da.decode_attention_kernel(q, k, k, L, start=L // 3),
             (q, k, L)),
            (f"sparse {tag}", lambda q, k, i: _sa.sparse_attention_kernel(q, k, k, i), (q, k, idx)),
            (f"rows_attention {tag}", lambda q, k, n: _sa.rows_attention_kernel(q, k, k, n, S // 3,
                                                                                row_offset=jnp.int32(S // 3)),
             (q, k, jnp.full((B, n_kv), S // 4, jnp.int32))),
            (f"scores_exact {tag}", lambda q, k, L: _sc.topk_scores_exact_kernel(q, k, L),
             (q, k, L)),
            (f"quest {tag}", lambda q, a, b, n: _sc.quest_page_scores_kernel(
                q, a, b, n, group_reduce="max"), (q, kmin, kmax, L // 16)),
            (f"quest_blocks active {tag}", lambda q, a, b: _sc.quest_block_bounds_kernel(
                q, jnp.arange(a.shape[0], dtype=jnp.int32) % B, a, b, active=jnp.ones((B, n_kv), bool)),
             (q, kmin[0][None].repeat(3, 0), kmax[0][None].repeat(3, 0))),
        ]
        for blk in (16, 64, 24):  # 24: a block size that is not a power of two (padded)
            E, M = S // blk + 3, S // blk + 1
            qe = jnp.asarray(rng.standard_normal((E, n_kv * G, d)), dt)
            ke = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), dt)
            Le = jnp.asarray(rng.integers(0, blk + 1, (E, n_kv)), jnp.int32)
            cases.append((f"scores_exact blocks E{E} blk{blk} {tag}", lambda q, k, L: _sc.topk_scores_exact_kernel(
                q, k, L, group_reduce="max"), (qe, ke, Le)))
            kb = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), dt)
            table = jnp.asarray(rng.integers(0, E, (B, M)), jnp.int32)
            nb = jnp.asarray(rng.integers(0, M + 1, B), jnp.int32)
            cases.append((f"paged blk{blk} E{E} M{M} {tag}", lambda q, kb, t, n:
                          _pa.paged_decode_attention_kernel(q, kb, kb, t, n, poison=True),
                          (q, kb, table, nb)))
            cases.append((f"paged window blk{blk} E{E} M{M} {tag}", lambda q, kb, t, n, blk=blk:
                          _pa.paged_decode_attention_kernel(q, kb, kb, t, n, poison=True,
                                                            first_pos=jnp.arange(kb.shape[0], dtype=jnp.int32) * blk,
                                                            start=n * blk // 2),
                          (q, kb, table, nb)))
        for sh in (False, True):
            cases.append((f"tokenselect shared{int(sh)} {tag}", lambda q, k, L, sh=sh:
                          _sc.tokenselect_scores_kernel(q, k, L, shared=sh, poison=True),
                          (q, k, L)))
        for r in (32, 96, 128):
            w = jnp.asarray(rng.standard_normal((d, r)), jnp.float32)
            qc, kc = _sc.hata_encode(q, w), _sc.hata_encode(k, w)
            for pcnt in ("native", "swar"):
                cases.append((f"hata r{r} {pcnt} {tag}", lambda a, b, L, n, pcnt=pcnt:
                              _sc.hata_scores_kernel(a, b, L, k_norm=n, popcount=pcnt),
                              (qc, kc, L, jnp.ones((B, n_kv, S), jnp.float32))))
        for E, blk, K in ((S // 16 + 3, 16, 37), (S // 24 + 1, 24, 300), (5, 64, 1)):
            xb = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), dt)
            bo = jnp.asarray(rng.integers(0, blk, (B, n_kv, K)), jnp.int32)
            cases.append((f"gather E{E} blk{blk} K{K} {tag}",
                          lambda x, b: _ga.gather_rows_kernel(x, b, b, poison=True), (xb, bo)))
            xh = jnp.asarray(rng.standard_normal((E, blk, 4 * d + 8)), dt)  # headless (X rows), ragged column tile
            cases.append((f"gather headless E{E} blk{blk} K{K} {tag}",
                          lambda x, b: _ga.gather_rows_kernel(x, b, b, poison=True), (xh, bo[:, 0])))
            buf = jnp.asarray(rng.standard_normal((B, n_kv, K, d)), dt)
            cases.append((f"refill E{E},3 blk{blk} K{K} {tag}", lambda u, x, b, blk=blk:
                          _ga.refill_rows_kernel(u, (x, x[:3].astype(jnp.float32)), b, blk), (buf, xb, bo)))
            bufs = jnp.concatenate([buf, buf, buf], axis=2)  # three layers' rows a head: the middle one refilled
            cases.append((f"refill at a row offset E{E} blk{blk} K{K} {tag}", lambda u, x, b, blk=blk, K=K:
                          _ga.refill_rows_kernel(u, (x,), b, blk, row_offset=jnp.int32(K)), (bufs, xb, bo)))
            for bits, gs in ((4, 16), (8, d // 2 if d % 32 == 0 else 16)):  # int extents, dequantized in the kernel
                quantize = _q.quantize_int4 if bits == 4 else _q.quantize_int8
                xq = (quantize(xb.astype(jnp.float32), gs), quantize(xb[:3].astype(jnp.float32), gs))
                cases.append((f"refill int{bits} g{gs} E{E},3 blk{blk} K{K} {tag}", lambda u, x, b, blk=blk:
                              _ga.refill_rows_int_kernel(u, x, b, blk), (buf, xq, bo)))
                cases.append((f"refill int{bits} at a row offset g{gs} E{E} blk{blk} K{K} {tag}",
                              lambda u, x, b, blk=blk, K=K: _ga.refill_rows_int_kernel(
                                  u, x[:1], b, blk, row_offset=jnp.int32(2 * K)), (bufs, xq, bo)))
        if d in (64, 128):
            kq = _q.quantize_int4(k.astype(jnp.float32), 64)
            cases.append((f"int4 {tag}", lambda q, a, L: _q.decode_attention_int4_kernel(
                q, a, a, L), (q, kq, L)))
        Tc, start = 70, S // 3
        qp = jnp.asarray(rng.standard_normal((B, n_kv * G, Tc, d)), dt)
        cases.append((f"prefill Tc{Tc} {tag}", lambda q, k, L: _pf.prefill_attention_chunk_kernel(
            q, k, k, jnp.int32(start), L), (qp, k, L)))
    from kvoffload.pallas import select as _sel
    for R, N, kk in ((8, 131072, 13107), (3, 333, 40), (2, 100, 100)):
        keys = _tk.orderable_keys(jnp.asarray(rng.standard_normal((R, N)), jnp.float32))
        want = jnp.full((R,), kk // 2, jnp.int32)
        cases.append((f"select_rows R{R} N{N} k{kk}", lambda x, n, kk=kk: _sel.select_rows_kernel(x, n, kk),
                      (keys, want)))
        cases.append((f"select_rows one launch R{R} N{N} k{kk}", lambda x, n, kk=kk, N=N: _sel.select_rows_kernel(
            x, n, kk, fused_max=N), (keys, want)))
    from kvoffload.pallas import stacked_linear as _sl
    for L, M, K, N in ((3, 1, 300, 130), (2, 70, 4096, 1024), (3, 5, 1100, 48)):
        xs = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        ws = jnp.asarray(rng.standard_normal((L, K, N)), jnp.bfloat16)
        cases.append((f"stacked_linear L{L} M{M} K{K} N{N}", lambda x, w: _sl.stacked_linear_kernel(
            x, w, jnp.int32(L - 1), poison=True), (xs, ws)))
    x = jnp.asarray(rng.standard_normal((1, 40, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 128)), jnp.bfloat16)
    cases.append(("recompute", lambda x, w: _rc.recompute_kv_kernel(x, w, None, w, None, None,
                                                                     None, n_kv=2), (x, w)))
    results = []
    for name, f, args in cases:
        try:
            jax.jit(f).lower(*args)
            r = dict(name=f"lower {name}", mode="lower", ok=True, err=0.0, tol=0.0)
        except Exception as e:  # noqa: BLE001
            r = dict(name=f"lower {name}", mode="lower", ok=False, err=float("nan"), tol=0.0,
                     error=f"{type(e).__name__}: {e}"[:2000])
        results.append(r)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="exhaustive sweep")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--interpret", action="store_true",
                    help="run the kernels in Pallas interpret mode (= --modes "
                         "reference,interpret; for CPU)")
    ap.add_argument("--lower-only", action="store_true",
                    help="CPU pre-flight: only lower every kernel to Triton IR (no GPU, no "
                         "execution); catches non-power-of-two shapes and unlowerable ops")
    ap.add_argument("--only", default=None,
                    help="comma list of substrings of check ids (e.g. quest,hata,tokenselect)")
    ap.add_argument("--modes", default=None,
                    help="comma list: kernel,reference,interpret (default: kernel,reference "
                         "on GPU; reference,interpret elsewhere)")
    args = ap.parse_args()
    backend = jax.default_backend()
    if args.interpret and not args.modes:
        args.modes = "reference,interpret"
    modes = args.modes.split(",") if args.modes else (
        ["kernel", "reference"] if backend == "gpu" else ["reference", "interpret"])
    print(f"jax {jax.__version__} backend={backend} devices={jax.devices()}", flush=True)
    results = []
    t_all = time.time()
    if args.lower_only:
        modes = []
        results = lower_only_checks()
        for r in results:
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['name']} {r.get('error', '')[:400]}",
                  flush=True)
    for mode in modes:
        if mode == "reference":
            cases = reference_cases(full=args.full)
        elif args.full:
            cases = kernel_cases(full=True)
        else:
            cases = gpu_cases() if mode == "kernel" else kernel_cases()
        if args.only:
            cases = [(fn, kw) for fn, kw in cases
                     if any(o in case_id(fn, kw) for o in args.only.split(","))]
        for fn, kw in cases:
            t0 = time.time()
            try:
                r = run_case(fn, kw, mode)
            except Exception as e:  # noqa: BLE001
                r = dict(name=case_id(fn, kw), mode=mode, ok=False, err=float("nan"),
                         tol=0, error=f"{type(e).__name__}: {e}"[:2000],
                         trace=traceback.format_exc()[-3000:])
            r["seconds"] = round(time.time() - t0, 2)
            results.append(r)
            status = "ok  " if r["ok"] else "FAIL"
            print(f"{status} {r['mode']:9s} {r['name']:66s} err={r['err']:.2e} "
                  f"tol={r['tol']:.0e} {r['seconds']:.1f}s"
                  + (f"\n     {r['error'][:400]}" if "error" in r else ""), flush=True)
    for extra in (() if args.lower_only else (dispatch_check, pinned_host_check, topk_ops_check,
                                              paged_ops_check)):
        try:
            r = extra()
        except Exception as e:  # noqa: BLE001
            r = dict(name=extra.__name__, mode="auto", ok=False, err=float("nan"), tol=0,
                     error=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-3000:])
        results.append(r)
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['mode']:9s} {r['name']:66s} "
              f"err={r['err']:.2e} {r.get('path', '')} {r.get('error', '')[:400]}", flush=True)
    n_fail = sum(not r["ok"] for r in results)
    summary = dict(jax=jax.__version__, backend=backend,
                   device=str(jax.devices()[0].device_kind), n=len(results), failed=n_fail,
                   seconds=round(time.time() - t_all, 1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_kernels.json"), "w") as f:
        json.dump(dict(summary=summary, results=results), f, indent=1, default=str)
    with open(os.path.join(args.out, "check_kernels.md"), "w") as f:
        f.write("| status | mode | check | rel err | tol |\n|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {'ok' if r['ok'] else 'FAIL'} | {r['mode']} | {r['name']} | "
                    f"{r['err']:.2e} | {r['tol']:.0e} |\n")
    print(f"\nSUMMARY {summary}")
    for r in results:
        if not r["ok"]:
            print("FAILED:", r["mode"], r["name"], r.get("error", "")[:300])
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
