#!/usr/bin/env python3
"""Benchmark the kvoffload Pallas kernels against their XLA references (GPU).

    PYTHONPATH=src python3 benchmarks/bench_kernels.py [--quick] [--out DIR]

Measures the card's ceilings first (HBM bandwidth from a large device copy counting bytes
read + written; bf16 matmul rate from an 8192^3 product; pinned_host -> GPU bandwidth
from a 1 GiB device_put), then per kernel: time (median of repeated back-to-back calls),
bytes it must move, flops, the roofline time max(bytes/BW, flops/rate), the fraction of
roofline reached, and the XLA reference's time in the same run. Writes bench_kernels.json
and bench_kernels.md to --out (default $OUT or .).

Targets: decode attention (Llama-3-8B layer: 32 q heads, 8 kv heads, d 128, bf16)
at 32K-128K, batch 1-8: >= 70% of HBM roofline and >= 1.5x faster than XLA; sparse
attention over 10% of 128K read from pinned_host: >= 80% of host->GPU bandwidth;
the row gather (gather) of 10% of 128K rows per KV head from a pinned_host extent likewise;
recompute_kv at >= 70% of matmul rate for batch*tokens >= 8192.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np
import jax
import jax.numpy as jnp

from kvoffload.pallas import decode_attention as _da
from kvoffload.pallas import gather as _ga
from kvoffload.pallas import paged_attention as _pa
from kvoffload.pallas import prefill_attention as _pf
from kvoffload.pallas import quant as _q
from kvoffload.pallas import recompute as _rc
from kvoffload.pallas import scores as _sc
from kvoffload.pallas import sparse_attention as _sa
from kvoffload.pallas import topk as _tk

RESULTS = []
TINY = os.environ.get("KVO_BENCH_TINY") == "1"  # CPU smoke test: tiny sizes, interpret
NO_SWEEP = False


def timeit(f, *args, iters=None, warmup=3, reps=5, min_rep_s=0.02):
    """Median over reps of (time for `iters` back-to-back calls) / iters, in seconds.
    iters is chosen so that one rep lasts >= min_rep_s (unless given)."""
    out = None
    for _ in range(warmup):
        out = f(*args)
    jax.block_until_ready(out)
    if iters is None:
        t0 = time.perf_counter()
        out = f(*args)
        jax.block_until_ready(out)
        one = max(time.perf_counter() - t0, 1e-6)
        iters = int(min(200, max(3, min_rep_s / one)))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def relerr(a, b):
    """Relative L2 error between two outputs (pytrees: first leaf), vs b."""
    a = jax.tree_util.tree_leaves(a)[0].astype(jnp.float32)
    b = jax.tree_util.tree_leaves(b)[0].astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def ceilings():
    MM = 256 if TINY else 8192
    key = jax.random.PRNGKey(0)
    n = 1 << (20 if TINY else 29)  # 512M bf16 = 1 GiB
    x = rand(key, (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    t = timeit(copy, x)
    hbm = 2 * x.nbytes / t
    del x
    a = rand(key, (MM, MM), jnp.bfloat16)
    b = rand(jax.random.PRNGKey(1), (MM, MM), jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    t = timeit(mm, a, b)
    mm_rate = 2 * MM ** 3 / t
    del a, b
    h2d = float("nan")
    try:
        dev = jax.devices()[0]
        hs = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        ds = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        xh = jax.device_put(rand(key, (1 << (20 if TINY else 29),), jnp.bfloat16), hs)
        jax.block_until_ready(xh)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            y = jax.device_put(xh, ds)
            jax.block_until_ready(y)
            ts.append(time.perf_counter() - t0)
            del y
        h2d = xh.nbytes / statistics.median(ts)
        del xh
    except Exception as e:  # noqa: BLE001
        print("h2d measurement failed:", e)
    tiny = jnp.ones((8,), jnp.float32)
    floor = timeit(jax.jit(lambda a: a + 1), tiny)
    print(f"dispatch floor (back-to-back trivial jit calls): {floor*1e6:.1f} us", flush=True)
    c = dict(hbm_GBps=hbm / 1e9, matmul_TFLOPs=mm_rate / 1e12, h2d_GBps=h2d / 1e9,
             dispatch_floor_us=floor * 1e6)
    print("ceilings:", {k: round(v, 2) for k, v in c.items()}, flush=True)
    return c


def record(kernel, config, t_kernel, t_xla, bytes_, flops, ceil, target=None, extra=None,
           bound="hbm"):
    bw = ceil["h2d_GBps"] if bound == "h2d" else ceil["hbm_GBps"]
    t_bytes = bytes_ / (bw * 1e9)
    t_flops = flops / (ceil["matmul_TFLOPs"] * 1e12)
    roof = max(t_bytes, t_flops)
    if t_flops > t_bytes:
        bound = "matmul"
    r = dict(kernel=kernel, config=config, us=t_kernel * 1e6,
             xla_us=None if t_xla is None else t_xla * 1e6,
             speedup_vs_xla=None if t_xla is None else t_xla / t_kernel,
             MB=bytes_ / 1e6, GFLOP=flops / 1e9, roofline_us=roof * 1e6,
             frac_roofline=roof / t_kernel,
             achieved_GBps=bytes_ / t_kernel / 1e9,
             achieved_TFLOPs=flops / t_kernel / 1e12, bound=bound, target=target)
    if extra:
        r.update(extra)
    RESULTS.append(r)
    sp = "" if t_xla is None else f" xla {t_xla*1e6:8.1f}us x{t_xla/t_kernel:4.2f}"
    print(f"{kernel:18s} {config:44s} {t_kernel*1e6:9.1f}us roof {roof*1e6:8.1f}us "
          f"({100*roof/t_kernel:5.1f}%){sp} {extra or ''}", flush=True)
    return r


def _naive_xla_decode(q, k, v, L):
    B, H, d = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    G = H // n_kv
    qg = q.reshape(B, n_kv, G, d).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(jnp.float32)) * d ** -0.5
    s = jnp.where(jnp.arange(S)[None, None, None] < L[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, v.astype(jnp.float32))
    return o.reshape(B, H, d).astype(q.dtype), jax.nn.logsumexp(s, axis=-1).reshape(B, H)


def bench_decode(ceil, quick):
    n_heads, n_kv, d = 32, 8, 128
    Ss = [32768, 131072] if not quick else [131072]
    if TINY:
        Ss = [1024]
    Bs = [1, 8] if not quick else [1]
    if TINY:
        Bs = [1]
    key = jax.random.PRNGKey(2)
    for S in Ss:
        for B in Bs:
            kq, kk, kv = jax.random.split(key, 3)
            q = rand(kq, (B, n_heads, d), jnp.bfloat16)
            k = rand(kk, (B, n_kv, S, d), jnp.bfloat16)
            v = rand(kv, (B, n_kv, S, d), jnp.bfloat16)
            L = jnp.full((B,), S, jnp.int32)
            ker = jax.jit(lambda q, k, v, L: _da.decode_attention_kernel(q, k, v, L))
            ref = jax.jit(lambda q, k, v, L: _da.decode_attention_reference(q, k, v, L))
            t_k = timeit(ker, q, k, v, L)
            t_r = timeit(ref, q, k, v, L)
            t_k2 = timeit(ker, q, k, v, L)  # same version again: the run-to-run spread
            t_r2 = timeit(ref, q, k, v, L)
            print(f"  repeat: kernel {t_k*1e6:.1f} / {t_k2*1e6:.1f} us, xla {t_r*1e6:.1f} / "
                  f"{t_r2*1e6:.1f} us", flush=True)
            t_k, t_r = min(t_k, t_k2), min(t_r, t_r2)
            bytes_ = k.nbytes + v.nbytes + q.nbytes * 2
            flops = 4 * B * n_heads * S * d
            record("decode_attention", f"B{B} S{S} h32/kv8 d128 bf16", t_k, t_r, bytes_, flops,
                   ceil, target=">=70% roofline, >=1.5x XLA",
                   extra=dict(rel_err_vs_xla=relerr(ker(q, k, v, L), ref(q, k, v, L))))
            # the same attention written naively in XLA (K/V upcast to fp32), for context
            naive = jax.jit(lambda q, k, v, L: _naive_xla_decode(q, k, v, L))
            t_n = timeit(naive, q, k, v, L)
            record("decode_attention", f"B{B} S{S} vs naive XLA (fp32 upcast)", t_k, t_n,
                   bytes_, flops, ceil)
            # in-graph timing: n calls on n different K/V sets inside ONE jit (no Python
            # dispatch between calls, no L2 reuse), as when attention runs inside a layer jit
            n = int(max(2, min(10, 8e9 // bytes_)))
            ks = [k] + [rand(jax.random.PRNGKey(100 + i), k.shape, k.dtype) for i in range(n - 1)]
            vs = [v] + [rand(jax.random.PRNGKey(200 + i), v.shape, v.dtype) for i in range(n - 1)]

            def graph(fn):
                return jax.jit(lambda q, ks, vs, L: [fn(q, a, b, L) for a, b in zip(ks, vs)])

            t_kg = timeit(graph(_da.decode_attention_kernel), q, ks, vs, L) / n
            t_rg = timeit(graph(_da.decode_attention_reference), q, ks, vs, L) / n
            t_ng = timeit(graph(_naive_xla_decode), q, ks, vs, L) / n
            record("decode_attention", f"B{B} S{S} in-graph (x{n} in one jit)", t_kg, t_rg,
                   bytes_, flops, ceil, target=">=70% roofline, >=1.5x XLA",
                   extra=dict(naive_xla_in_graph_us=t_ng * 1e6))
            del ks, vs
            if NO_SWEEP:
                del q, k, v
                continue
            # sweep of launch parameters (reported; the best one informs the defaults)
            if TINY:
                grid = [(64, 2, 4, 2, "pallas"), (64, 2, 4, 2, "xla")]
            elif B == 1:
                grid = [(128, 2, 4, 2, "pallas"), (128, 2, 4, 3, "pallas"),
                        (64, 2, 4, 3, "pallas"), (64, 2, 4, 4, "pallas"),
                        (64, 3, 4, 3, "pallas"), (128, 1, 8, 3, "pallas"),
                        (128, 2, 4, 2, "xla"), (64, 4, 4, 4, "pallas")]
            else:
                grid = [(128, 2, 4, 2, "pallas"), (64, 2, 4, 3, "pallas"),
                        (128, 2, 4, 2, "xla")]
            best = None
            for bs, pps, nw, st, mg in grid:
                try:
                    f = jax.jit(lambda q, k, v, L, bs=bs, pps=pps, nw=nw, st=st, mg=mg:
                                _da.decode_attention_kernel(q, k, v, L, block_s=bs,
                                                            programs_per_sm=pps, num_warps=nw,
                                                            num_stages=st, merge=mg))
                    t = timeit(f, q, k, v, L)
                except Exception as e:  # noqa: BLE001
                    print("  sweep fail", bs, pps, nw, mg, str(e)[:100])
                    continue
                print(f"  decode B{B} S{S} bs{bs} pps{pps} w{nw} st{st} merge-{mg}: "
                      f"{t*1e6:.1f}us", flush=True)
                if best is None or t < best[0]:
                    best = (t, bs, pps, nw, st, mg)
            if best:
                t, bs, pps, nw, st, mg = best
                record("decode_attention", f"B{B} S{S} best of sweep", t, t_r, bytes_, flops,
                       ceil, target=">=70% roofline, >=1.5x XLA",
                       extra=dict(block_s=bs, programs_per_sm=pps, num_warps=nw, num_stages=st,
                                  merge=mg))
            del q, k, v


def bench_paged(ceil, quick):
    """Paged decode attention, Llama-3-8B layer (h32/kv8 d128 bf16), B=32 rows of 16 blocks of
    64 tokens each in one extent of 512 blocks (rows own random, scattered blocks), against the
    dense decode kernel over the same tokens laid out [B, n_kv, 1024, d], and the paged
    reference (XLA gather + dense reference)."""
    n_heads, n_kv, d = 32, 8, 128
    B, blk, per_row, E = (2, 16, 4, 8) if TINY else (32, 64, 16, 512)
    rng = np.random.default_rng(20)
    q = rand(jax.random.PRNGKey(21), (B, n_heads, d), jnp.bfloat16)
    kb = rand(jax.random.PRNGKey(22), (E, n_kv, blk, d), jnp.bfloat16)
    vb = rand(jax.random.PRNGKey(23), (E, n_kv, blk, d), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(E)[:B * per_row].reshape(B, per_row), jnp.int32)
    nb = jnp.full((B,), per_row, jnp.int32)
    S = per_row * blk
    dense = jax.jit(lambda b: b[table].transpose(0, 2, 1, 3, 4).reshape(B, n_kv, S, d))
    kd, vd = dense(kb), dense(vb)
    L = jnp.full((B,), S, jnp.int32)
    make = lambda **kw: jax.jit(lambda q, k, v, t, n: _pa.paged_decode_attention_kernel(
        q, k, v, t, n, **kw))
    f = make()
    r = jax.jit(lambda q, k, v, t, n: _pa.paged_decode_attention_reference(q, k, v, t, n))
    dk = jax.jit(lambda q, k, v, L: _da.decode_attention_kernel(q, k, v, L))
    args = (q, kb, vb, table, nb)
    t_p, t_r, t_d = timeit(f, *args), timeit(r, *args), timeit(dk, q, kd, vd, L)
    bytes_ = kd.nbytes + vd.nbytes + q.nbytes * 2 + table.nbytes
    flops = 4 * B * n_heads * S * d
    cfg = f"B{B} {per_row}x{blk} tokens/row, extent E{E}, h32/kv8 d128 bf16"
    t_b, best = _sweep("paged", make, args, [dict(num_splits=1), dict(num_splits=4),
                                             dict(num_warps=8), dict(num_stages=3)], t_p)
    record("paged_decode", cfg + " vs paged ref", t_p, t_r, bytes_, flops, ceil,
           extra=dict(rel_err_vs_xla=relerr(f(*args), r(*args)),
                      rel_err_vs_dense=relerr(f(*args), dk(q, kd, vd, L)),
                      dense_kernel_us=t_d * 1e6, paged_over_dense=t_p / t_d,
                      best_us=t_b * 1e6, best_params=best))
    record("decode_attention", f"B{B} S{S} dense, same tokens as paged", t_d, None, bytes_,
           flops, ceil)


def bench_int4(ceil, quick):
    n_heads, n_kv, d, S, B = 32, 8, 128, (1024 if TINY else 131072), 1
    key = jax.random.PRNGKey(3)
    q = rand(key, (B, n_heads, d), jnp.bfloat16)
    k = rand(jax.random.PRNGKey(4), (B, n_kv, S, d), jnp.bfloat16)
    kq = jax.jit(_q.quantize_int4)(k)
    vq = jax.jit(_q.quantize_int4)(k * 0.5)
    del k
    L = jnp.full((B,), S, jnp.int32)
    ker = jax.jit(lambda q, a, b, L: _q.decode_attention_int4_kernel(q, a, b, L))
    ref = jax.jit(lambda q, a, b, L: _q.decode_attention_int4_reference(q, a, b, L))
    t_k = timeit(ker, q, kq, vq, L)
    t_r = timeit(ref, q, kq, vq, L)
    bytes_ = sum(x.nbytes for x in jax.tree_util.tree_leaves((kq, vq)))
    record("decode_int4", f"B{B} S{S} h32/kv8 d128 g64", t_k, t_r, bytes_,
           4 * B * n_heads * S * d, ceil,
           extra=dict(rel_err_vs_xla=relerr(ker(q, kq, vq, L), ref(q, kq, vq, L))))


def bench_sparse(ceil, quick):
    n_heads, n_kv, d, S, B = 32, 8, 128, (1024 if TINY else 131072), 1
    dev = jax.devices()[0]
    hs = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    key = jax.random.PRNGKey(5)
    q = rand(key, (B, n_heads, d), jnp.bfloat16)
    k = rand(jax.random.PRNGKey(6), (B, n_kv, S, d), jnp.bfloat16)
    v = rand(jax.random.PRNGKey(7), (B, n_kv, S, d), jnp.bfloat16)
    kh, vh = jax.device_put(k, hs), jax.device_put(v, hs)
    jax.block_until_ready((kh, vh))
    rng = np.random.default_rng(0)
    for page in (1, 16):
        n_ent = S // page
        K = n_ent // 10
        idx = jnp.asarray(np.sort(np.stack([np.stack([rng.permutation(n_ent)[:K]
                                                      for _ in range(n_kv)])
                                            for _ in range(B)]), -1), jnp.int32)
        f = jax.jit(lambda q, k, v, i, page=page:
                    _sa.sparse_attention_kernel(q, k, v, i, page_size=page))
        r = jax.jit(lambda q, k, v, i, page=page:
                    _sa.sparse_attention_reference(q, k, v, i, page_size=page))
        bytes_ = 2 * B * n_kv * K * page * d * 2
        flops = 4 * B * n_heads * K * page * d
        t_dev = timeit(f, q, k, v, idx)
        t_ref = timeit(r, q, k, v, idx)
        record("sparse_attention", f"device K/V 10% of 128K page{page}", t_dev, t_ref, bytes_,
               flops, ceil, extra=dict(rel_err_vs_xla=relerr(f(q, k, v, idx), r(q, k, v, idx))))
        try:
            t_host = timeit(f, q, kh, vh, idx, warmup=2)
            err = float(jnp.max(jnp.abs(f(q, kh, vh, idx)[0].astype(jnp.float32)
                                        - f(q, k, v, idx)[0].astype(jnp.float32))))
            # fallback: copy whole K/V to the device then gather (what the op does when
            # zero-copy is refused)
            def fallback(q, kh, vh, i):
                kd = jax.device_put(kh, jax.sharding.SingleDeviceSharding(dev, memory_kind="device"))
                vd = jax.device_put(vh, jax.sharding.SingleDeviceSharding(dev, memory_kind="device"))
                return r(q, kd, vd, i)
            t_fb = timeit(fallback, q, kh, vh, idx, iters=2, warmup=1, reps=3)
            record("sparse_attention", f"pinned_host zero-copy 10% of 128K page{page}", t_host,
                   None, bytes_, flops, ceil, target=">=80% of h2d bandwidth", bound="h2d",
                   extra=dict(max_abs_diff_vs_device=err, fallback_full_copy_us=t_fb * 1e6,
                              rel_err_vs_xla=relerr(f(q, kh, vh, idx), r(q, k, v, idx))))
        except Exception as e:  # noqa: BLE001
            print("zero-copy path failed:", type(e).__name__, str(e)[:500], flush=True)
            RESULTS.append(dict(kernel="sparse_attention", config=f"pinned_host page{page}",
                                error=f"{type(e).__name__}: {e}"[:1000]))


def bench_gather(ceil, quick):
    """Row gather (tokenselect kv=split's V rows, clo's K/V rows) of 10% of a 128K context per KV
    head, Llama-3-8B layer (8 KV heads, d 128, bf16), from one extent [E, 8, 64, 128] of the
    pool in pinned_host memory: the zero-copy kernel against the host->GPU rate, the same
    kernel on a device extent, and the fallback (XLA's gather where the extent lives: host
    compute on a GPU). Selections: scattered sorted rows, and runs of 16 tokens."""
    n_kv, d, blk, S = 8, 128, 64, (1024 if TINY else 131072)
    E = S // blk
    dev = jax.devices()[0]
    hs = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    x = rand(jax.random.PRNGKey(21), (E, n_kv, blk, d), jnp.bfloat16)
    xh = jax.device_put(x, hs)
    jax.block_until_ready(xh)
    rng = np.random.default_rng(0)
    for B, run in ((1, 1), (1, 16)) if quick else ((1, 1), (1, 16), (4, 1)):
        K = S // 10 // run * run
        starts = [np.sort(rng.permutation(S // run)[:K // run]) * run for _ in range(B * n_kv)]
        tok = np.stack([(st[:, None] + np.arange(run)).reshape(-1) for st in starts]).reshape(B, n_kv, K)
        block = jnp.asarray(tok // blk, jnp.int32)
        off = jnp.asarray(tok % blk, jnp.int32)
        args = (block, off)
        make = lambda **kw: jax.jit(lambda x, b, o: _ga.gather_rows_kernel(x, b, o, **kw))  # noqa: E731
        f = make()
        ref = jax.jit(_ga.gather_rows_reference)
        bytes_ = B * n_kv * K * d * 2  # the rows read (and written once to the device)
        tag = f"B{B} 10% of 128K rows{'' if run == 1 else f' in runs of {run}'} kv8 d128 bf16"
        t_dev, t_ref = timeit(f, x, *args), timeit(ref, x, *args)
        record("gather_rows", f"device extent {tag}", t_dev, t_ref, bytes_, 0, ceil,
               extra=dict(exact=bool(jnp.array_equal(f(x, *args), ref(x, *args)))))
        try:
            t_host = timeit(f, xh, *args, warmup=2)
            exact = bool(jnp.array_equal(f(xh, *args), ref(x, *args)))
            t_b, best = _sweep("gather pinned_host", make, (xh, *args),
                               [dict(block_k=k, num_warps=w) for k in (16, 32, 64)
                                for w in (2, 4, 8)], t_host)
            fb = jax.jit(_ga.gather_rows_reference_host)
            t_fb = timeit(fb, xh, *args, iters=2, warmup=1, reps=3)
            full = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device))  # whole extent
            t_full = timeit(lambda x: ref(full(x), *args), xh, iters=2, warmup=1, reps=3)
            record("gather_rows", f"pinned_host zero-copy {tag}", t_host, None, bytes_, 0, ceil,
                   target=">=80% of h2d bandwidth", bound="h2d",
                   extra=dict(exact=exact, best_us=t_b * 1e6, best_params=best,
                              best_GBps=bytes_ / t_b / 1e9, h2d_GBps=ceil["h2d_GBps"],
                              fallback_host_gather_us=t_fb * 1e6,
                              whole_extent_copy_then_gather_us=t_full * 1e6))
        except Exception as e:  # noqa: BLE001
            print("zero-copy gather failed:", type(e).__name__, str(e)[:500], flush=True)
            RESULTS.append(dict(kernel="gather_rows", config=f"pinned_host {tag}",
                                error=f"{type(e).__name__}: {e}"[:1000]))


def bench_recompute(ceil, quick):
    H, n_kv, d = (256 if TINY else 4096), 8, 128
    for B, T in ([(1, 64)] if TINY else [(1, 8192), (4, 4096)] if not quick else [(1, 8192)]):
        key = jax.random.PRNGKey(8)
        x = rand(key, (B, T, H), jnp.bfloat16)
        wk = rand(jax.random.PRNGKey(9), (H, n_kv * d), jnp.bfloat16) * 0.02
        wv = rand(jax.random.PRNGKey(10), (H, n_kv * d), jnp.bfloat16) * 0.02
        ang = jax.random.uniform(key, (B, T, d // 2))
        cos, sin = jnp.cos(ang).astype(jnp.bfloat16), jnp.sin(ang).astype(jnp.bfloat16)
        flops = 2 * B * T * H * 2 * n_kv * d
        bytes_ = x.nbytes + wk.nbytes * 2 + 2 * B * T * n_kv * d * 2 + cos.nbytes * 2
        ref = jax.jit(lambda *a: _rc.recompute_kv_reference(*a, n_kv=n_kv))
        t_r = timeit(ref, x, wk, None, wv, None, cos, sin)
        best = None
        for bt, nw, st in (((64, 4, 3),) if TINY else ((64, 4, 3), (128, 8, 3), (128, 4, 3), (128, 8, 4), (64, 8, 4))):
            try:
                f = jax.jit(lambda *a, bt=bt, nw=nw, st=st: _rc.recompute_kv_kernel(
                    *a, n_kv=n_kv, block_t=bt, num_warps=nw, num_stages=st))
                t = timeit(f, x, wk, None, wv, None, cos, sin)
            except Exception as e:  # noqa: BLE001
                print("  recompute variant failed", bt, nw, st, str(e)[:200], flush=True)
                continue
            print(f"  recompute B{B} T{T} bt{bt} w{nw} s{st}: {t*1e6:.1f}us", flush=True)
            if best is None or t < best[0]:
                best = (t, bt, nw, st)
        if best:
            fb = jax.jit(lambda *a, bt=best[1], nw=best[2], st=best[3]: _rc.recompute_kv_kernel(
                *a, n_kv=n_kv, block_t=bt, num_warps=nw, num_stages=st))
            e = relerr(fb(x, wk, None, wv, None, cos, sin), ref(x, wk, None, wv, None, cos, sin))
            record("recompute_kv", f"B{B} T{T} H{H} kv8 d128 bf16 rope", best[0], t_r, bytes_,
                   flops, ceil, target=">=70% matmul rate",
                   extra=dict(block_t=best[1], num_warps=best[2], num_stages=best[3],
                              rel_err_vs_xla=e))


def bench_scores(ceil, quick):
    n_heads, n_kv, d, S, B = 32, 8, 128, (1024 if TINY else 131072), 1
    q = rand(jax.random.PRNGKey(11), (B, n_heads, d), jnp.bfloat16)
    k = rand(jax.random.PRNGKey(12), (B, n_kv, S, d), jnp.bfloat16)
    L = jnp.full((B,), S, jnp.int32)
    f = jax.jit(lambda q, k, L: _sc.topk_scores_exact_kernel(q, k, L))
    r = jax.jit(lambda q, k, L: _sc.topk_scores_exact_reference(q, k, L))
    t_k = timeit(f, q, k, L)
    t_r = timeit(r, q, k, L)
    record("topk_scores_exact", f"B{B} S{S} h32/kv8 d128 bf16", t_k, t_r,
           k.nbytes + B * n_kv * S * 4, 2 * B * n_heads * S * d, ceil,
           extra=dict(rel_err_vs_xla=relerr(f(q, k, L), r(q, k, L))))
    sel = jax.jit(lambda s: _tk.select_topk(s, S // 10, lengths=L, num_sink=4, num_recent=64))
    sc = f(q, k, L)
    t_s = timeit(sel, sc)
    record("select_topk", f"B{B} S{S} k=10%", t_s, None, sc.nbytes, 0, ceil)
    # `clo`'s layout: one extent of the pool = E blocks of 64 tokens as a batch of E, a per-head length (0: the
    # head reuses its selection, its keys not read). One head of 8 scored (a hit rate of ~0.86) and all 8.
    blk, E = 64, S // 64 // 4  # a quarter of the context: 4 extents per layer at 128K
    qe = jnp.broadcast_to(q, (E, n_heads, d))
    ke = rand(jax.random.PRNGKey(13), (E, n_kv, blk, d), jnp.bfloat16)
    for pattern, heads in (("1 of 8 heads", 1), ("8 heads", n_kv)):
        Le = jnp.broadcast_to(jnp.where(jnp.arange(n_kv) < heads, blk, 0).astype(jnp.int32), (E, n_kv))
        mk = lambda **kw: jax.jit(lambda q, k, L: _sc.topk_scores_exact_kernel(q, k, L, group_reduce="max", **kw))
        kern, r = mk(), jax.jit(lambda q, k, L: _sc.topk_scores_exact_reference(q, k, L, group_reduce="max"))
        got = kern(qe, ke, Le)  # launch sweeps, timed inside a jit: experiments/sweep_selection_kernels.py
        record("topk_scores_exact", f"E{E} x blk{blk} (one extent) {pattern} h32/kv8 d128 bf16", timeit(kern, qe, ke, Le),
               timeit(r, qe, ke, Le), heads * E * blk * d * 2 + E * n_kv * blk * 4, 2 * E * 4 * heads * blk * d,
               ceil, extra=dict(equal_per_block=bool(np.array_equal(np.asarray(got),
                                                                    np.asarray(mk(items=None)(qe, ke, Le)))),
                                rel_err_vs_xla=relerr(got, r(qe, ke, Le))))


def bench_prefill(ceil, quick):
    """A chunked prefill's attention (a 1M-token prefill): one 8192-query chunk of a Llama-3-8B layer
    (32 query / 8 KV heads, d 128, bf16) at the end of a 128K (and 1M) prompt, so it attends the whole prefix:
    the Pallas flash kernel (with a launch sweep) against `models.common.prefill_attention_chunk` (XLA, 1024-key
    blocks whose fp32 scores go through memory). FLOPs: q.K and p.V over the causal keys."""
    from kvoffload.models.common import prefill_attention_chunk

    n_heads, n_kv, d, tc = 32, 8, 128, (64 if TINY else 8192)
    Ts = [1024] if TINY else ([131072] if quick else [131072, 1048576])
    for T in Ts:
        ks = jax.random.split(jax.random.PRNGKey(31), 3)
        q = rand(ks[0], (1, n_heads, tc, d), jnp.bfloat16)
        k = rand(ks[1], (1, n_kv, T, d), jnp.bfloat16)
        v = rand(ks[2], (1, n_kv, T, d), jnp.bfloat16)
        start, L = jnp.int32(T - tc), jnp.full((1,), T, jnp.int32)
        ref = jax.jit(prefill_attention_chunk)
        make = lambda **kw: jax.jit(lambda *a: _pf.prefill_attention_chunk_kernel(*a, interpret=TINY, **kw))
        ker = make()
        t_k = timeit(ker, q, k, v, start, L)
        t_r = timeit(ref, q, k, v, start, L)
        grid = [dict(block_q=bq, block_k=bk, num_warps=w) for bq in (64, 128) for bk in (32, 64, 128)
                for w in (4, 8)]
        t_best, best = _sweep("prefill", make, (q, k, v, start, L), [] if TINY else grid, t_k)
        flops = 4 * n_heads * tc * (T - tc / 2) * d
        bytes_ = q.nbytes * 2 + (k.nbytes + v.nbytes) * n_heads // n_kv  # each query head reads its KV head
        record("prefill_attention", f"Tc{tc} over T{T} h32/kv8 d128 bf16 {best or 'default'}", t_best, t_r,
               bytes_, flops, ceil, extra=dict(rel_err_vs_xla=relerr(make(**best)(q, k, v, start, L),
                                                                       ref(q, k, v, start, L)),
                                                  default_us=t_k * 1e6))
        if _pf.cudnn_supported(q.dtype, d):  # the "auto" path on a GPU: cuDNN's flash attention
            cud = jax.jit(_pf.prefill_attention_chunk_cudnn)
            record("prefill_attention", f"Tc{tc} over T{T} h32/kv8 d128 bf16 cudnn", timeit(cud, q, k, v, start, L),
                   t_r, bytes_, flops, ceil, extra=dict(rel_err_vs_xla=relerr(cud(q, k, v, start, L),
                                                                              ref(q, k, v, start, L))))


def bench_topk(ceil, quick):
    """The top-10% selection per KV head (Llama-3-8B: 8 rows) at 128K and 1M scores: ``top_count_ascending``'s
    radix select with its order-keeping compaction (4- and 2-bit digits) and the same select as Pallas kernels
    ("kernel": many programs per row, a row of count 0 skipped) against its "sort" method (``jax.lax.top_k``
    plus the ascending sort), in the same run (the "XLA" column). Two count patterns: every row selects, and
    one row of 8 (a `clo` step at a hit rate of ~0.86: the other heads reuse their selection, count 0). The
    roofline counts one read of the scores: the 32 / digit_bits count rounds reread them (from L2 at 128K)."""
    sizes = [1024] if TINY else ([131072] if quick else [131072, 1048576])
    for S in sizes:
        rows, k = 8, S // 10
        sc = jax.random.normal(jax.random.PRNGKey(21), (rows, S), jnp.float32)
        sc = sc.at[:, :4].set(jnp.inf).at[:, -64:].set(jnp.inf)  # forced sinks / recent, as selection has them
        t_sort = {}
        sort = jax.jit(lambda s, c: _tk.top_count_ascending(s, c, k, method="sort"))
        for pattern in ("all rows", "1 of 8 rows"):
            counts = jnp.full((rows,), k, jnp.int32)
            if pattern != "all rows":
                counts = counts * (jnp.arange(rows) == 3)
            t_sort[pattern] = timeit(sort, sc, counts)
            want = np.asarray(sort(sc, counts)[0])
            variants = [("radix", dict(digit_bits=4)), ("radix", dict(digit_bits=2)), ("kernel", {})]
            if not quick and pattern == "1 of 8 rows":
                variants = variants[:1] + variants[2:]
            for method, kw in variants:
                f = jax.jit(lambda s, c, m=method, kw=kw: _tk.top_count_ascending(s, c, k, method=m, **kw))
                try:
                    t = timeit(f, sc, counts)
                except Exception as e:  # noqa: BLE001  (the kernel's first GPU run: say why, go on)
                    print(f"  top_count_ascending {method} failed: {str(e)[:300]}", flush=True)
                    continue
                same = bool(np.array_equal(np.asarray(f(sc, counts)[0]), want))
                label = f"rows{rows} S{S} k=10% {pattern} {method}" + (
                    f" digits{kw['digit_bits']}" if method == "radix" else "")
                # the kernel's launch sweeps, timed inside a jit: experiments/sweep_selection_kernels.py
                record("top_count_ascending", label, t, t_sort[pattern], sc.nbytes, 0, ceil,
                       extra=dict(equals_sort=same))
        counts = jnp.full((rows,), k, jnp.int32)
        keys = _tk.orderable_keys(sc)
        for bits in (4, 2):
            f = jax.jit(lambda x, c, bits=bits: _tk.kth_largest_key(x, c, digit_bits=bits))
            record("kth_largest_key", f"rows{rows} S{S} digits{bits}", timeit(f, keys, counts), t_sort["all rows"], sc.nbytes,
                   0, ceil)
        mask = sc > 0.5
        t_cum = timeit(jax.jit(lambda m: jnp.cumsum(m.astype(jnp.int32), axis=-1)), mask)
        record("prefix_count", f"rows{rows} S{S}", timeit(jax.jit(_tk.prefix_count), mask), t_cum,
               mask.nbytes + 4 * mask.size, 0, ceil)


def _sweep(name, make, args, grid, t_default):
    """Time make(**params)(*args) for each params dict in grid (unless --no-sweep);
    returns (best time, best params) with the default launch as the starting point."""
    best = (t_default, {})
    if NO_SWEEP:
        return best
    for params in grid:
        try:
            t = timeit(make(**params), *args)
        except Exception as e:  # noqa: BLE001
            print(f"  {name} variant {params} failed: {str(e)[:200]}", flush=True)
            continue
        print(f"  {name} {params}: {t*1e6:.1f}us", flush=True)
        if t < best[0]:
            best = (t, params)
    return best


def bench_quest(ceil, quick):
    """Quest page bounds, Llama-3-8B layer (h32/kv8 d128), 128K tokens in pages of 16,
    fp32 kmin/kmax (as quest_page_minmax makes them): bound by reading the metadata."""
    n_heads, n_kv, d, S, B, page = 32, 8, 128, (1024 if TINY else 131072), 1, 16
    q = rand(jax.random.PRNGKey(13), (B, n_heads, d), jnp.bfloat16)
    k = rand(jax.random.PRNGKey(14), (B, n_kv, S, d), jnp.bfloat16)
    kmin, kmax = jax.jit(lambda k: _sc.quest_page_minmax(k, page))(k)
    del k
    P = kmin.shape[2]
    npg = jnp.full((B,), P, jnp.int32)
    make = lambda **kw: jax.jit(lambda q, a, b, n: _sc.quest_page_scores_kernel(q, a, b, n, **kw))
    f = make()
    r = jax.jit(lambda q, a, b, n: _sc.quest_page_scores_reference(q, a, b, n))
    args = (q, kmin, kmax, npg)
    t_k, t_r = timeit(f, *args), timeit(r, *args)
    bytes_ = kmin.nbytes + kmax.nbytes + q.nbytes + B * n_kv * P * 4
    flops = 4 * B * n_heads * P * d
    t_b, best = _sweep("quest", make, args, [dict(block_p=bp, num_warps=nw)
                                              for bp in (32, 64, 128) for nw in (4, 8)], t_k)
    record("quest_page_scores", f"B{B} S{S} page{page} (P{P}) h32/kv8 d128 f32 meta", t_k, t_r,
           bytes_, flops, ceil, extra=dict(rel_err_vs_xla=relerr(f(*args), r(*args)),
                                           best_us=t_b * 1e6, best_params=best))


def bench_hata(ceil, quick):
    """HATA Hamming scores, 128-bit codes (4 uint32 words per key and kv head) with key
    norms, Llama-3-8B layer at 128K: bound by reading codes + norms."""
    n_heads, n_kv, S, B, r_bits = 32, 8, (1024 if TINY else 131072), 1, 128
    W = r_bits // 32
    key = jax.random.PRNGKey(15)
    bits = lambda k, shape: jax.random.bits(k, shape, jnp.uint32)
    qc = bits(key, (B, n_heads, W))
    kc = bits(jax.random.PRNGKey(16), (B, n_kv, S, W))
    kn = jax.random.uniform(jax.random.PRNGKey(17), (B, n_kv, S), jnp.float32, 0.5, 2.0)
    L = jnp.full((B,), S, jnp.int32)
    make = lambda **kw: jax.jit(lambda a, b, L, n: _sc.hata_scores_kernel(a, b, L, k_norm=n,
                                                                          **kw))
    r = jax.jit(lambda a, b, L, n: _sc.hata_scores_reference(a, b, L, k_norm=n))
    args = (qc, kc, L, kn)
    bytes_ = kc.nbytes + kn.nbytes + qc.nbytes + B * n_kv * S * 4
    t_r = timeit(r, *args)
    for pc in ("native", "swar"):
        f = make(popcount=pc)
        t_k = timeit(f, *args)
        t_b, best = _sweep(f"hata {pc}", make, args,
                           [dict(popcount=pc, block_s=bs, num_warps=nw)
                            for bs in (128, 512, 1024) for nw in (4, 8)], t_k)
        record("hata_scores", f"B{B} S{S} r{r_bits} h32/kv8 norm popcount-{pc}", t_k, t_r,
               bytes_, 0, ceil, extra=dict(rel_err_vs_xla=relerr(f(*args), r(*args)),
                                           best_us=t_b * 1e6, best_params=best))


def bench_tokenselect(ceil, quick):
    """TokenSelect soft vote, Llama-3-8B layer (h32/kv8 d128 bf16) at 128K. The roofline
    counts only what any exact kernel must move (K once + the votes); the two-pass
    kernel also writes and re-reads the f32 logits (reported as logits_MB)."""
    n_heads, n_kv, d, S, B = 32, 8, 128, (1024 if TINY else 131072), 1
    q = rand(jax.random.PRNGKey(18), (B, n_heads, d), jnp.bfloat16)
    k = rand(jax.random.PRNGKey(19), (B, n_kv, S, d), jnp.bfloat16)
    L = jnp.full((B,), S, jnp.int32)
    args = (q, k, L)
    for shared in (False, True):
        make = lambda **kw: jax.jit(lambda q, k, L: _sc.tokenselect_scores_kernel(
            q, k, L, shared=shared, **kw))
        f = make()
        r = jax.jit(lambda q, k, L: _sc.tokenselect_scores_reference(q, k, L, shared=shared))
        t_k, t_r = timeit(f, *args), timeit(r, *args)
        bytes_ = k.nbytes + q.nbytes + B * n_kv * S * 4
        flops = 2 * B * n_heads * S * d
        t_b, best = _sweep(f"tokenselect shared{int(shared)}", make, args,
                           [dict(block_s=64), dict(programs_per_sm=4),
                            dict(block_s=64, programs_per_sm=4), dict(block_v=512),
                            dict(num_warps=8)], t_k)
        record("tokenselect_scores", f"B{B} S{S} h32/kv8 d128 bf16 shared{int(shared)}", t_k,
               t_r, bytes_, flops, ceil,
               extra=dict(rel_err_vs_xla=relerr(f(*args), r(*args)),
                          logits_MB=2 * B * n_heads * S * 4 / 1e6, best_us=t_b * 1e6,
                          best_params=best))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--only", default=None, help="comma list of: decode,paged,int4,sparse,"
                    "gather,recompute,scores,quest,hata,tokenselect,topk,prefill")
    ap.add_argument("--no-sweep", action="store_true", help="skip launch-parameter sweeps")
    args = ap.parse_args()
    global NO_SWEEP
    NO_SWEEP = args.no_sweep
    print(f"jax {jax.__version__} device {jax.devices()[0].device_kind}", flush=True)
    if TINY:
        import functools
        for mod, name in ((_da, "decode_attention_kernel"), (_q, "decode_attention_int4_kernel"),
                          (_pa, "paged_decode_attention_kernel"),
                          (_sa, "sparse_attention_kernel"), (_rc, "recompute_kv_kernel"),
                          (_ga, "gather_rows_kernel"),
                          (_sc, "topk_scores_exact_kernel"), (_sc, "quest_page_scores_kernel"),
                          (_sc, "hata_scores_kernel"), (_sc, "tokenselect_scores_kernel")):
            setattr(mod, name, functools.partial(getattr(mod, name), interpret=True))
    ceil = ceilings()
    benches = dict(decode=bench_decode, paged=bench_paged, sparse=bench_sparse, gather=bench_gather,
                   recompute=bench_recompute, int4=bench_int4, scores=bench_scores,
                   quest=bench_quest, hata=bench_hata, tokenselect=bench_tokenselect, topk=bench_topk,
                   prefill=bench_prefill)
    only = args.only.split(",") if args.only else list(benches)
    for name in only:
        try:
            benches[name](ceil, args.quick)
        except Exception as e:  # noqa: BLE001
            print(f"bench {name} failed: {type(e).__name__}: {str(e)[:800]}", flush=True)
            traceback.print_exc(limit=3)
            RESULTS.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"[:2000]))
    os.makedirs(args.out, exist_ok=True)
    meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), ceilings=ceil)
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(dict(meta=meta, results=RESULTS), f, indent=1, default=str)
    lines = [f"Device: {meta['device']}, jax {meta['jax']}, {meta['date']}. Ceilings: HBM "
             f"{ceil['hbm_GBps']:.0f} GB/s, bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s, "
             f"pinned host->GPU {ceil['h2d_GBps']:.1f} GB/s.", "",
             "| kernel | config | time us | XLA us | speedup | MB | GFLOP | roofline us | "
             "% roofline |", "|---|---|---|---|---|---|---|---|---|"]
    for r in RESULTS:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r.get('config', '')} | ERROR {r['error'][:80]} "
                         "| | | | | | |")
            continue
        x = "" if r["xla_us"] is None else f"{r['xla_us']:.1f}"
        sp = "" if r["speedup_vs_xla"] is None else f"{r['speedup_vs_xla']:.2f}x"
        lines.append(f"| {r['kernel']} | {r['config']} | {r['us']:.1f} | {x} | {sp} | "
                     f"{r['MB']:.1f} | {r['GFLOP']:.2f} | {r['roofline_us']:.1f} | "
                     f"{100*r['frac_roofline']:.0f}% ({r['bound']}) |")
    md = "\n".join(lines)
    with open(os.path.join(args.out, "bench_kernels.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    sys.exit(main())
