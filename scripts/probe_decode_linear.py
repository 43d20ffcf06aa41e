"""How fast a decode step's projections read their weights: every b-row linear of a model's layer
(q, k|v, o, gate, up, gate|up fused, down) written as XLA's einsum with an fp32 result (the model's `linear`),
as XLA's einsum with a result in x's dtype, and as the Pallas stacked-linear kernel over a sweep of its tiles.
The weight bytes over the card's read rate are the floor; a step of Llama-3-8B at b1 spends ~5.4 ms in these
matmuls, ~2x that floor (BENCHMARKS 'Kernel timings').

    PYTHONPATH=src python scripts/probe_decode_linear.py --out $OUT/linear.json
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=src python scripts/probe_decode_linear.py --no-pallas

Each form runs over `copies` distinct weight arrays in one program (together larger than the L2 cache, so each
call reads HBM), `reps` programs back to back, best of 3. Reports us a call, TB/s of weight bytes, and the
largest difference from the fp32-result einsum (a different summation order: bf16 rounding, not zero).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def projection_shapes(cfg) -> dict:
    """{name: (K, N)} of one decoder layer's linears (and the fused pairs a layer could store)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (h, nq), "k": (h, nkv), "kv": (h, 2 * nkv), "o": (nq, h), "gate": (h, i), "gate_up": (h, 2 * i),
            "down": (i, h)}


def weight_copies(nbytes: int, interpret: bool) -> int:
    """How many distinct copies of a weight one timed program reads: > 8x the 50 MB L2 of an H200, so each read
    comes from HBM; at most 128: each copy is a launch, and thousands (a tiny test shape's 24K) take minutes to
    compile, while such a shape is not a bandwidth measurement anyway. Two in interpret mode (CPU)."""
    if interpret:
        return 2
    return min(128, max(4, -(-400_000_000 // nbytes)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--rows", default="1,64", help="comma list of M (tokens multiplied: batch x 1 at decode)")
    ap.add_argument("--only", default=None, help="comma list of projection names")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-pallas", action="store_true")
    ap.add_argument("--sweep", default="32,64,128/128,256,512/4,8/3",
                    help="block_n list / block_k list / num_warps list / num_stages list of the kernel sweep")
    ap.add_argument("--targets", default="512", help="comma list of the kernel's target program counts")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop sweeping after this many seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.offload.bench import write_json
    from kvoffload.pallas.stacked_linear import stacked_linear_kernel
    from kvoffload.plan.profiler import model_shape

    t_start = time.perf_counter()
    cfg = model_shape(args.shape)
    shapes = projection_shapes(cfg)
    if args.only:
        shapes = {k: shapes[k] for k in args.only.split(",")}
    interpret = jax.default_backend() == "cpu"
    bns, bks, warps, stages = ([int(v) for v in part.split(",")] for part in args.sweep.split("/"))
    targets = [int(v) for v in args.targets.split(",")]
    rng = np.random.default_rng(0)
    rows = {}

    def timed(fn, *a):
        out = jax.block_until_ready(fn(*a))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(args.reps):
                o = fn(*a)
            jax.block_until_ready(o)
            best = min(best, (time.perf_counter() - t) / args.reps)
        return best, out

    for name, (K, N) in shapes.items():
        nbytes = K * N * 2
        copies = weight_copies(nbytes, interpret)
        w = jnp.asarray(rng.standard_normal((copies, K, N)) * K ** -0.5, jnp.bfloat16)
        ws = [w[c:c + 1] for c in range(copies)]  # separate [1, K, N] arrays: the kernel's stacked form, L = 1
        del w
        for M in (int(m) for m in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)

            def program(lin):
                return jax.jit(lambda ws, x: sum(lin(x, wc).astype(jnp.float32) for wc in ws))

            forms = {
                "einsum_f32": lambda x, wc: jnp.einsum("mk,kn->mn", x, wc[0],
                                                       preferred_element_type=jnp.float32).astype(x.dtype),
                "einsum_bf16": lambda x, wc: jnp.einsum("mk,kn->mn", x, wc[0]),
            }
            if not args.no_pallas:
                for bn, bk, nw, ns, tp in itertools.product(bns, bks, warps, stages, targets):
                    forms[f"pallas n{bn} k{bk} w{nw} s{ns} t{tp}"] = (
                        lambda x, wc, bn=bn, bk=bk, nw=nw, ns=ns, tp=tp: stacked_linear_kernel(
                            x, wc, jnp.int32(0), interpret=interpret, block_n=bn, block_k=bk, num_warps=nw,
                            num_stages=ns, target_programs=tp))
            ref = None
            for form, lin in forms.items():
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget reached: {name} M{M} {form} and later not run", flush=True)
                    break
                try:
                    s, out = timed(program(lin), ws, x)
                except Exception as e:  # a tile choice Triton cannot lower: report, go on
                    rows[f"{name} M{M} {form}"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                if ref is None:
                    ref = out
                us = 1e6 * s / copies
                r = dict(shape=name, K=K, N=N, M=M, form=form, us=us, tb_s=nbytes / (us * 1e-6) / 1e12,
                         max_abs_diff=float(jnp.max(jnp.abs(out - ref))))
                rows[f"{name} M{M} {form}"] = r
                print(f"{name:8s} M{M:<3d} {form:28s} {us:8.1f} us {r['tb_s']:5.2f} TB/s diff {r['max_abs_diff']:.3g}",
                      flush=True)
    best = {}
    for r in rows.values():
        if "us" in r:
            key = f"{r['shape']} M{r['M']}"
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    print("\nfastest form per projection:")
    for k, r in best.items():
        print(f"  {k:14s} {r['form']:28s} {r['us']:8.1f} us {r['tb_s']:.2f} TB/s")
    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=args.shape,
               xla_flags=os.environ.get("XLA_FLAGS", ""), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               forms=rows, fastest=best)
    if args.out:
        write_json(args.out, rec)
    return rec


if __name__ == "__main__":
    main()
