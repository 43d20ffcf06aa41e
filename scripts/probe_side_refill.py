#!/usr/bin/env python3
"""Can a row refill over PCIe hide inside a weight-streaming matmul launch? (Qwen2.5-7B's 2x over naive top-k)

    PYTHONPATH=src python scripts/probe_side_refill.py [--smoke] [--shape qwen2.5-7b] [--heads 1,2,4] [--out DIR]

Why: `clo`'s naive baseline runs every kernel `clo` runs, so only what `clo` does not do at all, the refill of
the missed heads' rows over PCIe, can widen the gap (BENCHMARKS 'clo at 128K b1': at Qwen2.5-7B 128K b1 the
refill is 1.22 ms of a 7.58 ms step; hidden, `clo` would be 2.12x naive, on the critical path it needs a quarter of
all shared work cut). A kernel reading pinned host memory runs on the compute stream: beside a matmul in another
launch it costs the sum (DESIGN.md). CLO's speculative prefetch would refill layer l+1's guessed rows during layer l;
this probe asks whether one launch whose programs split between a matmul's weight tiles (HBM-bound) and the host
rows (PCIe-bound) takes the max of the two instead of the sum, before any pipeline is built on it.

Per --heads h (missed KV heads), one layer's shapes, us a call (--calls in a jit, median of --reps):
  matmul  x [1, K] @ W[layer] (the MLP's gate: `pallas.stacked_linear` tiles over a stacked [L, K, N] bf16 weight)
  refill  h heads' 10% rows in runs of 32 tokens (Quest pages), `--row-bytes` a row (224: int8 K + int4 V + their
          float32 scales, as `clo` stores them), from a pinned_host array into a device buffer, one launch
  serial  the two launches one after the other (what a step does now)
  fused   ONE launch: the matmul's and the refill's programs side by side in one grid, three orders (the GPU
          starts programs in id order): matmul first, refill first, interleaved
"hidden" = (serial - best fused) / refill: 1 when the refill costs nothing beside the matmul, 0 when it adds its whole
time; "overlap" = (serial - best fused) / the shorter of the two alone: 1 when the shorter runs wholly inside the longer. Every variant's rows and matmul result are checked against the separate launches' (exactly).

Writes probe_side_refill.json / .md to --out (default $OUT or results/). --smoke: tiny shapes on any backend (CPU:
interpret mode; the numbers mean nothing, the code paths and the checks run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvoffload.offload.bench import median_time
from kvoffload.device.memory import host_sharding
from kvoffload.pallas import stacked_linear as sl
from kvoffload.pallas.common import cdiv, load, next_pow2, on_gpu, pallas_call, triton_params

SHAPES = {"llama-3-8b": (4096, 14336, 8, 32), "qwen2.5-7b": (3584, 18944, 4, 28)}  # K, N (gate), KV heads, layers
PAGE = 32


def _rows_tile(tok_ref, host_ref, buf_ref, h, t, *, n_rows, width, wp, bk):
    """Rows [t bk, (t + 1) bk) of head h's refill: host_ref [n_kv, T, width] -> buf_ref [n_kv, n_rows, width] at the
    token ids tok_ref [n_kv, n_rows] (rows with a negative id are kept)."""
    from jax.experimental.pallas import triton as plgpu

    rows = t * bk + jnp.arange(bk, dtype=jnp.int32)
    head = jnp.zeros((bk, 1), jnp.int32) + h
    toks = load(tok_ref.at[head[:, 0], rows], mask=rows < n_rows, other=-1)
    ok = (rows < n_rows) & (toks >= 0)
    cols = jnp.arange(wp, dtype=jnp.int32)
    msk = ok[:, None] & (cols < width)[None, :]
    vals = load(host_ref.at[head, jnp.maximum(toks, 0)[:, None], cols[None, :]], mask=msk, other=0)
    plgpu.store(buf_ref.at[head, rows[:, None], cols[None, :]], vals, mask=msk)


ORDERS = ("matmul_first", "refill_first", "interleave")


def _assign(pid, n_mm, n_rf, order):
    """(is a matmul program, its matmul tile, its refill tile) of program pid: the GPU starts programs in id order,
    so the order decides which kind holds the SMs first ("interleave": alternate while both kinds remain)."""
    if order == "matmul_first" or n_rf == 0:
        return pid < n_mm, pid, pid - n_mm
    if order == "refill_first" or n_mm == 0:
        return pid >= n_rf, pid - n_rf, pid
    both = min(n_mm, n_rf)
    paired = pid < 2 * both
    is_mm = jnp.where(paired, pid % 2 == 0, n_mm > n_rf)
    rest = pid - both
    return is_mm, jnp.where(paired, pid // 2, rest), jnp.where(paired, pid // 2, rest)


def _side_kernel(layer_ref, x_ref, w_ref, tok_ref, host_ref, _buf_in, o_ref, buf_ref, *, mm, rf, n_mm, n_rf, tiles,
                 order):
    is_mm, i_mm, i_rf = _assign(pl.program_id(0), n_mm, n_rf, order)
    if mm is not None:
        nj, S = mm["nj"], mm["S"]

        @pl.when(is_mm)
        def _():
            sl.linear_tile(layer_ref, x_ref, w_ref, o_ref, 0, (i_mm // S) % nj, i_mm % S, **mm["tile"])

    if rf is not None:
        @pl.when(jnp.logical_not(is_mm))
        def _():
            _rows_tile(tok_ref, host_ref, buf_ref, i_rf // tiles, i_rf % tiles, **rf)


def launch_plan(x, w, buf, block_k=64) -> dict:
    """The one launch's tiles: the matmul's (`stacked_linear`'s few-row tiles: nj column tiles x S K splits
    programs) and the refill's (n_kv heads x `tiles` tiles of block_k rows: a kept head's programs exit at once)."""
    M, K = x.shape
    N = w.shape[2]
    n_kv, R, width = buf.shape
    bm, bn, bk, S, per_split = sl.stacked_linear_tiles(M, K, N, **{k: sl.FEW_ROWS_TILES[k] for k in
                                                                    ("block_n", "block_k", "target_programs")})
    nj, tiles = cdiv(N, bn), cdiv(R, block_k)
    return dict(nj=nj, S=S, tile=dict(M=M, K=K, N=N, bm=bm, bn=bn, bk=bk, per_split=per_split), tiles=tiles,
                rows=dict(n_rows=R, width=width, wp=next_pow2(width), bk=block_k),
                matmul_programs=nj * S, refill_programs=n_kv * tiles)


def side_call(x, w, layer, tokens, host, buf, *, matmul=True, refill=True, order="interleave", block_k=64,
              interpret=False):
    """One launch: x @ w[layer] (fp32 partials [S, 1, N], `stacked_linear`'s tiles) and/or the refill of buf
    [n_kv, R, width] from host [n_kv, T, width] at tokens [n_kv, R], programs in `order` (ORDERS). Returns
    (partials or None, buf)."""
    M, N = x.shape[0], w.shape[2]
    plan = launch_plan(x, w, buf, block_k)
    S, tiles = plan["S"], plan["tiles"]
    mm = dict(nj=plan["nj"], S=S, tile=plan["tile"]) if matmul else None
    rf = plan["rows"] if refill else None
    n_mm = plan["matmul_programs"] if matmul else 0
    n_rf = plan["refill_programs"] if refill else 0
    grid = n_mm + n_rf
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, n=a.ndim: (0,) * n)  # noqa: E731
    lay = jnp.reshape(layer, (1,)).astype(jnp.int32)
    args = (lay, x, w, tokens, host, buf)
    out_shape = [jax.ShapeDtypeStruct((S, M, N), jnp.float32), jax.ShapeDtypeStruct(buf.shape, buf.dtype)]
    part, new = pallas_call(
        functools.partial(_side_kernel, mm=mm, rf=rf, n_mm=n_mm, n_rf=n_rf, tiles=tiles, order=order),
        grid=(grid,), in_specs=[whole(a) for a in args],
        out_specs=[whole(s) for s in out_shape], out_shape=out_shape,
        input_output_aliases={5: 1},
        compiler_params=triton_params(num_warps=sl.FEW_ROWS_TILES["num_warps"], num_stages=3),
        interpret=interpret, name="kvo_side_refill",
    )(*args)
    return (part if matmul else None), new


def selection(rng, T, heads, n_kv, rows):
    """[n_kv, rows] token ids: `heads` heads select 10% of T in runs of PAGE (ascending), the rest keep (-1)."""
    out = np.full((n_kv, rows), -1, np.int32)
    pages = T // PAGE
    for h in range(heads):
        pick = np.sort(rng.choice(pages, rows // PAGE, replace=False))
        out[h] = (pick[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
    return out


def probe(args) -> list[dict]:
    interpret = not on_gpu()
    K, N, n_kv, L = SHAPES[args.shape]
    T = args.context
    if args.smoke:
        K, N, n_kv, L, T = 96, 200, 2, 2, 2048
    rows = (T // 10) // PAGE * PAGE
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((L, K, N)) * 0.02, jnp.bfloat16)
    host = jax.device_put(rng.integers(0, 255, (n_kv, T, args.row_bytes), dtype=np.uint8), host_sharding())
    host_np = np.asarray(host)
    out = []
    for heads in [int(h) for h in args.heads.split(",") if int(h) <= n_kv]:
        tok = jnp.asarray(selection(rng, T, heads, n_kv, rows))
        tok_np = np.asarray(tok)
        buf0 = jnp.zeros((n_kv, rows, args.row_bytes), jnp.uint8)

        def run(matmul, refill, split, order="interleave"):
            # every array is an argument: closing over them would bake GBs of weights into the program as constants
            def steps(x, w, tok, host, buf):
                def body(i, carry):
                    acc, buf = carry
                    layer = i % L
                    if split:  # the two launches, one after the other
                        part, _ = side_call(x, w, layer, tok, host, buf, refill=False, interpret=interpret)
                        _, buf = side_call(x, w, layer, tok, host, buf, matmul=False, interpret=interpret)
                    else:
                        part, buf = side_call(x, w, layer, tok, host, buf, matmul=matmul, refill=refill,
                                              order=order, interpret=interpret)
                    return (acc + (0.0 if part is None else jnp.sum(part, axis=0)), buf)

                return jax.lax.fori_loop(0, args.calls, body, (jnp.zeros((1, N), jnp.float32), buf))

            return jax.jit(steps)

        # the matmul's reference: the stacked-linear kernel's own launch with the same tiles (the same sums)
        want_mm = np.asarray(sl.stacked_linear_kernel(x, w, jnp.int32(0), out_dtype=jnp.float32, interpret=interpret,
                                                      **sl.FEW_ROWS_TILES), np.float64)
        ref_rows = np.where((tok_np >= 0)[..., None],
                            host_np[np.arange(n_kv)[:, None], np.maximum(tok_np, 0)], 0)
        plan = launch_plan(x, w, buf0)
        res = {"heads": heads, "rows_per_head": rows, "row_bytes": args.row_bytes,
               "refill_MB": heads * rows * args.row_bytes / 1e6, "matmul_programs": plan["matmul_programs"],
               "refill_programs": plan["refill_programs"]}
        variants = {"matmul": (True, False, False, "interleave"), "refill": (False, True, False, "interleave"),
                    "serial": (True, True, True, "interleave")}
        variants.update({"fused_" + o: (True, True, False, o) for o in ORDERS})
        for name, (m, r, split, order) in variants.items():
            f = run(m, r, split, order)
            _, buf = f(x, w, tok, host, buf0)
            exact = True
            if r:
                exact &= bool(np.array_equal(np.asarray(buf), ref_rows))
            if m:  # every call adds layer i % L's product: check the first layer's through one call
                one = jax.jit(lambda x, w, tok, host, b, m=m, r=r, o=order: side_call(
                    x, w, 0, tok, host, b, matmul=m, refill=r, order=o, interpret=interpret))(x, w, tok, host, buf0)[0]
                exact &= bool(np.array_equal(np.asarray(jnp.sum(one, axis=0), np.float64), want_mm))
            sec = median_time(lambda: f(x, w, tok, host, buf0), reps=args.reps, warmup=1) / args.calls
            res[name + "_us"] = round(sec * 1e6, 2)
            res[name + "_exact"] = exact
        best = min(ORDERS, key=lambda o: res["fused_" + o + "_us"])
        res["fused_best"] = best
        res["fused_us"] = res["fused_" + best + "_us"]
        saved = res["serial_us"] - res["fused_us"]
        res["saved_us"] = round(saved, 2)
        res["hidden"] = round(saved / res["refill_us"], 3) if res["refill_us"] else None
        shorter = min(res["matmul_us"], res["refill_us"])
        res["overlap"] = round(saved / shorter, 3) if shorter else None
        out.append(res)
        print(json.dumps(res), flush=True)
    return out


VARIANTS = ("matmul", "refill", "serial") + tuple("fused_" + o for o in ORDERS)


def exact(row) -> bool:
    return all(row[v + "_exact"] for v in VARIANTS)


def markdown(rows, meta) -> str:
    lines = [f"# side refill ({meta['shape']}, {meta['device']})", "",
             "| missed heads | refill MB | matmul us | refill us | serial us | "
             + " | ".join(f"fused, {o.replace('_', ' ')} us" for o in ORDERS) + " | saved us | hidden | overlap | exact |",
             "|--:|--:|--:|--:|--:|" + "--:|" * len(ORDERS) + "--:|--:|--:|---|"]
    for r in rows:
        lines.append(f"| {r['heads']} | {r['refill_MB']:.2f} | {r['matmul_us']} | {r['refill_us']} | "
                     f"{r['serial_us']} | " + " | ".join(str(r[f"fused_{o}_us"]) for o in ORDERS) + f" | {r['saved_us']} | {r['hidden']} | {r['overlap']} | {exact(r)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--heads", default="1,2,4", help="missed KV heads a layer (comma list)")
    ap.add_argument("--row-bytes", type=int, default=224)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.calls, args.reps, args.heads, args.row_bytes = 2, 1, "1,2", 40
    out = args.out or os.environ.get("OUT") or "results"
    os.makedirs(out, exist_ok=True)
    rows = probe(args)
    meta = {"shape": args.shape, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "context": args.context, "calls": args.calls}
    with open(os.path.join(out, "probe_side_refill.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "probe_side_refill.md"), "w") as f:
        f.write(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0 if all(exact(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
