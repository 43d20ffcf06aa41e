#!/usr/bin/env python3
"""GPU probes that decide how the paged pinned-host block pool moves blocks.

    PYTHONPATH=src python scripts/probe_transfers.py [--smoke] [--out DIR] [--budget-s S]

Every probe moves random bf16 data and checks what arrived against the source, times with
medians of a few reps after a warm-up (compilation excluded) and reports GB/s and us per
array/block. A probe that fails records its error text and the others still run.

(a) put_list     one eager ``device_put`` of N pinned_host block arrays (list, and the same as a
                 pytree dict), 16 KiB .. 64 MiB blocks, plus the device->host put of the same list
                 (flushing blocks); fit t/array = a + bytes/B for each.
    put_overlap  eager puts (16 MiB arrays, 64 MiB arrays, one whole 512 MiB array) beside a jitted
                 bf16 matmul chain (~8 ms) dispatched after / before them.
(b) pallas_gather  a Pallas (Triton) kernel gathering blocks given an int32 index list straight from
                 a pinned_host pool [N, rows, 128] (zero-copy read), GB/s, and its overlap with the
                 matmul chain run as another jitted program.
    xla_gather   plain-XLA gathers of the pinned_host pool inside jit: ``jnp.take`` (expected to be
                 refused) and an unrolled dynamic-slice + device_put per block.
(c) write_jit_dus      jit with the pool donated: DUS of a device block at a traced index, the block
                 moved to host inside the jit, out_shardings = pinned_host. In place? correct? time?
    write_pallas_alias a Pallas kernel with input_output_aliases storing the block into the pool.
    write_roundtrip    fallback: extent to device, DUS there, back to pinned_host.
(d) bidirectional  h2d and d2h whole-array puts at the same time.
    eager_slice    ``pool[i]`` of a pinned_host pool outside jit: where it lands, time per block.

overlap = (t_compute + t_move - t_together) / min(t_compute, t_move): 1 = the move hides fully
behind the compute (or the other way), 0 = they run one after the other. ``_tc`` = move dispatched
first then compute, ``_ct`` = compute first.

Writes probe_transfers.json and probe_transfers.md to --out (default $OUT or results/) and prints
the markdown table. --smoke runs tiny sizes on any backend (CPU: Pallas in interpret mode, numbers
meaningless) to check the code paths and the correctness checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
import warnings

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.offload.bench import median_time
from kvoffload.device.memory import device_sharding, host_sharding, memory_kind_of, to_device, to_host
from kvoffload.pallas.common import triton_params

KIB = 1024
MIB = KIB * KIB
COLS = 128  # a block is [rows, 128] bf16: rows = n_kv * tokens for head dim 128
DTYPE = jnp.bfloat16
ROW_BYTES = COLS * 2


@dataclasses.dataclass(frozen=True)
class Sizes:
    list_block_bytes: tuple = (16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
    list_total_bytes: int = 512 * MIB
    list_max_arrays: int = 2048  # ~80 us each: a put of the list stays < 0.2 s
    overlap_array_bytes: tuple = (16 * MIB, 64 * MIB)
    overlap_total_bytes: int = 512 * MIB  # also the size of the one whole array
    gather_block_bytes: tuple = (64 * KIB, 256 * KIB, MIB, 4 * MIB)
    gather_pool_bytes: int = 512 * MIB
    gather_fraction: float = 0.5  # blocks gathered per call / blocks in the pool
    gather_tile_rows: int = 64  # rows one kernel program copies (64 x 128 bf16 = 16 KiB)
    xla_gather_blocks: int = 64  # unrolled dynamic slices in the plain-XLA gather
    xla_gather_block_bytes: int = MIB
    write_block_bytes: int = MIB
    extent_bytes: int = 64 * MIB
    writes_per_rep: int = 16
    bidir_bytes: int = 256 * MIB
    eager_slice_blocks: int = 16
    compute_dim: int = 4096
    compute_target_s: float = 8e-3
    reps: int = 5
    budget_s: float = 200.0  # probes not started by then are skipped (the run must end < 4 min)


SMOKE = Sizes(
    list_block_bytes=(4 * KIB, 16 * KIB, 64 * KIB), list_total_bytes=256 * KIB, list_max_arrays=16,
    overlap_array_bytes=(64 * KIB,), overlap_total_bytes=256 * KIB,
    gather_block_bytes=(16 * KIB,), gather_pool_bytes=256 * KIB, gather_tile_rows=16,
    xla_gather_blocks=4, xla_gather_block_bytes=16 * KIB,
    write_block_bytes=16 * KIB, extent_bytes=128 * KIB, writes_per_rep=4,
    bidir_bytes=256 * KIB, eager_slice_blocks=4,
    compute_dim=128, compute_target_s=2e-3, reps=2, budget_s=50.0,
)


@dataclasses.dataclass
class Ctx:
    sizes: Sizes
    interpret: bool  # Pallas kernels in interpret mode (not on GPU)
    hs: object  # pinned_host sharding
    ds: object  # device sharding
    t0: float
    key: object
    chain: object = None  # (dispatch fn, info) of the matmul chain, built on first use

    def log(self, msg):
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def next_key(self):
        self.key, k = jax.random.split(self.key)
        return k


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def overlap_stats(move, compute, reps):
    """Times of move alone, compute alone, and both dispatched back to back in each order."""
    t_m = median_time(move, reps)
    t_c = median_time(compute, reps)
    t_mc = median_time(lambda: (move(), compute()), reps)
    t_cm = median_time(lambda: (compute(), move()), reps)
    small = max(min(t_m, t_c), 1e-9)
    return dict(move_s=t_m, compute_s=t_c, move_then_compute_s=t_mc, compute_then_move_s=t_cm,
                overlap_tc=(t_m + t_c - t_mc) / small, overlap_ct=(t_m + t_c - t_cm) / small)


def gbps(nbytes, seconds):
    return nbytes / max(seconds, 1e-12) / 1e9


def short_error(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return (f"{type(e).__name__}: " + (lines[0] if lines else ""))[:400]


def rand_blocks(ctx, n, rows):
    return jax.random.normal(ctx.next_key(), (n, rows, COLS), jnp.float32).astype(DTYPE)


@jax.jit
def _equal(a, b):
    return jnp.array_equal(a, b)


def all_equal(pairs) -> bool:
    """Exact equality of every (a, b) device-array pair (dispatched together, read once)."""
    return bool(np.all(jax.device_get([_equal(a, b) for a, b in pairs])))


def buffer_pointer(x):
    try:
        return int(x.unsafe_buffer_pointer())
    except Exception:
        return None


def fit_line(xs, ys):
    """Least squares y = a + b x -> (a, b)."""
    if len(xs) < 2:
        return float(ys[0]) if ys else float("nan"), float("nan")
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


@functools.partial(jax.jit, static_argnums=2)
def _matmul_chain(x, w, n):
    return jax.lax.fori_loop(0, n, lambda _, h: jnp.tanh(h @ w), x)


def compute_chain(ctx):
    """A jitted bf16 matmul chain of about compute_target_s: (fn dispatching it, info)."""
    if ctx.chain is None:
        s = ctx.sizes
        d = s.compute_dim
        x = jax.random.normal(ctx.next_key(), (d, d), jnp.float32).astype(DTYPE)
        w = (jax.random.normal(ctx.next_key(), (d, d), jnp.float32) / np.sqrt(d)).astype(DTYPE)
        n0 = 4
        t0 = median_time(lambda: _matmul_chain(x, w, n0), 3)
        n = int(min(4096, max(1, round(n0 * s.compute_target_s / max(t0, 1e-9)))))
        fn = functools.partial(_matmul_chain, x, w, n)
        t = median_time(fn, s.reps)
        ctx.chain = (fn, dict(dim=d, matmuls=n, seconds=t))
        ctx.log(f"compute chain: {n} matmuls {d}x{d} bf16, {t * 1e3:.2f} ms")
    return ctx.chain


def overlap_row(ctx, probe, case, move, nbytes, note=""):
    compute, _ = compute_chain(ctx)
    st = overlap_stats(move, compute, ctx.sizes.reps)
    return dict(probe=probe, case=case, bytes=nbytes, gbps=gbps(nbytes, st["move_s"]), **st, note=note)


# ----------------------------------------------------------------------------
# (a) eager device_put of many block arrays
# ----------------------------------------------------------------------------


def probe_put_list(ctx):
    s = ctx.sizes
    rows_out, fits = [], {}
    per = {"h2d_list": [], "h2d_dict": [], "d2h_list": []}
    for bb in s.list_block_bytes:
        n = max(1, min(s.list_total_bytes // bb, s.list_max_arrays))
        rows = bb // ROW_BYTES
        ctx.log(f"put_list: {n} x {bb // KIB} KiB")
        base = rand_blocks(ctx, n, rows)
        src = [base[i] for i in range(n)]
        del base
        # jax.device_put, not to_host: to_host's bookkeeping would add to the per-array time
        t_d2h = median_time(lambda: jax.device_put(src, ctx.hs), s.reps)
        host = jax.block_until_ready(jax.device_put(src, ctx.hs))
        host_dict = {f"b{i:05d}": a for i, a in enumerate(host)}
        t_h2d = median_time(lambda: to_device(host), s.reps)
        t_dict = median_time(lambda: to_device(host_dict), s.reps)
        back, back_dict = to_device(host), to_device(host_dict)
        correct = all_equal(zip(back, src)) and all_equal(
            (back_dict[f"b{i:05d}"], a) for i, a in enumerate(src))
        total = n * bb
        for name, t in (("h2d_list", t_h2d), ("h2d_dict", t_dict), ("d2h_list", t_d2h)):
            per[name].append((bb, t / n))
            rows_out.append(dict(probe="put_list", case=f"{name} {n} x {_fmt_bytes(bb)}", block_bytes=bb,
                                 n_arrays=n, seconds=t, gbps=gbps(total, t), us_per_item=t / n * 1e6,
                                 correct=correct, memory_kind_host=memory_kind_of(host[0]),
                                 memory_kind_back=memory_kind_of(back[0])))
        del src, host, host_dict, back, back_dict
    for name, pts in per.items():
        a, b = fit_line([p[0] for p in pts], [p[1] for p in pts])
        fits[name] = dict(us_per_array=a * 1e6, gbps=(1 / b / 1e9) if b > 0 else float("nan"))
    return dict(rows=rows_out, fit=fits)


def probe_put_overlap(ctx):
    s = ctx.sizes
    out = []
    cases = [(bb, s.overlap_total_bytes // bb) for bb in s.overlap_array_bytes]
    cases.append((s.overlap_total_bytes, 1))
    for bb, n in cases:
        ctx.log(f"put_overlap: {n} x {_fmt_bytes(bb)}")
        rows = bb // ROW_BYTES
        src = [rand_blocks(ctx, 1, rows)[0] for _ in range(n)]
        host = to_host(src)
        back = to_device(host)
        correct = all_equal(zip(back, src))
        del back
        move = (lambda: to_device(host[0])) if n == 1 else (lambda: to_device(host))
        case = "one whole array" if n == 1 else f"list {n} x {_fmt_bytes(bb)}"
        row = overlap_row(ctx, "put_overlap", case, move, n * bb)
        row.update(correct=correct, n_arrays=n, us_per_item=row["move_s"] / n * 1e6)
        out.append(row)
        del src, host
    return dict(rows=out, compute=compute_chain(ctx)[1])


# ----------------------------------------------------------------------------
# (b) gathering blocks from a pinned_host pool
# ----------------------------------------------------------------------------


def _gather_kernel_scalar(idx_ref, pool_ref, out_ref, *, tile_rows):
    # one program copies one tile of one block: a scalar block index, a dynamic row slice
    blk = idx_ref[pl.program_id(0)]
    out_ref[...] = pool_ref[blk, pl.ds(pl.program_id(1) * tile_rows, tile_rows), :]


def _gather_kernel_vector(idx_ref, pool_ref, out_ref, *, tile_rows, per_program):
    # the pattern of JAX's Triton paged_attention: a vector of block indices indexes dim 0
    blks = idx_ref[pl.ds(pl.program_id(0) * per_program, per_program)]
    out_ref[...] = pool_ref[blks, pl.ds(pl.program_id(1) * tile_rows, tile_rows), :]


GATHER_VARIANTS = ("scalar", "vector")
VECTOR_BLOCKS_PER_PROGRAM = 4


@functools.partial(jax.jit, static_argnames=("variant", "tile_rows", "interpret"))
def pallas_gather(pool, idx, *, variant, tile_rows, interpret):
    """out[m] = pool[idx[m]] for a pool [N, rows, COLS] in any memory kind; out in device memory."""
    n_pool, rows, cols = pool.shape
    m = idx.shape[0]
    tile_rows = min(tile_rows, rows)
    if variant == "scalar":
        kernel = functools.partial(_gather_kernel_scalar, tile_rows=tile_rows)
        grid, out_block = (m, rows // tile_rows), (None, tile_rows, cols)
    else:
        p = VECTOR_BLOCKS_PER_PROGRAM
        kernel = functools.partial(_gather_kernel_vector, tile_rows=tile_rows, per_program=p)
        grid, out_block = (m // p, rows // tile_rows), (p, tile_rows, cols)
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[pl.BlockSpec((m,), lambda i, j: (0,)),
                  pl.BlockSpec((n_pool, rows, cols), lambda i, j: (0, 0, 0))],
        out_specs=pl.BlockSpec(out_block, lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((m, rows, cols), pool.dtype),
        compiler_params=triton_params(num_warps=4, num_stages=2),
        interpret=interpret, name="kvo_probe_gather",
    )(idx, pool)


def _gather_rows(ctx, pool_h, pool_src, bb):
    """Runs each kernel variant on the pool; times (and overlaps) every one that runs.
    -> (rows, {variant: error text} of those that did not)."""
    s = ctx.sizes
    n_pool = pool_h.shape[0]
    p = VECTOR_BLOCKS_PER_PROGRAM
    m = max(p, int(n_pool * s.gather_fraction) // p * p)
    idx = jnp.asarray(np.random.default_rng(bb).permutation(n_pool)[:m], jnp.int32)
    expected = jnp.take(pool_src, idx, axis=0)
    rows, errors = [], {}
    for variant in GATHER_VARIANTS:
        def go(pool=pool_h, variant=variant):
            return pallas_gather(pool, idx, variant=variant, tile_rows=s.gather_tile_rows,
                                 interpret=ctx.interpret)
        try:
            out = jax.block_until_ready(go())
        except Exception as e:  # lowering / runtime refused: record, try the next variant
            errors[variant] = short_error(e)
            continue
        row = overlap_row(ctx, "pallas_gather", f"{variant}: {m} of {n_pool} x {_fmt_bytes(bb)}", go,
                          m * bb, note=f"pool {memory_kind_of(pool_h)}")
        row.update(block_bytes=bb, n_blocks=m, variant=variant, correct=all_equal([(out, expected)]),
                   us_per_item=row["move_s"] / m * 1e6, out_memory_kind=memory_kind_of(out),
                   pool_memory_kind=memory_kind_of(pool_h))
        rows.append(row)
    return rows, errors


def probe_pallas_gather(ctx):
    s = ctx.sizes
    out, errors = [], {}
    for bb in s.gather_block_bytes:
        n_pool = s.gather_pool_bytes // bb
        ctx.log(f"pallas_gather: pool {n_pool} x {_fmt_bytes(bb)}")
        pool_src = rand_blocks(ctx, n_pool, bb // ROW_BYTES)
        pool_h = to_host(pool_src)
        rows, host_errors = _gather_rows(ctx, pool_h, pool_src, bb)
        for variant, err in host_errors.items():
            errors[f"{variant} {_fmt_bytes(bb)} host pool"] = err
            out.append(dict(probe="pallas_gather", case=f"{variant}: {_fmt_bytes(bb)} blocks, host pool",
                            error=err))
        if not rows:
            # no variant reads a host operand here (the CPU interpreter refuses host memory spaces):
            # check the kernels on a device pool so their logic is still tested
            rows, dev_errors = _gather_rows(ctx, pool_src, pool_src, bb)
            if not rows:
                raise RuntimeError(f"gather kernel failed on a host pool {host_errors} and on a device "
                                   f"pool {dev_errors}")
            for r in rows:
                r["note"] += " (host pool refused: timed on a DEVICE pool)"
        out.extend(rows)
        del pool_src, pool_h
    return dict(rows=out, errors=errors)


def probe_xla_gather(ctx):
    s = ctx.sizes
    bb = s.xla_gather_block_bytes
    rows = bb // ROW_BYTES
    n_pool = max(2 * s.xla_gather_blocks, s.gather_pool_bytes // bb // 4)
    m = s.xla_gather_blocks
    pool_src = rand_blocks(ctx, n_pool, rows)
    pool_h = to_host(pool_src)
    idx = jnp.asarray(np.random.default_rng(1).permutation(n_pool)[:m], jnp.int32)
    expected = jnp.take(pool_src, idx, axis=0)
    ds = ctx.ds

    @functools.partial(jax.jit, out_shardings=ds)
    def take(pool, idx):
        return jnp.take(pool, idx, axis=0)

    @jax.jit
    def dslice_gather(pool, idx):
        # one dynamic slice of the host pool per block, each moved to the device inside the jit
        return jnp.stack([jax.device_put(jax.lax.dynamic_index_in_dim(pool, idx[i], keepdims=False), ds)
                          for i in range(m)])

    out = []
    for name, fn in (("jnp.take", take), ("unrolled dynamic_slice + device_put", dslice_gather)):
        ctx.log(f"xla_gather: {name}, {m} x {_fmt_bytes(bb)}")
        row = dict(probe="xla_gather", case=f"{name}: {m} of {n_pool} x {_fmt_bytes(bb)}", bytes=m * bb)
        try:
            res = jax.block_until_ready(fn(pool_h, idx))
        except Exception as e:
            row.update(error=short_error(e), note="refused")
            out.append(row)
            continue
        t = median_time(lambda fn=fn: fn(pool_h, idx), s.reps)
        row.update(seconds=t, gbps=gbps(m * bb, t), us_per_item=t / m * 1e6,
                   correct=all_equal([(res, expected)]), out_memory_kind=memory_kind_of(res))
        out.append(row)
    return dict(rows=out)


# ----------------------------------------------------------------------------
# (c) writing a block into a pinned_host pool in place
# ----------------------------------------------------------------------------


def _write_setup(ctx):
    s = ctx.sizes
    rows = s.write_block_bytes // ROW_BYTES
    n_ext = s.extent_bytes // s.write_block_bytes
    k = min(s.writes_per_rep, n_ext)
    src = rand_blocks(ctx, n_ext, rows)
    blocks = rand_blocks(ctx, k, rows)
    pos = np.random.default_rng(2).permutation(n_ext)[:k]
    expected = src.at[jnp.asarray(pos)].set(blocks)
    return src, [blocks[i] for i in range(k)], [jnp.int32(p) for p in pos], expected


def _write_probe(ctx, probe, write, src, blocks, pos, expected, note):
    """Runs write(pool, block, index) -> new pool (donating pool) on a fresh pinned_host extent:
    compiles?, correct?, same buffer?, seconds per block, overlap of len(blocks) writes with compute."""
    s = ctx.sizes
    k = len(blocks)
    row = dict(probe=probe, case=f"{k} x {_fmt_bytes(s.write_block_bytes)} into {_fmt_bytes(s.extent_bytes)}",
               bytes=k * s.write_block_bytes, note=note)
    state = {"pool": to_host(src)}
    jax.block_until_ready(state["pool"])
    p_before = buffer_pointer(state["pool"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            first = jax.block_until_ready(write(state["pool"], blocks[0], pos[0]))
        except Exception as e:
            row.update(error=short_error(e), compiles=False)
            return row
    row.update(compiles=True, warnings=[str(w.message)[:300] for w in caught],
               input_deleted=_is_deleted(state["pool"]), out_memory_kind=memory_kind_of(first))
    p_after = buffer_pointer(first)
    row["same_buffer"] = None if p_before is None or p_after is None else p_before == p_after
    state["pool"] = first

    def write_all():
        pool = state["pool"]
        for b, i in zip(blocks, pos):
            pool = write(pool, b, i)
        state["pool"] = pool
        return pool

    st = overlap_row(ctx, probe, row["case"], write_all, k * s.write_block_bytes)
    row["same_buffer_after_all"] = (None if p_before is None else buffer_pointer(state["pool"]) == p_before)
    row["correct"] = all_equal([(to_device(state["pool"]), expected)])
    row.update({key: st[key] for key in ("gbps", "move_s", "compute_s", "move_then_compute_s",
                                         "compute_then_move_s", "overlap_tc", "overlap_ct")})
    row["us_per_item"] = st["move_s"] / k * 1e6
    return row


def _is_deleted(x):
    try:
        return bool(x.is_deleted())
    except Exception:
        return None


def probe_write_jit_dus(ctx):
    src, blocks, pos, expected = _write_setup(ctx)
    ctx.log("write_jit_dus")
    hs = ctx.hs

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=hs)
    def write(pool, block, i):
        # DUS needs both operands in one memory space: the block goes to host inside the jit
        block_h = jax.device_put(block, hs)
        return jax.lax.dynamic_update_slice_in_dim(pool, block_h[None], i, axis=0)

    return dict(rows=[_write_probe(ctx, "write_jit_dus", write, src, blocks, pos, expected,
                                   "jit, pool donated, out_shardings pinned_host")])


def _write_kernel(idx_ref, block_ref, pool_in_ref, pool_out_ref, *, tile_rows):
    del pool_in_ref  # aliased with pool_out_ref: the rest of the pool is left as it is
    rows = pl.ds(pl.program_id(0) * tile_rows, tile_rows)
    pool_out_ref[idx_ref[0], rows, :] = block_ref[...]


def probe_write_pallas_alias(ctx):
    s = ctx.sizes
    src, blocks, pos, expected = _write_setup(ctx)
    ctx.log("write_pallas_alias")
    hs = ctx.hs
    n_ext, rows, cols = src.shape
    tile = min(s.gather_tile_rows, rows)

    def make(interpret, out_sharding):
        @functools.partial(jax.jit, donate_argnums=0, out_shardings=out_sharding)
        def write(pool, block, i):
            return pl.pallas_call(
                functools.partial(_write_kernel, tile_rows=tile), grid=(rows // tile,),
                in_specs=[pl.BlockSpec((1,), lambda j: (0,)),
                          pl.BlockSpec((tile, cols), lambda j: (j, 0)),
                          pl.BlockSpec((n_ext, rows, cols), lambda j: (0, 0, 0))],
                out_specs=pl.BlockSpec((n_ext, rows, cols), lambda j: (0, 0, 0)),
                out_shape=jax.ShapeDtypeStruct((n_ext, rows, cols), pool.dtype),
                input_output_aliases={2: 0}, compiler_params=triton_params(num_warps=4, num_stages=1),
                interpret=interpret, name="kvo_probe_write",
            )(i.reshape(1), block, pool)
        return write

    row = _write_probe(ctx, "write_pallas_alias", make(ctx.interpret, hs), src, blocks, pos, expected,
                       "Pallas input_output_aliases, pool pinned_host")
    out = [row]
    if not row.get("compiles"):
        # check the kernel itself on a device pool, so a refusal above is about host memory only
        dev_write = make(ctx.interpret, ctx.ds)
        state = {"pool": src + 0}  # a copy: src is donated otherwise

        def write_all():
            for b, i in zip(blocks, pos):
                state["pool"] = dev_write(state["pool"], b, i)
            return state["pool"]

        t = median_time(write_all, s.reps)
        k = len(blocks)
        out.append(dict(probe="write_pallas_alias", case=f"same kernel, {k} blocks into a DEVICE pool",
                        correct=all_equal([(state["pool"], expected)]), seconds=t,
                        gbps=gbps(k * s.write_block_bytes, t), us_per_item=t / k * 1e6,
                        note="kernel check only, not a host write"))
    return dict(rows=out)


def probe_write_roundtrip(ctx):
    s = ctx.sizes
    src, blocks, pos, expected = _write_setup(ctx)
    ctx.log("write_roundtrip")
    hs = ctx.hs
    dus = jax.jit(lambda ext, block, i: jax.lax.dynamic_update_slice_in_dim(ext, block[None], i, axis=0),
                  donate_argnums=0)
    state = {"pool": to_host(src)}

    def roundtrip(block=blocks[0], i=pos[0]):
        ext = dus(to_device(state["pool"]), block, i)
        state["pool"] = jax.device_put(ext, hs)
        return state["pool"]

    for b, i in zip(blocks, pos):
        roundtrip(b, i)
    correct = all_equal([(to_device(state["pool"]), expected)])
    row = overlap_row(ctx, "write_roundtrip", f"1 block into {_fmt_bytes(s.extent_bytes)} extent: "
                      "h2d, DUS, d2h", roundtrip, 2 * s.extent_bytes,
                      note="gbps counts the extent both ways")
    row.update(correct=correct, us_per_item=row["move_s"] * 1e6, out_memory_kind=memory_kind_of(state["pool"]))
    return dict(rows=[row])


# ----------------------------------------------------------------------------
# (d) extras
# ----------------------------------------------------------------------------


def probe_bidirectional(ctx):
    s = ctx.sizes
    rows = s.bidir_bytes // ROW_BYTES
    ctx.log(f"bidirectional: {_fmt_bytes(s.bidir_bytes)} each way")
    dev = rand_blocks(ctx, 1, rows)[0]
    host = to_host(rand_blocks(ctx, 1, rows)[0])
    h2d = lambda: to_device(host)  # noqa: E731
    d2h = lambda: jax.device_put(dev, ctx.hs)  # noqa: E731
    st = overlap_stats(h2d, d2h, s.reps)
    correct = all_equal([(to_device(d2h()), dev), (h2d(), to_device(host))])
    both_s = st["move_then_compute_s"]  # h2d dispatched, then d2h
    return dict(rows=[dict(probe="bidirectional", case=f"h2d + d2h {_fmt_bytes(s.bidir_bytes)} each",
                           bytes=2 * s.bidir_bytes, seconds=both_s, gbps=gbps(2 * s.bidir_bytes, both_s),
                           us_per_item=both_s * 1e6, h2d_s=st["move_s"], d2h_s=st["compute_s"],
                           h2d_gbps=gbps(s.bidir_bytes, st["move_s"]),
                           d2h_gbps=gbps(s.bidir_bytes, st["compute_s"]),
                           overlap_tc=st["overlap_tc"], overlap_ct=st["overlap_ct"], correct=correct,
                           note="GB/s of both directions at once (us/item: the pair); overlap: h2d vs d2h")])


def probe_eager_slice(ctx):
    s = ctx.sizes
    rows = s.write_block_bytes // ROW_BYTES
    n_ext = s.extent_bytes // s.write_block_bytes
    k = min(s.eager_slice_blocks, n_ext)
    ctx.log(f"eager_slice: {k} x {_fmt_bytes(s.write_block_bytes)}")
    src = rand_blocks(ctx, n_ext, rows)
    pool_h = to_host(src)
    pos = [int(p) for p in np.random.default_rng(3).permutation(n_ext)[:k]]
    out = []
    for name, fn in (("pool[i]", lambda: [pool_h[p] for p in pos]),
                     ("device_put(pool[i], device)", lambda: to_device([pool_h[p] for p in pos]))):
        res = jax.block_until_ready(fn())
        t = median_time(fn, s.reps)
        out.append(dict(probe="eager_slice", case=f"{name}, {k} x {_fmt_bytes(s.write_block_bytes)}",
                        bytes=k * s.write_block_bytes, seconds=t, gbps=gbps(k * s.write_block_bytes, t),
                        us_per_item=t / k * 1e6, out_memory_kind=memory_kind_of(res[0]),
                        correct=all_equal((to_device(r), src[p]) for r, p in zip(res, pos))))
    return dict(rows=out)


PROBES = {
    "put_list": probe_put_list,
    "put_overlap": probe_put_overlap,
    "pallas_gather": probe_pallas_gather,
    "xla_gather": probe_xla_gather,
    "write_jit_dus": probe_write_jit_dus,
    "write_roundtrip": probe_write_roundtrip,
    "bidirectional": probe_bidirectional,
    "eager_slice": probe_eager_slice,
    # last: a kernel storing through a host pointer could leave the GPU context unusable
    "write_pallas_alias": probe_write_pallas_alias,
}


# ----------------------------------------------------------------------------
# driver, report
# ----------------------------------------------------------------------------


def _fmt_bytes(n):
    n = int(n)
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB"


def _num(x, fmt):
    return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else fmt.format(x)


def markdown_table(report) -> str:
    lines = ["| probe | case | GB/s | us/item | overlap move->compute | overlap compute->move | correct | note |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for name, res in report["probes"].items():
        if res.get("error") or res.get("skipped"):
            lines.append(f"| {name} | | | | | | | {res.get('error') or res.get('skipped')} |")
            continue
        for r in res["rows"]:
            note = r.get("error") or r.get("note", "")
            if r.get("same_buffer") is not None:
                note += f" same_buffer={r['same_buffer']}"
            lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
                name, r.get("case", ""), _num(r.get("gbps"), "{:.2f}"), _num(r.get("us_per_item"), "{:.1f}"),
                _num(r.get("overlap_tc"), "{:.2f}"), _num(r.get("overlap_ct"), "{:.2f}"),
                r.get("correct", ""), note.replace("|", "/")))
        for fname, f in res.get("fit", {}).items():
            lines.append(f"| {name} | fit {fname}: t/array = a + bytes/B | {_num(f['gbps'], '{:.2f}')} | "
                         f"{_num(f['us_per_array'], '{:.1f}')} | | | | a = us/item, B = GB/s |")
    return "\n".join(lines)


def run_probes(sizes: Sizes, interpret: bool, names=None, seed=0, save=None) -> dict:
    """Runs the named probes (all by default) -> report; save(report) after each probe, so a
    crash (say, a kernel faulting on a host pointer) keeps what was measured before it."""
    t0 = time.perf_counter()
    dev = jax.local_devices()[0]
    ctx = Ctx(sizes=sizes, interpret=interpret, hs=host_sharding(dev), ds=device_sharding(dev), t0=t0,
              key=jax.random.PRNGKey(seed))
    report = dict(meta=dict(jax=jax.__version__, backend=jax.default_backend(), device=str(dev),
                            device_kind=getattr(dev, "device_kind", ""), interpret=interpret,
                            host_memory_kind=ctx.hs.memory_kind, sizes=dataclasses.asdict(sizes)),
                  probes={})
    for name in names or PROBES:
        if time.perf_counter() - t0 > sizes.budget_s:
            report["probes"][name] = dict(skipped=f"time budget {sizes.budget_s:.0f} s spent")
            ctx.log(f"{name}: skipped (budget)")
            continue
        t = time.perf_counter()
        try:
            res = PROBES[name](ctx)
        except Exception as e:
            res = dict(error=short_error(e), traceback=traceback.format_exc()[-2000:])
            ctx.log(f"{name}: FAILED {res['error']}")
        res["seconds"] = time.perf_counter() - t
        report["probes"][name] = res
        report["meta"]["compute_chain"] = ctx.chain[1] if ctx.chain else None
        report["meta"]["wall_s"] = time.perf_counter() - t0
        if save is not None:
            save(report)
    return report


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; Pallas interpret mode off GPU")
    ap.add_argument("--out", default=None, help="output folder (default $OUT or results/)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip probes not started by then")
    ap.add_argument("--probes", default=None, help=f"comma-separated subset of {','.join(PROBES)}")
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else Sizes()
    if args.budget_s is not None:
        sizes = dataclasses.replace(sizes, budget_s=args.budget_s)
    names = args.probes.split(",") if args.probes else None
    unknown = [n for n in names or () if n not in PROBES]
    if unknown:
        ap.error(f"unknown probes {unknown}; known: {list(PROBES)}")
    interpret = jax.default_backend() != "gpu"
    out_dir = args.out or os.environ.get("OUT") or "results"
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "probe_transfers.json")

    def save(rep):
        with open(json_path, "w") as f:
            json.dump(_jsonable(rep), f, indent=1)

    report = _jsonable(run_probes(sizes, interpret, names, save=save))
    table = markdown_table(report)
    with open(os.path.join(out_dir, "probe_transfers.md"), "w") as f:
        f.write(table + "\n")
    meta = report["meta"]
    print(f"\n{meta['device_kind']} ({meta['backend']}), jax {meta['jax']}, wall {meta['wall_s']:.1f} s, "
          f"compute chain {meta['compute_chain']}")
    print(table)
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
