#!/usr/bin/env python3
"""How fast the zero-copy row gather reads pinned host memory as the pool grows and as rows shrink.

    PYTHONPATH=src python scripts/probe_row_gather.py [--smoke] [--out DIR] [--only one,step]

clo's step gathers the selected K / V rows of every layer straight from the pinned host pool
(`ops.gather_pool_rows`, the Triton kernel `kvo_gather_rows`). On an H200 (2026-11-28) the same
13107 random rows per KV head x 8 heads read at 48 GB/s out of a 0.25 GiB array and 12.5 GB/s out of an
8 GiB one, and int8 / int4 rows (105 MB a step) bought less than their bytes against bf16 rows (240 MB).
A GPU reads host memory through address translations of 4 KiB pages: a working set of many GiB misses
them, and every array a row is spread over (codes, step, min) is one more page per selected run. This
probe separates the two:

one   one pinned_host extent [E, 8, 64, d] of 0.25-8 GiB, gathered over and over: bf16 rows of 256 B and
      uint8 rows of 128 B, selections scattered or in runs of 32 tokens (Quest pages). GB/s by pool size.
step  a decode step's gathers as clo Quest makes them: L layers, each gathering 10% of the context per KV
      head in runs of 32 tokens, one program per step, in three stored forms of the same rows:
        bf16      K and V arrays in the model's dtype (512 B a K+V row)
        split     int8 K codes, int4 V codes, each with its float32 step and min arrays (six arrays, 224 B:
                  how an int4_k_quant="int8" pool stores them now)
        scales    the same with step and min in one array each for K and V (four arrays)
        fused     the same 224 bytes as one uint8 row per token and head (one array)
      us per step and GB/s; split / scales / fused isolate the arrays-per-row cost at equal bytes.
refill  the same step's refills through ``ops.refill_block_rows`` (every head missing): bf16 extents by the native
      kernel, int8 K + int4 V extents by the dequantizing kernel (``refill_rows_int_kernel``) and by the
      gathers + dequantize + ``where`` it replaces; the kernel's buffers checked against the gathers'.

layout  the same step's int8 K and int4 V refills (dequantizing kernel) into every layer's rows of one buffer (at a
      row offset, as a loop over stacked layers writes them), the host rows stored three ways: each layer's own
      extents (the layer calls), every layer's in ONE extent a kind read at token ids + l x E x blk (the loop;
      1-byte arrays of 2-4 GiB padded past 4 GiB: 64-bit offsets), and in chunks of whole layers of at most
      --chunk-bytes a 1-byte array (32-bit offsets, several extents a kernel). K and V timed apart.

Writes probe_row_gather.json / .md to --out (default $OUT or results/). --smoke: tiny sizes on any backend
(CPU: interpret mode; the numbers mean nothing, the code paths and the row checks run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.offload.bench import median_time
from kvoffload.device.memory import host_sharding
from kvoffload.pallas import gather as ga

GIB = 2**30
N_KV, BLK, D = 8, 64, 128


def selection(rng, tokens: int, rows: int, run: int, n_kv: int = N_KV):
    """[1, n_kv, rows] block ids and offsets: per head `rows // run` runs of `run` tokens at random run starts."""
    runs = max(1, rows // run)
    starts = np.stack([np.sort(rng.permutation(tokens // run)[:runs]) * run for _ in range(n_kv)])
    tok = (starts[:, :, None] + np.arange(run)).reshape(n_kv, -1)[None]
    return jnp.asarray(tok // BLK, jnp.int32), jnp.asarray(tok % BLK, jnp.int32)


def pool_place():
    """Where a probed pool lives: pinned host memory on a GPU; elsewhere the device (interpret mode cannot index
    a host operand)."""
    return host_sharding() if jax.default_backend() == "gpu" else jax.devices()[0]


def host_array(shape, dtype, seed: int):
    """A pinned_host array of random values: a tile of 64 blocks repeated (cheap to make at GiB sizes), and
    that tile in NumPy (what `check_rows` reads instead of the host array), placed by `pool_place`."""
    tile = jax.random.randint(jax.random.PRNGKey(seed), (min(shape[0], 64), *shape[1:]), 0, 127).astype(dtype)
    reps = -(-shape[0] // tile.shape[0])
    x = jax.device_put(jnp.tile(tile, (reps,) + (1,) * (len(shape) - 1))[: shape[0]], pool_place())
    jax.block_until_ready(x)
    return x, np.asarray(tile)


def check_rows(tile, block, off, got) -> bool:
    """The gathered rows (every head's first 64) against the tile the host array repeats."""
    b, o, g = np.asarray(block)[0], np.asarray(off)[0], np.asarray(got)[0]
    heads = np.arange(b.shape[0])[:, None]
    return bool(np.array_equal(tile[b[:, :64] % tile.shape[0], heads, o[:, :64]], g[:, :64]))


def probe_one(args, rows_out, interpret):
    rng = np.random.default_rng(0)
    sizes = (2**20, 2**22) if args.smoke else (GIB // 4, GIB, 2 * GIB, 8 * GIB)
    for dtype, d in ((jnp.bfloat16, D), (jnp.uint8, D)):
        row_bytes = d * jnp.dtype(dtype).itemsize
        for size in sizes:
            E = max(1, size // (N_KV * BLK * row_bytes))
            tokens = E * BLK
            x, tile = host_array((E, N_KV, BLK, d), dtype, seed=E)
            f = jax.jit(lambda x, b, o: ga.gather_rows_kernel(x, b, o, interpret=interpret))
            for run in (1, 32):
                block, off = selection(rng, tokens, tokens // 10, run)
                ok = check_rows(tile, block, off, f(x, block, off))
                t = median_time(lambda: f(x, block, off), reps=7, warmup=2)
                nbytes = int(block.size) * row_bytes
                rows_out.append(dict(probe="one", dtype=jnp.dtype(dtype).name, row_bytes=row_bytes,
                                     pool_bytes=int(x.nbytes), run=run, rows=int(block.size), us=t * 1e6,
                                     GBps=nbytes / t / 1e9, exact=ok))
                print(f"one {jnp.dtype(dtype).name:8s} row {row_bytes:3d} B pool {x.nbytes / GIB:6.2f} GiB "
                      f"run {run:2d}: "
                      f"{t * 1e6:9.1f} us {nbytes / t / 1e9:6.1f} GB/s rows ok {ok}", flush=True)
            del x


FORMS = {  # per layer: (name, dtype, columns) of each array a token's K+V row is stored over
    "bf16": (("k", jnp.bfloat16, D), ("v", jnp.bfloat16, D)),
    "split": (("k_codes", jnp.uint8, D), ("k_step", jnp.float32, D // 64), ("k_min", jnp.float32, D // 64),
              ("v_codes", jnp.uint8, D // 2), ("v_step", jnp.float32, D // 64), ("v_min", jnp.float32, D // 64)),
    "scales": (("k_codes", jnp.uint8, D), ("k_scales", jnp.float32, 2 * (D // 64)),
               ("v_codes", jnp.uint8, D // 2), ("v_scales", jnp.float32, 2 * (D // 64))),
    "fused": (("kv_row", jnp.uint8, D + D // 2 + 4 * 4 * (D // 64)),),
}


def probe_step(args, rows_out, interpret):
    rng = np.random.default_rng(1)
    layers, tokens = (2, 4096) if args.smoke else (args.layers, args.context)
    E = tokens // BLK
    sels = [selection(rng, tokens, tokens // 10, 32) for _ in range(layers)]
    for form, arrays in FORMS.items():
        made = [[host_array((E, N_KV, BLK, c), dt, seed=100 * l + i) for i, (_, dt, c) in enumerate(arrays)]
                for l in range(layers)]
        pool = [[x for x, _ in m] for m in made]
        row_bytes = sum(c * jnp.dtype(dt).itemsize for _, dt, c in arrays)

        @jax.jit
        def step(pool, sels):
            return [[ga.gather_rows_kernel(x, b, o, interpret=interpret) for x in xs] for xs, (b, o) in zip(pool, sels)]

        got = step(pool, sels)
        ok = all(check_rows(made[l][i][1], *sels[l], got[l][i]) for l in (0, layers - 1) for i in range(len(arrays)))
        t = median_time(lambda: step(pool, sels), reps=7, warmup=2)
        nbytes = sum(int(b.size) for b, _ in sels) * row_bytes
        pool_bytes = sum(int(x.nbytes) for xs in pool for x in xs)
        rows_out.append(dict(probe="step", form=form, arrays_per_layer=len(arrays), row_bytes=row_bytes,
                             layers=layers, context=tokens, pool_bytes=pool_bytes, us=t * 1e6,
                             GBps=nbytes / t / 1e9, bytes_per_step=nbytes, exact=ok))
        print(f"step {form:6s} {len(arrays)} arrays, {row_bytes} B a K+V row, pool {pool_bytes / GIB:6.2f} GiB: "
              f"{t * 1e6:9.1f} us ({nbytes / 2**20:.1f} MiB, {nbytes / t / 1e9:6.1f} GB/s) rows ok {ok}", flush=True)
        del pool, made, got


def quantized_host(tile, E: int, bits: int):
    """A pinned_host QuantizedInt extent of E blocks repeating `tile` [T, n_kv, blk, d] (per-token groups of 64)."""
    q = (ops.quantize_int8 if bits == 8 else ops.quantize_int4)(tile, 64)
    rep = lambda a: jnp.tile(a, (-(-E // a.shape[0]),) + (1,) * (a.ndim - 1))[:E]  # noqa: E731
    return jax.device_put(jax.tree.map(rep, q), pool_place())


def probe_refill(args, rows_out, interpret):
    """A step's refills as clo makes them (every head missing: 10% of the context per head, in runs of 32) through
    `ops.refill_block_rows`: bf16 extents (the native kernel), int8 K + int4 V extents through the dequantizing
    kernel and through the gathers + dequantize + where it replaces. The kernel's buffers are checked against
    the other path's."""
    rng = np.random.default_rng(2)
    layers, tokens = (2, 4096) if args.smoke else (args.layers, args.context)
    E, K = tokens // BLK, tokens // 10 // 32 * 32  # whole runs of 32
    toks = [jnp.asarray(np.asarray(b) * BLK + np.asarray(o), jnp.int32)
            for b, o in (selection(rng, tokens, K, 32) for _ in range(layers))]
    tile = jax.random.normal(jax.random.PRNGKey(3), (min(E, 64), N_KV, BLK, D), jnp.float32)
    bufs = lambda: (jnp.zeros((1, N_KV, K, D), jnp.bfloat16),) * 2  # noqa: E731
    outs, pool = {}, None
    for form, impl in (("bf16", "auto"), ("int8 K + int4 V, kernel", "kernel"),
                       ("int8 K + int4 V, gathers + where", "reference")):
        if form == "bf16":
            pool = [(host_array((E, N_KV, BLK, D), jnp.bfloat16, 10 * l)[0],
                     host_array((E, N_KV, BLK, D), jnp.bfloat16, 10 * l + 1)[0]) for l in range(layers)]
            row_bytes = 4 * D
        elif row_bytes == 4 * D:  # the int pool, made once for both int paths
            del pool
            pool = [(quantized_host(tile, E, 8), quantized_host(tile, E, 4)) for _ in range(layers)]
            row_bytes = D + D // 2 + 4 * 4 * (D // 64)

        @jax.jit
        def step(kb, vb, pool, toks):  # layer after layer, each refilling the buffers of the one before
            for (kx, vx), t in zip(pool, toks):
                kb = ops.refill_block_rows(kb, [kx], t, BLK, impl=impl, interpret=interpret)
                vb = ops.refill_block_rows(vb, [vx], t, BLK, impl=impl, interpret=interpret)
            return kb, vb

        outs[form] = step(*bufs(), pool, toks)
        t = median_time(lambda: step(*bufs(), pool, toks), reps=7, warmup=2)
        nbytes = layers * N_KV * K * row_bytes
        rows_out.append(dict(probe="refill", form=form, row_bytes=row_bytes, layers=layers, context=tokens,
                             pool_bytes=sum(int(a.nbytes) for a in jax.tree.leaves(pool)), us=t * 1e6,
                             GBps=nbytes / t / 1e9, bytes_per_step=nbytes, exact=None))  # int: set below
        print(f"refill {form:32s}: {t * 1e6:9.1f} us ({nbytes / 2**20:.1f} MiB, {nbytes / t / 1e9:6.1f} GB/s)",
              flush=True)
    del pool
    a, b = outs["int8 K + int4 V, kernel"], outs["int8 K + int4 V, gathers + where"]
    same = all(bool(jnp.allclose(x.astype(jnp.float32), y.astype(jnp.float32), rtol=2**-7, atol=1e-6))
               for x, y in zip(a, b))
    for r in rows_out[-2:]:
        r["exact"] = same
    print(f"refill: the kernel's buffers equal the gathers' (within a bf16 rounding): {same}", flush=True)


def layer_chunks(exts, max_bytes: int):
    """Consecutive runs of the layers' extents whose 1-byte arrays stay within max_bytes together (at least one
    layer a run)."""
    runs, size = [[]], 0
    for x in exts:
        nbytes = max(a.nbytes for a in jax.tree.leaves(x) if a.dtype.itemsize == 1)
        if runs[-1] and size + nbytes > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(x)
        size += nbytes
    return runs


def probe_layout(args, rows_out, interpret):
    """A step's int8 K / int4 V refills into one [1, n_kv, L K, d] buffer a kind at layer l's row offset, the host
    rows read from each layer's extents, from one stacked extent a kind at token offsets, or from chunks of it."""
    from kvoffload.runtime.state import stacked_extent

    rng = np.random.default_rng(4)
    layers, tokens = (3, 2048) if args.smoke else (args.layers, args.context)
    chunk_bytes = 2**20 if args.smoke else args.chunk_bytes
    E, K = tokens // BLK, tokens // 10 // 32 * 32
    toks = [jnp.asarray(np.asarray(b) * BLK + np.asarray(o), jnp.int32)
            for b, o in (selection(rng, tokens, K, 32) for _ in range(layers))]
    tile = jax.random.normal(jax.random.PRNGKey(5), (min(E, 64), N_KV, BLK, D), jnp.float32)
    per_layer = {8: [quantized_host(tile * (1 + l / 8), E, 8) for l in range(layers)],
                 4: [quantized_host(tile * (1 - l / 64), E, 4) for l in range(layers)]}
    layouts = {"per-layer extents": {b: [(x,) for x in xs] for b, xs in per_layer.items()},
               "one stacked extent": {b: (stacked_extent(xs),) for b, xs in per_layer.items()},
               "chunks": {b: tuple(stacked_extent(c) for c in layer_chunks(xs, chunk_bytes))
                          for b, xs in per_layer.items()}}

    def step_of(stacked: bool):
        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(buf, exts, toks):
            for l, t in enumerate(toks):
                src = exts if stacked else exts[l]
                buf = ops.refill_block_rows(buf, src, t + l * E * BLK if stacked else t, BLK, impl="kernel",
                                            interpret=interpret, row_offset=jnp.int32(l * K))
            return buf
        return step

    want = {}
    for name, pools in layouts.items():
        step = step_of(name != "per-layer extents")
        for bits, kind in ((8, "K int8"), (4, "V int4")):
            exts = pools[bits]
            fresh = lambda: jnp.zeros((1, N_KV, layers * K, D), jnp.bfloat16)  # noqa: E731
            got = step(fresh(), exts, toks)
            want.setdefault(bits, got)
            same = bool(jnp.array_equal(got, want[bits]))
            t = median_time(lambda: step(fresh(), exts, toks), reps=7, warmup=2)
            n_ext = len(exts)  # per-layer: one tuple a layer
            row_bytes = D // (8 // bits) + 2 * 4 * (D // 64)
            nbytes = layers * N_KV * K * row_bytes
            pool_bytes = sum(int(a.nbytes) for a in jax.tree.leaves(exts))
            rows_out.append(dict(probe="layout", form=f"{kind}, {name}", extents=n_ext, row_bytes=row_bytes,
                                 layers=layers, context=tokens, pool_bytes=pool_bytes, us=t * 1e6,
                                 us_per_layer=t * 1e6 / layers, GBps=nbytes / t / 1e9, exact=same))
            print(f"layout {kind} {name:20s} ({n_ext} extents, {pool_bytes / GIB:.2f} GiB): {t * 1e6:9.1f} us "
                  f"({t * 1e6 / layers:.1f} us a layer, {nbytes / t / 1e9:6.1f} GB/s) rows as per-layer: {same}",
                  flush=True)
    del layouts, per_layer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="one,step,refill,layout", help="comma list of: one, step, refill, layout")
    ap.add_argument("--chunk-bytes", type=int, default=2**31, help="layout: a chunk's 1-byte arrays at most")
    ap.add_argument("--layers", type=int, default=31, help="step: layers gathered per step (clo: 31 of 32)")
    ap.add_argument("--context", type=int, default=131072, help="step: tokens per layer")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    out = args.out or os.environ.get("OUT") or "results"
    os.makedirs(out, exist_ok=True)
    rows, t0 = [], time.time()
    dev = jax.devices()[0]
    mode = " (interpret)" if interpret else ""
    print(f"[probe_row_gather] {dev.device_kind} jax {jax.__version__}{mode}", flush=True)
    for name in args.only.split(","):
        {"one": probe_one, "step": probe_step, "refill": probe_refill, "layout": probe_layout}[name](args, rows,
                                                                                                  interpret)
    meta = dict(device=dev.device_kind, jax=jax.__version__, interpret=interpret, seconds=time.time() - t0,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    with open(os.path.join(out, "probe_row_gather.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    lines = [f"{meta['device']}, JAX {meta['jax']}, {meta['date']}", "",
             "| probe | form / dtype | row B | pool MiB | run | us | GB/s | rows ok |",
             "|---|---|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        ok = "-" if r["exact"] is None else r["exact"]
        lines.append(f"| {r['probe']} | {r.get('form', r.get('dtype'))} | {r['row_bytes']} | "
                     f"{r['pool_bytes'] / 2**20:.1f} | {r.get('run', 32)} | {r['us']:.1f} | {r['GBps']:.1f} | {ok} |")
    with open(os.path.join(out, "probe_row_gather.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["exact"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
