"""Where the `full` policy's decode step spends its time on the GPU: the whole step, then the same
step with parts swapped out (attention by its XLA reference, attention removed), plus the decode-attention op alone at the step's shape. Random bf16 weights in a real
shape. Prints a table; writes JSON to $OUT (or ./results).

    python experiments/profile_full_step.py --shape opt-6.7b --batch 64 --context 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.models.transformer import dense_cache, dense_decode, init_params
from kvoffload.plan.profiler import model_shape


def time_steps(cfg, params, cache, tok, n):
    """(median synced ms, mean back-to-back ms) over n steps each; tail flushes included."""
    logits, cache, c = dense_decode(cfg, params, cache, tok, 0)
    for _ in range(cache.tail_slots + 1):  # warm-up past one tail flush: both programs compiled
        logits, cache, c = dense_decode(cfg, params, cache, jnp.argmax(logits, -1).astype(jnp.int32), c)
    jax.block_until_ready(logits)
    per = []
    for _ in range(n):  # as generation runs it: the chosen tokens reach the host each step
        t = time.perf_counter()
        logits, cache, c = dense_decode(cfg, params, cache, jnp.argmax(logits, -1).astype(jnp.int32), c)
        np.asarray(jnp.argmax(logits, -1))
        per.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):  # back to back, one sync at the end: GPU time
        logits, cache, c = dense_decode(cfg, params, cache, jnp.argmax(logits, -1).astype(jnp.int32), c)
    jax.block_until_ready(logits)
    return float(np.mean(per)) * 1e3, (time.perf_counter() - t) / n * 1e3, cache


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="opt-6.7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64, help="steps timed per mode (tail flushes amortised)")
    ap.add_argument("--variants", nargs="*", help="substrings of the variant names to run (default: all)")
    args = ap.parse_args()
    cfg = model_shape(args.shape)
    one = init_params(dataclasses.replace(cfg, num_layers=1), jax.random.key(0), jnp.bfloat16)
    params = dataclasses.replace(one, layers=tuple(jax.tree.map(lambda a: a.copy(), one.layers[0])
                                                   for _ in range(cfg.num_layers)))
    b, cap = args.batch, args.context + 2 * args.steps + 128
    shape = (b, cfg.num_kv_heads, cap, cfg.head_dim)
    key = jax.random.key(1)

    def fresh_cache():
        k = jax.random.normal(key, shape, jnp.bfloat16)
        return dense_cache(tuple(k + 0 for _ in range(cfg.num_layers)), tuple(k * 0.5 for _ in range(cfg.num_layers)),
                           jnp.full((b,), args.context, jnp.int32))

    tok = jax.device_put(jnp.ones((b,), jnp.int32))
    w_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = 2 * cfg.num_layers * b * cfg.num_kv_heads * args.context * cfg.head_dim * 2
    floor_ms = (w_bytes + kv_bytes) / 4.0e12 * 1e3
    print(f"{args.shape} b{b} ctx {args.context}: weights {w_bytes/1e9:.1f} GB, KV {kv_bytes/1e9:.1f} GB, "
          f"floor at 4 TB/s {floor_ms:.2f} ms", flush=True)

    real_attn = ops.decode_attention
    variants = {
        "step (as shipped)": real_attn,
        "attention = XLA reference": lambda q, k, v, l, **kw: real_attn(q, k, v, l, impl="reference"),
        "attention removed": lambda q, k, v, l, **kw: (q, jnp.zeros(q.shape[:2], jnp.float32)),
    }
    if args.variants:
        variants = {k: v for k, v in variants.items() if any(w in k for w in args.variants)}
    rows = {}
    for name, attn in variants.items():
        ops.decode_attention = attn
        jax.clear_caches()
        t0 = time.perf_counter()
        synced, gpu, _ = time_steps(cfg, params, fresh_cache(), tok, args.steps)
        rows[name] = dict(synced_ms=synced, back_to_back_ms=gpu, first_two_s=time.perf_counter() - t0)
        print(f"{name:28s} synced {synced:7.2f} ms  back-to-back {gpu:7.2f} ms", flush=True)
    ops.decode_attention = real_attn

    q = jax.random.normal(key, (b, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    kc = fresh_cache()
    lens = jnp.full((b,), args.context, jnp.int32)
    for impl in ("kernel", "reference") if ops.kernel_default() else ("reference",):
        f = jax.jit(lambda q, k, v, l, impl=impl: ops.decode_attention(q, k, v, l, impl=impl))
        jax.block_until_ready(f(q, kc.k[0], kc.v[0], lens))
        t = time.perf_counter()
        for i in range(20):
            r = f(q, kc.k[i % cfg.num_layers], kc.v[i % cfg.num_layers], lens)
        jax.block_until_ready(r)
        us = (time.perf_counter() - t) / 20 * 1e6
        rows[f"decode_attention {impl} (one layer)"] = dict(us=us, x_layers_ms=us * cfg.num_layers / 1e3)
        print(f"decode_attention {impl:9s} one layer {us:8.1f} us  (x{cfg.num_layers} layers = {us*cfg.num_layers/1e3:.2f} ms)")
    out = os.environ.get("OUT", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"profile_full_{args.shape}.json"), "w") as f:
        json.dump(dict(args=vars(args), floor_ms=floor_ms, device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
