"""The host's cost of launching a jitted program, by what it depends on: the number of kernels in
the program, whether its argument buffers change between calls (one compiled layer program runs every layer,
each with its own weights), and the number of array arguments, on one device and sharded over several.

    PYTHONPATH=src python scripts/probe_launch_cost.py --out $OUT/launch.json
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" PYTHONPATH=src python scripts/probe_launch_cost.py

Kernels: a chain of --kernels small ops kept apart by optimization barriers, called back to back with (a) the
same buffers, (b) the weight argument cycling over 32 arrays, (c) (b) with each call's output fed to the next.
Arguments: a program summing 1, 16 and 64 small arrays, on 1 device and on --devices (default: up to 4) with
each argument sharded over them. Reported as microseconds per call (and per kernel / per argument).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def per_call(fn, calls: int) -> float:
    """Seconds per call of fn() over `calls` back-to-back calls (dispatch is asynchronous: the last result is
    waited for, so a call's cost is its host time unless the device falls behind)."""
    import jax

    jax.block_until_ready(fn())
    t = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls


def kernel_chain(n_kernels: int, calls: int) -> dict:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def prog(h, w, state):
        for i in range(n_kernels):
            h = jax.lax.optimization_barrier(jnp.tanh(h * w[i % w.shape[0]] + state[i % state.shape[0]]))
        return h

    key = jax.random.key(0)
    h0 = jax.random.normal(key, (1, 4096), jnp.float32)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (8, 4096), jnp.float32) for i in range(32)]
    st = jax.random.normal(key, (8, 4096), jnp.float32)
    count = iter(range(10**9))
    carry = {"h": h0}

    def chained():
        carry["h"] = prog(carry["h"], ws[next(count) % 32], st)
        return carry["h"]

    out = {}
    for name, fn in (("same buffers", lambda: prog(h0, ws[0], st)),
                     ("weights cycling", lambda: prog(h0, ws[next(count) % 32], st)),
                     ("weights cycling, output chained", chained)):
        s = per_call(fn, calls)
        out[name] = {"us_per_call": 1e6 * s, "us_per_kernel": 1e6 * s / n_kernels}
    return out


def arguments(devices: int, counts, calls: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("model",))
    where = NamedSharding(mesh, P(None, "model"))
    out = {}
    for n in counts:
        xs = [jax.device_put(jnp.full((4, 16 * devices), float(i), jnp.float32), where) for i in range(n)]
        prog = jax.jit(lambda *a: sum(a[1:], a[0]) if len(a) > 1 else a[0] * 2)
        out[n] = 1e6 * per_call(lambda: prog(*xs), calls)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=70)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--devices", type=int, default=None, help="devices for the sharded argument sweep (max 4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax

    from kvoffload.offload.bench import write_json

    many = min(args.devices or 4, len(jax.devices()))
    rec = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "kernels": args.kernels,
           "kernel_chain": kernel_chain(args.kernels, args.calls),
           "arguments_us_per_call": {f"{d} devices": arguments(d, (1, 16, 64), args.calls) for d in sorted({1, many})}}
    for name, r in rec["kernel_chain"].items():
        print(f"{args.kernels} kernels, {name:32s} {r['us_per_call']:8.1f} us per call ({r['us_per_kernel']:.2f} per kernel)")
    for where, r in rec["arguments_us_per_call"].items():
        print(f"{where}: " + ", ".join(f"{n} args {us:.1f} us" for n, us in r.items()))
    if args.out:
        write_json(args.out, rec)
    return rec


if __name__ == "__main__":
    main()
