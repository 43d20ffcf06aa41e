#!/usr/bin/env python
"""Quest's page bounds alone (`clo.quest_bounds`), per form, at one layer shape times the layers of a step:
the committed form (per block, operands in the query's dtype, f32 sums) against f32 operands at HIGHEST
precision and against one query for every block (batch 1), for bf16 pages and int8 pages.

    PYTHONPATH=src python scripts/bench_quest_bounds.py                     # Llama-3-8B at 128K, page 32
    PYTHONPATH=src python scripts/bench_quest_bounds.py --layers 2 --blocks 64 --repeats 2   # a CPU smoke run

One jit per form runs every layer's scoring (separate pages per layer); the median of --repeats calls. Each
form's layer-0 bounds are compared with the f32 form's (max_rel_diff: bf16 operands round the query)."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2048, help="pool blocks of a layer (2048 x 64 tokens: 128K)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=2, help="pages per block (64-token blocks, pages of 32)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from kvoffload.offload.bench import write_json
    from kvoffload.policies.clo import quest_bounds, quest_int8

    L, E, n_kv, P, d, H = args.layers, args.blocks, args.kv_heads, args.pages, args.head_dim, args.heads
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    kmin = jax.random.normal(k[0], (L, E, n_kv, P, d), jnp.bfloat16) - 1
    kmax = kmin + jnp.abs(jax.random.normal(k[1], (L, E, n_kv, P, d), jnp.bfloat16))
    q = jax.random.normal(k[2], (H, d), jnp.bfloat16)
    pages = {"bf16": (kmin, kmax), "int8": jax.jit(jax.vmap(quest_int8))(kmin, kmax)}

    def f32_highest(qb, mn, mx, sc=None):  # the form before: f32 operands at HIGHEST precision
        return quest_bounds(qb.astype(jnp.float32), mn, mx, sc)

    def one_query(qb, mn, mx, sc=None):  # batch 1: the one query against every block, no per-block copy
        qg = qb[0].reshape(n_kv, H // n_kv, d)
        kw = dict(preferred_element_type=jnp.float32)
        s = jnp.einsum("hgd,ehpd->ehgp", jnp.maximum(qg, 0), mx.astype(qg.dtype), **kw) + \
            jnp.einsum("hgd,ehpd->ehgp", jnp.minimum(qg, 0), mn.astype(qg.dtype), **kw)
        return (s if sc is None else s * sc[:, :, None, :]).max(2)

    forms = {"per block, query dtype (clo)": quest_bounds, "per block, f32 HIGHEST": f32_highest,
             "one query, query dtype": one_query}
    res = {"device": jax.devices()[0].device_kind, "shape": dict(layers=L, blocks=E, kv_heads=n_kv, pages=P,
                                                                  head_dim=d, heads=H), "ms": {}, "max_rel_diff": {}}
    qb0 = jnp.broadcast_to(q, (E, H, d))
    refs = {kind: f32_highest(qb0, *[x[0] for x in meta]) for kind, meta in pages.items()}  # layer 0, f32 HIGHEST
    for name, form in forms.items():
        for kind, meta in pages.items():
            def step(qv, *m, form=form):
                qb = jnp.broadcast_to(qv, (E, H, d))
                return [form(qb, *[x[i] for x in m]) for i in range(L)]
            g = jax.jit(step)
            out = jax.block_until_ready(g(q, *meta))
            ref = refs[kind]
            res["max_rel_diff"][f"{name} | {kind}"] = float(jnp.max(jnp.abs(out[0] - ref)) / jnp.max(jnp.abs(ref)))
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                jax.block_until_ready(g(q, *meta))
                ts.append(time.perf_counter() - t)
            ms = sorted(ts)[len(ts) // 2] * 1e3
            res["ms"][f"{name} | {kind}"] = ms
            print(f"| {name} | {kind} pages | {ms:.3f} ms |", flush=True)
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
