"""How a decode step looping over stacked layers can read one layer's weight in place: a b-row
linear `x @ W[i]` inside `lax.fori_loop` over a stacked W [L, H, O], written several ways, against the same
linear over separate per-layer arrays (unrolled in one program: the layer programs' GPU work without their
host cost). XLA copies a
dynamic slice it cannot fuse into its consumer (`probe_scan_layers.py` saw the einsum's weight slice written
out in fp32), so the form decides whether the loop pays a copy of every weight every step.

    PYTHONPATH=src python scripts/probe_stacked_linear.py --out $OUT/linear.json
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true PYTHONPATH=src python scripts/probe_stacked_linear.py

Reports per form the microseconds per layer, the GB/s of the weight bytes read and the largest difference
from the per-layer einsum's result (bf16 rounding of a different summation order is expected; not zero).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

FORMS = ("einsum_f32", "einsum_bf16", "mulsum_f32", "mulsum_t_f32", "dot_general_f32", "pallas_f32")
# mulsum_t_f32: the weight stored transposed [O, H], summed along its rows (a row reduction, which XLA runs
# faster than mulsum_f32's column reduction for a tall weight); pallas_f32: `pallas.stacked_linear`, the
# stacked array and the layer index given to a kernel that reads the slice by pointer arithmetic


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1, help="tokens (batch x 1) multiplied")
    ap.add_argument("--din", type=int, default=4096)
    ap.add_argument("--dout", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.offload.bench import mulsum_linear, write_json
    from kvoffload.pallas.stacked_linear import stacked_linear_kernel

    L, B, H, O = args.layers, args.rows, args.din, args.dout
    rng = np.random.default_rng(0)
    w_st = jnp.asarray(rng.standard_normal((L, H, O)) * H ** -0.5, jnp.bfloat16)
    w_each = [w_st[i].copy() for i in range(L)]
    x = jnp.asarray(rng.standard_normal((B, H)), jnp.bfloat16)

    w_t = jnp.swapaxes(w_st, 1, 2)  # [L, O, H] for mulsum_t
    w_t_each = [w_t[i].copy() for i in range(L)]
    interpret = jax.default_backend() == "cpu"

    # the weights are the programs' arguments (a closed-over array would be a constant of the program)
    weights = dict(st=w_st, t=w_t, each=w_each, t_each=w_t_each)

    def lin(form, ws, x, i, looped):
        """Layer i's x @ W: from the stacked arrays (looped, i traced) or from separate per-layer arrays."""
        if form == "pallas_f32":  # always the stacked array and an index: that is the kernel's point
            return stacked_linear_kernel(x, ws["st"], jnp.int32(i) if not looped else i, interpret=interpret)
        if form == "mulsum_t_f32":
            wt = ws["t"][i] if looped else ws["t_each"][i]
            return jnp.sum(x.astype(jnp.float32)[:, None, :] * wt.astype(jnp.float32), axis=-1).astype(x.dtype)
        w = ws["st"][i] if looped else ws["each"][i]
        if form == "einsum_f32":
            return jnp.einsum("bi,io->bo", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        if form == "einsum_bf16":
            return jnp.einsum("bi,io->bo", x, w)
        if form == "mulsum_f32":
            return mulsum_linear(x, w)
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)

    # each layer's output feeds nothing back (x stays), so every form reads L weights; the outputs are summed
    # so no layer's work is dead
    def looped(form):
        @jax.jit
        def f(ws, x):
            def body(i, acc):
                return acc + lin(form, ws, x, i, True).astype(jnp.float32)
            return jax.lax.fori_loop(0, L, body, jnp.zeros((B, O), jnp.float32))
        return lambda: f(weights, x)

    def unrolled(form):  # separate per-layer arrays in one program: the layer programs' GPU work, no host cost
        g = jax.jit(lambda ws, x: sum(lin(form, ws, x, i, False).astype(jnp.float32) for i in range(L)))
        return lambda: g(weights, x)

    def timed(fn):
        jax.block_until_ready(fn())
        t = time.perf_counter()
        for _ in range(args.reps):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / args.reps, out

    _, ref = timed(unrolled("einsum_f32"))
    wbytes = L * H * O * 2
    rows = {}
    for form in FORMS:
        for how, make in (("separate", unrolled), ("loop", looped)):
            s, out = timed(make(form))
            rows[f"{form} {how}"] = dict(us_per_layer=1e6 * s / L, gb_s=wbytes / s / 1e9,
                                         max_abs_diff=float(jnp.max(jnp.abs(out - ref))))
    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, layers=L, rows=B, din=H, dout=O,
               xla_flags=os.environ.get("XLA_FLAGS", ""), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               forms=rows)
    print("| form | us a layer | weight GB/s | max abs diff vs einsum_f32 separate |\n|---|--:|--:|--:|")
    for k, r in rows.items():
        print(f"| {k} | {r['us_per_layer']:.1f} | {r['gb_s']:.0f} | {r['max_abs_diff']:.3g} |")
    if args.out:
        write_json(args.out, rec)
    return rec


if __name__ == "__main__":
    main()
