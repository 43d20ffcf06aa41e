#!/usr/bin/env python3
"""Run every kernel-vs-float64 check on this machine (GPU: compiled Triton kernels).

    PYTHONPATH=src python3 scripts/check_kernels.py [--full] [--out DIR]

Prints a table, writes check_kernels.json / .md to --out (default $OUT or .), exits
non-zero if any check fails or errors. Also checks the ops dispatch (impl="auto" must
pick the kernel on GPU) and the zero-copy pinned_host sparse-attention path.
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
from kvoffload.pallas import checks as C


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
    err = max(C.rel_err(out[0], np.asarray(ref[0].astype(jnp.float32))),
              C.lse_err(np.asarray(out[1]), np.asarray(ref[1])))
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="exhaustive sweep")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--modes", default=None,
                    help="comma list: kernel,reference,interpret (default: kernel,reference "
                         "on GPU; reference,interpret elsewhere)")
    args = ap.parse_args()
    backend = jax.default_backend()
    modes = args.modes.split(",") if args.modes else (
        ["kernel", "reference"] if backend == "gpu" else ["reference", "interpret"])
    print(f"jax {jax.__version__} backend={backend} devices={jax.devices()}", flush=True)
    results = []
    t_all = time.time()
    for mode in modes:
        if mode == "reference":
            cases = C.reference_cases(full=args.full)
        elif args.full:
            cases = C.kernel_cases(full=True)
        else:
            cases = C.gpu_cases() if mode == "kernel" else C.kernel_cases()
        for fn, kw in cases:
            t0 = time.time()
            try:
                r = C.run_case(fn, kw, mode)
            except Exception as e:  # noqa: BLE001
                r = dict(name=C.case_id(fn, kw), mode=mode, ok=False, err=float("nan"),
                         tol=0, error=f"{type(e).__name__}: {e}"[:2000],
                         trace=traceback.format_exc()[-3000:])
            r["seconds"] = round(time.time() - t0, 2)
            results.append(r)
            status = "ok  " if r["ok"] else "FAIL"
            print(f"{status} {r['mode']:9s} {r['name']:66s} err={r['err']:.2e} "
                  f"tol={r['tol']:.0e} {r['seconds']:.1f}s"
                  + (f"\n     {r['error'][:400]}" if "error" in r else ""), flush=True)
    for extra in (dispatch_check, pinned_host_check):
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
