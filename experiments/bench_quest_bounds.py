#!/usr/bin/env python
"""Quest's page bounds alone (`clo.quest_bounds`), per form, at one layer shape times the layers of a step:
XLA's forms (per block, operands in the query's dtype, f32 sums; f32 operands at HIGHEST precision; one query
for every block at batch 1; f32 products summed without a matmul) against the Pallas kernel clo runs on the GPU
(`pallas.scores.quest_block_bounds_kernel`, over its rows a program; one setting, interpreted, off the GPU), for bf16
pages and int8 pages.

    PYTHONPATH=src python experiments/bench_quest_bounds.py                     # Llama-3-8B at 128K, page 32
    PYTHONPATH=src python experiments/bench_quest_bounds.py --layers 2 --blocks 64 --repeats 2   # a CPU smoke run

One jit per form runs every layer's scoring (separate pages per layer); the median of --repeats calls. Each
form's layer-0 bounds are compared with the f32 form's (max_rel_diff: bf16 operands round the query)."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # _common


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

    from _common import write_json
    from kvoffload.pallas.common import on_gpu
    from kvoffload.pallas.scores import quest_block_bounds_kernel, quest_block_bounds_reference
    from kvoffload.policies.clo import quest_int8

    L, E, n_kv, P, d, H = args.layers, args.blocks, args.kv_heads, args.pages, args.head_dim, args.heads
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    kmin = jax.random.normal(k[0], (L, E, n_kv, P, d), jnp.bfloat16) - 1
    kmax = kmin + jnp.abs(jax.random.normal(k[1], (L, E, n_kv, P, d), jnp.bfloat16))
    q = jax.random.normal(k[2], (1, H, d), jnp.bfloat16)
    stacked = {"bf16": (kmin, kmax, None), "int8": jax.jit(jax.vmap(quest_int8))(kmin, kmax)}
    # every layer's pages their own arrays, as a step's layers hold them (slices of one stacked array would
    # cost the matmul forms a copy each)
    pages = {kind: [tuple(None if x is None else x[i] for x in m) for i in range(L)] for kind, m in stacked.items()}
    owner = jnp.zeros((E,), jnp.int32)  # batch 1: every block request 0's

    def per_block(qv, mn, mx, sc):  # XLA: E x n_kv batched [G, d] x [d, P] products (clo's form before)
        return quest_block_bounds_reference(qv, owner, mn, mx, sc)

    def f32_highest(qv, mn, mx, sc):  # the form before that: f32 operands at HIGHEST precision
        return quest_block_bounds_reference(qv.astype(jnp.float32), owner, mn, mx, sc)

    def one_query(qv, mn, mx, sc):  # batch 1: the one query against every block, no per-block copy
        qg = qv[0].reshape(n_kv, H // n_kv, d)
        kw = dict(preferred_element_type=jnp.float32)
        s = jnp.einsum("hgd,ehpd->ehgp", jnp.maximum(qg, 0), mx.astype(qg.dtype), **kw) + \
            jnp.einsum("hgd,ehpd->ehgp", jnp.minimum(qg, 0), mn.astype(qg.dtype), **kw)
        return (s if sc is None else s * sc[:, :, None, :]).max(2)

    def summed(qv, mn, mx, sc):  # no matmul: f32 products summed over the channels (a reduction fusion)
        qg = qv[0].reshape(1, n_kv, H // n_kv, 1, d).astype(jnp.float32)
        s = jnp.sum(jnp.maximum(qg, 0) * mx[:, :, None].astype(jnp.float32)
                    + jnp.minimum(qg, 0) * mn[:, :, None].astype(jnp.float32), axis=-1)
        return (s if sc is None else s * sc[:, :, None, :]).max(2)

    def kernel(rows):  # the Pallas kernel clo runs on the GPU (`ops.quest_block_bounds`)
        return lambda qv, mn, mx, sc: quest_block_bounds_kernel(qv, owner, mn, mx, sc, rows=rows,
                                                                interpret=not on_gpu())

    forms = {"XLA per block (before)": per_block, "XLA per block, f32 HIGHEST": f32_highest,
             "XLA one query": one_query, "XLA f32 products summed": summed,
             **{f"Pallas kernel, {r} rows a program": kernel(r) for r in ((16, 32, 64) if on_gpu() else (32,))}}
    res = {"device": jax.devices()[0].device_kind, "shape": dict(layers=L, blocks=E, kv_heads=n_kv, pages=P,
                                                                  head_dim=d, heads=H), "ms": {}, "max_rel_diff": {}}
    refs = {kind: f32_highest(q, *meta[0]) for kind, meta in pages.items()}  # layer 0, f32 HIGHEST
    for name, form in forms.items():
        for kind, meta in pages.items():
            def step(qv, m, form=form):
                return [form(qv, *m[i]) for i in range(L)]
            g = jax.jit(step)
            out = jax.block_until_ready(g(q, meta))
            ref = refs[kind]
            res["max_rel_diff"][f"{name} | {kind}"] = float(jnp.max(jnp.abs(out[0] - ref)) / jnp.max(jnp.abs(ref)))
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                jax.block_until_ready(g(q, meta))
                ts.append(time.perf_counter() - t)
            ms = sorted(ts)[len(ts) // 2] * 1e3
            res["ms"][f"{name} | {kind}"] = ms
            print(f"| {name} | {kind} pages | {ms:.3f} ms |", flush=True)
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
