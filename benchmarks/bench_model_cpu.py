"""Embedded model on this machine: conversion time and peak host memory (fresh process), load
time, prefill and decode tokens per second (after compilation). Prints a markdown table.

    python benchmarks/bench_model_cpu.py [--prompt-lengths 128 1024] [--decode-steps 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
t0 = time.time()
from kvoffload.models import load_model
m = load_model(None, quiet=True)
print(json.dumps({"seconds": time.time() - t0, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def fresh_process(cache: str) -> dict:
    env = dict(os.environ, KVOFFLOAD_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--decode-steps", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        convert = fresh_process(cache)  # first use: GGUF -> orbax
        load = fresh_process(cache)  # cached
    print(f"convert {convert}, load {load}", file=sys.stderr)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.models import load_model
    from kvoffload.models.transformer import dense_cache_from_prefill, dense_decode, prefill

    model = load_model(None, quiet=True)
    cfg, params = model.config, model.params
    rows = []
    for t in args.prompt_lengths:
        toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        lens = jnp.asarray([t], jnp.int32)
        jax.block_until_ready(prefill(cfg, params, toks, lens))  # compile
        t0 = time.perf_counter()
        out = jax.block_until_ready(prefill(cfg, params, toks, lens))
        pre = time.perf_counter() - t0
        cache = dense_cache_from_prefill(out[1], out[2], lens, t + args.decode_steps + 64)
        tok = jnp.argmax(out[0], -1).astype(jnp.int32)
        logits, cache, n = dense_decode(cfg, params, cache, tok, 0)
        for _ in range(cache.tail_slots):  # compile the step and the tail flush
            logits, cache, n = dense_decode(cfg, params, cache, jnp.argmax(logits, -1).astype(jnp.int32), n)
        jax.block_until_ready(logits)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            logits, cache, n = dense_decode(cfg, params, cache, jnp.argmax(logits, -1).astype(jnp.int32), n)
        jax.block_until_ready(logits)
        dec = (time.perf_counter() - t0) / args.decode_steps
        rows.append((t, t / pre, 1 / dec, dec * 1000))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, fp32")
    print(f"conversion (first use, GGUF -> orbax): {convert['seconds']:.1f} s, peak RSS {convert['peak_rss_mb']:.0f} MB")
    print(f"load from cache: {load['seconds']:.1f} s, peak RSS {load['peak_rss_mb']:.0f} MB")
    print("| prompt tokens | prefill tok/s | decode tok/s (batch 1) | decode ms/step |")
    print("|---|---|---|---|")
    for t, p, d, ms in rows:
        print(f"| {t} | {p:.0f} | {d:.1f} | {ms:.1f} |")


if __name__ == "__main__":
    main()
