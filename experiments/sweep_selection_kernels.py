#!/usr/bin/env python
"""Launch sweeps of the selection kernels a `clo` decode layer runs, at the 128K b1 Llama-3-8B shapes,
timed as a layer program runs them: N_CALLS calls inside one jit, so the launches go back to back (a call timed
alone from Python mostly times its dispatch).

* ``select``  the top-k of 8 rows x 128K scores, k = 10%, with one row selecting (the other 7 heads reuse their
              selection: count 0) and with all 8: ``jax.lax.top_k`` + sort, the XLA radix select, and the Pallas
              select (`pallas/select.py`) over its launch parameters.
* ``scores``  the exact scores of one 32K-token extent (512 blocks of 64 tokens, 8 KV heads, d 128), one head
              of 8 scored and all 8: the per-block grid (items None) and 1-8 blocks per program.
* ``refill``  the V refill of a 13107-row x 8-head buffer from four pinned-host extents (`refill_rows_kernel`),
              one and three heads missing, over its launch parameters. Every call reads its own extents (1.3 GB
              in all): calls that reread one 33.5 MB set are served by the GPU's 50 MB L2, not PCIe.

    PYTHONPATH=src python experiments/sweep_selection_kernels.py --out $OUT/sweep.json [--only select,scores,refill]
    PYTHONPATH=src python experiments/sweep_selection_kernels.py --smoke    # tiny shapes, interpret mode (CPU)
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="select,scores,refill")
    ap.add_argument("--select-shapes", default="8x131072",
                    help="rows x keys of the select sweep, comma-separated (8x4096: a clo layer's pages of 32 at 128K; "
                         "512x256: b64 x 8 heads at 8K); rows of up to 16K keys: the one-launch kernel against "
                         "the 9 launches")
    ap.add_argument("--calls", type=int, default=10, help="calls per jit")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode, one variant each (CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.pallas import gather as ga
    from kvoffload.pallas import scores as sc
    from kvoffload.pallas import select as sel
    from kvoffload.pallas import topk as tk
    from kvoffload.pallas.common import on_gpu

    interpret = not on_gpu()
    if interpret and not args.smoke:
        raise SystemExit("sweep_selection_kernels.py times GPU kernels: run it on a GPU, or pass --smoke")
    calls, which, rows_out = args.calls, args.only.split(","), []

    def timed(f, *a):
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)) / calls * 1e6

    def record(kind, cfg, us, **extra):
        rows_out.append(dict(kind=kind, config=cfg, us_per_call=us, **extra))
        print(f"{kind:7s} {us:9.1f} us  {cfg}" + (f"  {extra}" if extra else ""), flush=True)

    rng = np.random.default_rng(0)
    if "select" in which:
        for shape in ["8x300"] if args.smoke else args.select_shapes.split(","):
            R, N = (int(x) for x in shape.split("x"))
            k = N // 10
            pris = [jax.random.normal(jax.random.key(i), (R, N), jnp.float32).at[:, :4].set(jnp.inf)
                    for i in range(calls)]
            keys = [tk.orderable_keys(p) for p in pris]
            if args.smoke:
                variants = [dict(), dict(fused_max=0)]
            elif N <= sel.FUSED_MAX_KEYS:  # the one-launch kernel over its warps, and the multi-launch one
                variants = [dict(fused_max=N, fused_warps=w) for w in (4, 8, 16)] + [dict(fused_max=0)]
            else:
                variants = [dict(chunk=c, count_piece=pc, num_warps=w) for c in (2048, 4096) for pc in (256, 512)
                            for w in (4, 8)] + [dict(compact_piece=cp) for cp in (256, 512, 2048)]
            for pattern, selecting in ((f"{shape}, 1 of 8 rows", max(1, R // 8)), (f"{shape}, every row", R)):
                counts = jnp.where(jnp.arange(R) < selecting, k, 0).astype(jnp.int32)
                want = np.asarray(tk.top_count_ascending(pris[0], counts, k, method="sort")[0])
                for method in ("sort", "radix"):
                    f = jax.jit(lambda ps, c, m=method: [tk.top_count_ascending(p, c, k, method=m)[0] for p in ps])
                    record("select", f"{pattern} XLA {method}", timed(f, pris, counts))
                nv = tk.top_count_ascending(pris[0], counts, k, method="sort")[1]
                for kw in variants:
                    f = jax.jit(lambda ks, c, kw=kw: [sel.select_rows_kernel(x, c, k, interpret=interpret, **kw)
                                                      for x in ks])
                    same = bool(np.array_equal(np.asarray(f(keys, nv)[0]), want))
                    record("select", f"{pattern} Pallas {kw or 'defaults'}", timed(f, keys, nv), equals_sort=same)
    if "scores" in which:
        E, n_kv, blk, d, H = (16, 8, 64, 128, 32) if args.smoke else (512, 8, 64, 128, 32)
        q = jnp.asarray(rng.standard_normal((E, H, d)), jnp.bfloat16)
        ks = [jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), jnp.bfloat16) for _ in range(calls)]
        variants = [(None, 4), (1, 4)] if args.smoke else [(i, w) for i in (None, 1, 2, 4, 8) for w in (2, 4, 8)]
        for pattern, heads in (("1 of 8 heads", 1), ("8 of 8 heads", 8)):
            L = jnp.broadcast_to(jnp.where(jnp.arange(n_kv) < heads, blk, 0).astype(jnp.int32), (E, n_kv))
            ref = np.asarray(sc.topk_scores_exact_reference(q, ks[0], L, group_reduce="max"))
            for items, nw in variants:
                f = jax.jit(lambda q, ks, L, it=items, nw=nw: [sc.topk_scores_exact_kernel(
                    q, k, L, group_reduce="max", items=it, num_warps=nw, interpret=interpret) for k in ks])
                got = np.asarray(f(q, ks, L)[0])
                fin = np.isfinite(ref)
                ok = bool(np.array_equal(fin, np.isfinite(got)) and np.allclose(got[fin], ref[fin], rtol=2e-2, atol=2e-2))
                record("scores", f"{pattern} items={items} warps={nw}", timed(f, q, ks, L), matches_reference=ok)
    if "refill" in which:
        n_kv, blk, d, K, E = (8, 16, 64, 200, 16) if args.smoke else (8, 64, 128, 13107, 512)
        dev = jax.devices()[0]
        kind = "device" if interpret else "pinned_host"  # interpret mode cannot index host memory
        where = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
        ext_sets = [tuple(jax.device_put(jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), jnp.bfloat16), where)
                          for _ in range(4)) for _ in range(calls)]
        n_tok = 4 * E * blk
        variants = [(None, 4)] if args.smoke else [(None, 4)] + [(b, w) for b in (16, 32, 128) for w in (4, 8)] + [(64, 8)]
        for pattern, heads in (("1 of 8 heads", 1), ("3 of 8 heads", 3)):
            toks = []
            for _ in range(calls):
                t = np.stack([np.sort(rng.choice(n_tok, K, replace=False)) for _ in range(n_kv)]).astype(np.int32)
                t[heads:] = -1
                toks.append(jnp.asarray(t)[None])
            buf0 = jnp.zeros((1, n_kv, K, d), jnp.bfloat16)
            for bk, nw in variants:
                def chain(buf, toks, exts, bk=bk, nw=nw):
                    for t, e in zip(toks, exts):
                        buf = ga.refill_rows_kernel(buf, e, t, blk, block_k=bk, num_warps=nw, interpret=interpret)
                    return buf
                f = jax.jit(chain, donate_argnums=0)
                jax.block_until_ready(f(jnp.copy(buf0), toks, ext_sets))
                ts = []
                for _ in range(max(1, args.reps - 2)):
                    buf = jnp.copy(buf0)
                    jax.block_until_ready(buf)
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(buf, toks, ext_sets))
                    ts.append(time.perf_counter() - t0)
                us = float(np.median(ts)) / calls * 1e6
                record("refill", f"{pattern} block_k={bk} warps={nw}", us,
                       gb_per_s=round(heads * K * d * 2 / us / 1e3, 1))
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, calls_per_jit=calls,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = args.out or os.path.join(os.environ.get("OUT", "."), "sweep_selection_kernels.json")
    with open(out, "w") as fh:
        json.dump(dict(meta=meta, results=rows_out), fh, indent=1)
    print(f"wrote {out}")
    return rows_out


if __name__ == "__main__":
    main()
