"""Whether a decode step run as ONE program looping over stacked layers (`lax.fori_loop`, a known trip count)
frees the host from the per-layer call cost that bounds `clo` at b1: the step's layers as 32 jitted
calls (as the pipeline runs them: one cached program, each layer's own weights and cache) against one call whose
loop indexes stacked weights and caches. Same layer code, same attention, same numbers.

    PYTHONPATH=src python scripts/probe_scan_layers.py --shape llama-3-8b --context 32768 --out $OUT/scan.json
    PYTHONPATH=src python scripts/probe_scan_layers.py --shape tiny.json --context 256 --steps 3   # CPU check

Per variant and round (interleaved): the host's seconds to issue a step (every program dispatched) and the
step's wall time with its hidden state waited for, as a decode step ends. --glue N adds N small dependent ops to
a layer (clo's layer program launches ~50 kernels against a dense layer's ~30). Random weights (timing only);
one layer's draw shared by every layer. Checks the two variants' hidden states agree before timing.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b", help="a named shape or a config.json")
    ap.add_argument("--context", type=int, default=32768, help="KV tokens per layer")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--glue", type=int, default=20, help="extra small ops per layer")
    ap.add_argument("--attention", default="reference", help="ops.decode_attention impl (the loop variant "
                    "indexes its layer's cache; a kernel would copy that slice first)")
    ap.add_argument("--linear", default="einsum", choices=("einsum", "mulsum"),
                    help="mulsum: the model's linear as an fp32 multiply and sum (test: may XLA fuse the loop's "
                         "dynamic slice of a stacked weight into it, where it copies the slice for the einsum?)")
    ap.add_argument("--host-rows", type=int, default=0,
                    help="N: each layer also refills N rows a KV head from a pinned-host extent (clo's read), the "
                         "loop from one extent holding every layer's blocks (layer i's block ids offset by i x E)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload import ops
    from kvoffload.hlo_text import large_writes
    from kvoffload.models.transformer import family, init_params
    from kvoffload.offload.bench import report_variants, time_variants, use_mulsum_linear
    from kvoffload.runtime.layer import put_rows
    from kvoffload.plan.profiler import model_shape

    if args.linear == "mulsum":  # before anything compiles: both variants use it
        use_mulsum_linear()

    cfg = model_shape(args.shape)
    n_layers = args.layers or cfg.num_layers
    one = dataclasses.replace(cfg, num_layers=1)
    lp0 = init_params(one, jax.random.key(0), jnp.bfloat16).layers[0]
    fam = family(cfg)
    B, T = 1, args.context + 64

    BLK = 64

    def layer(lp, h, pos, kc, vc, length, ext=None, buf=None, toks=None):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, pos)
        kc, vc = put_rows(kc, k, length, 1), put_rows(vc, v, length, 1)
        if ext is not None:
            buf = ops.refill_block_rows(buf, [ext], toks, BLK)
        return attend_rest(lp, h, q, kc, vc, length, buf), kc, vc, buf

    def attend_rest(lp, h, q, kc, vc, length, rows=None):
        o, _ = ops.decode_attention(q[:, :, 0], kc, vc, length + 1, impl=args.attention)
        g = o.astype(jnp.float32)
        if rows is not None:  # the refilled rows feed the output (kept live), a GQA group each
            g = g + 1e-3 * jnp.repeat(jnp.mean(rows.astype(jnp.float32), 2), cfg.num_heads // cfg.num_kv_heads, 1)
        for j in range(args.glue):  # small dependent ops kept apart (clo's selection bookkeeping stands in)
            g = jax.lax.optimization_barrier(g * (1.0 + 1e-7 * j))
        return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, g.astype(h.dtype)[:, :, None]))

    layer_call = jax.jit(layer, donate_argnums=(3, 4, 7))

    @functools.partial(jax.jit, donate_argnums=(3, 4, 7))
    def loop_call(stacked, h, pos, kcs, vcs, length, ext=None, bufs=None, toks=None):
        def body(i, carry):
            h, kcs, vcs, bufs = carry
            lp = jax.tree.map(lambda a: a[i], stacked)
            x = fam.attn_input(cfg, lp, h)
            q, k, v = fam.qkv(cfg, lp, x, pos)
            # the new token written into the stacked cache in place (the layer's cache is never copied out)
            kcs = jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice(c, n[None].astype(c.dtype), (i, 0, t, 0)),
                           in_axes=(1, 0, 0), out_axes=1)(kcs, k, length)
            vcs = jax.vmap(lambda c, n, t: jax.lax.dynamic_update_slice(c, n[None].astype(c.dtype), (i, 0, t, 0)),
                           in_axes=(1, 0, 0), out_axes=1)(vcs, v, length)
            buf = None
            if ext is not None:  # one extent for every layer: layer i's blocks start at i x E
                buf = ops.refill_block_rows(bufs[i], [ext], toks[i] + i * n_blocks * BLK, BLK)
                bufs = bufs.at[i].set(buf)
            return attend_rest(lp, h, q, kcs[i], vcs[i], length, buf), kcs, vcs, bufs
        return jax.lax.fori_loop(0, n_layers, body, (h, kcs, vcs, bufs))

    rng = np.random.default_rng(0)
    kv_shape = (B, cfg.num_kv_heads, T, cfg.head_dim)
    k0 = jnp.asarray(rng.standard_normal(kv_shape), jnp.bfloat16)
    v0 = jnp.asarray(rng.standard_normal(kv_shape), jnp.bfloat16)
    layers = [jax.tree.map(lambda a: a.copy(), lp0) for _ in range(n_layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    kcs, vcs = [k0.copy() for _ in range(n_layers)], [v0.copy() for _ in range(n_layers)]
    kst, vst = jnp.stack(kcs), jnp.stack(vcs)
    h0 = jnp.asarray(rng.standard_normal((B, 1, cfg.hidden_size)) * 0.1, jnp.bfloat16)
    n_blocks = -(-T // BLK)
    host = {"calls": [None] * n_layers, "loop": None}
    bufs = {"calls": [None] * n_layers, "loop": None}
    toks = None
    if args.host_rows:
        pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        ext_shape = (n_blocks, cfg.num_kv_heads, BLK, cfg.head_dim)
        each = [np.asarray(rng.standard_normal(ext_shape), jnp.bfloat16) for _ in range(n_layers)]
        host = {"calls": [jax.device_put(e, pinned) for e in each],
                "loop": jax.device_put(np.concatenate(each), pinned)}
        del each
        toks = jnp.asarray(rng.integers(0, n_blocks * BLK, (n_layers, B, cfg.num_kv_heads, args.host_rows)),
                           jnp.int32)
        buf = jnp.zeros((B, cfg.num_kv_heads, args.host_rows, cfg.head_dim), jnp.bfloat16)
        bufs = {"calls": [buf.copy() for _ in range(n_layers)], "loop": jnp.stack([buf] * n_layers)}
    state = {"calls": [kcs, vcs, bufs["calls"]], "loop": [kst, vst, bufs["loop"]]}
    # compiled once, ahead: the program that runs and the one whose large writes are listed
    length0 = np.full((B,), args.context, np.int32)
    loop_exe = loop_call.lower(stacked, h0, length0[:, None], *state["loop"][:2], length0, host["loop"],
                               state["loop"][2], toks).compile()

    def step(variant, n):
        length = jnp.asarray(np.full((B,), args.context + n, np.int32))  # numpy: no eager program to compile
        pos = jnp.asarray(np.full((B, 1), args.context + n, np.int32))
        t = time.perf_counter()
        if variant == "calls":
            kc, vc, bf = state["calls"]
            h = h0
            for i in range(n_layers):
                h, kc[i], vc[i], bf[i] = layer_call(layers[i], h, pos, kc[i], vc[i], length, host["calls"][i], bf[i],
                                                    None if toks is None else toks[i])
        else:
            k, v, bf = state["loop"]
            h, k, v, bf = loop_exe(stacked, h0, pos, k, v, length, host["loop"], bf, toks)
            state["loop"] = [k, v, bf]
        issued = time.perf_counter() - t
        jax.block_until_ready(h)
        return h, issued, time.perf_counter() - t

    ha, _, _ = step("calls", 0)
    hb, _, _ = step("loop", 0)
    diff = float(jnp.max(jnp.abs(ha.astype(jnp.float32) - hb.astype(jnp.float32))))
    print(f"hidden state, calls vs loop: max |diff| {diff:.3g}", flush=True)
    big = large_writes(loop_exe.as_text())
    print(f"loop program: {len(big)} instructions writing >= 1 MiB", *big[:40], sep="\n  ", flush=True)
    tokens = iter(range(1, 1 << 30))  # each step one token further (the tails have room for 64)
    variants = time_variants(lambda v: step(v, next(tokens) % 63), ("calls", "loop"), args.steps, args.rounds,
                             warmup=2)
    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=args.shape, layers=n_layers,
               context=args.context, glue=args.glue, linear=args.linear, host_rows=args.host_rows,
               attention=args.attention, steps=args.steps, rounds=args.rounds,
               xla_flags=os.environ.get("XLA_FLAGS", ""), max_abs_diff=diff, loop_big_writes=big,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), variants=variants)
    return report_variants(rec, args.out)


if __name__ == "__main__":
    main()
