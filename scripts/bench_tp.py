"""Tensor-parallel decode benchmark (issue 14): `offload` and `kvpr` decode throughput on 1, 2 and 4 GPUs
of one host (random weights in OPT-6.7B b64 P512 and OPT-13B shapes), and each GPU's host->GPU bandwidth
alone and with every link active at once. One call; JSON to --out.

    PYTHONPATH=src python scripts/bench_tp.py --out $OUT            # 1, 2 and 4 GPUs where present
    PYTHONPATH=src python scripts/bench_tp.py --tp 1,2 --workloads opt67b --out $OUT

Each (workload, policy, N) is `kvoffload.offload.bench.measure` (prefill, warm-up steps, timed steps each
ending when its tokens are on the host) with tensor_parallel=N: heads, weights and the pinned host pool
split over N GPUs, each moving its heads' blocks over its own link. Throughput = batch / median step time;
speedup = throughput(N) / throughput(1). The bandwidth probe moves a pinned_host array sharded over the N
GPUs (one `size_mb` shard per GPU) to device memory with one eager device_put and reports GB/s per GPU and
in total, against one GPU alone: when the N links together fall short of N times one link, the host's
memory bandwidth (or the PCIe switch) caps them and tensor parallelism cannot scale past that.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

# the pinned host pool of OPT-13B b128 is past XLA's default 64 GB cap (as in the other GPU benchmarks)
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

WORKLOADS = ("opt67b", "opt13b_col")


def bandwidth(n: int, size_mb: float, repeats: int) -> dict:
    """Host->GPU GB/s of n GPUs moving one size_mb shard each at once (median of repeats)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kvoffload.offload import sharding as S

    mesh = S.make_mesh(n)
    elems = int(size_mb * 2**20) // 2
    host = jax.device_put(jnp.zeros((n, elems), jnp.bfloat16), NamedSharding(mesh, P(S.MODEL), memory_kind="pinned_host"))
    dev_s = NamedSharding(mesh, P(S.MODEL), memory_kind="device")
    jax.block_until_ready(jax.device_put(host, dev_s))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(host, dev_s))
        times.append(time.perf_counter() - t)
    t = float(np.median(times))
    per = elems * 2 / t / 1e9
    del host
    gc.collect()
    return {"gpus": n, "shard_mb": size_mb, "seconds": t, "per_gpu_gb_s": per, "total_gb_s": per * n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default $OUT or .)")
    ap.add_argument("--tp", default=None, help="comma list of GPU counts (default 1,2,4 up to the GPUs present)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {WORKLOADS} (or tiny_row on CPU)")
    ap.add_argument("--policies", default="offload,kvpr")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bw-mb", type=float, default=1024.0, help="bandwidth probe: MiB per GPU")
    ap.add_argument("--bw-repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from kvoffload.offload.bench import _workloads, make_model, measure

    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    n_dev = len(jax.devices())
    tps = [int(x) for x in args.tp.split(",")] if args.tp else [n for n in (1, 2, 4) if n <= n_dev]
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "platform": dev.platform, "devices": n_dev, "jax": jax.__version__,
           "dtype": str(dtype), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "tp": tps,
           "bandwidth": [], "runs": []}
    path = os.path.join(out_dir, "bench_tp.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    for n in tps:
        res["bandwidth"].append(bandwidth(n, args.bw_mb, args.bw_repeats))
        print(f"[bench_tp] h2d {n} GPU(s) at once: {res['bandwidth'][-1]['per_gpu_gb_s']:.1f} GB/s per GPU", flush=True)
        save()
    wls = _workloads(False)
    for name in args.workloads.split(","):
        wl = wls[name]
        model = make_model(wl["shape"], dtype, wl["offload_weights"])
        ctx = wl["contexts"][0]
        for pol in args.policies.split(","):
            base = None
            for n in tps:
                opts = dict(schedule=wl["schedule"], gpu_batches=wl["gpu_batches"], offload_weights=wl["offload_weights"],
                            tensor_parallel=n)
                if pol == "kvpr":
                    opts["kvpr_store"] = wl["kvpr_store"]
                t0 = time.perf_counter()
                try:
                    r = measure(model, pol, opts, wl["batch"], ctx, args.warmup, args.steps)
                except Exception as e:  # noqa: BLE001  (record and go on: one failing size must not lose the rest)
                    res["runs"].append({"workload": name, "policy": pol, "tp": n, "error": f"{type(e).__name__}: {e}"})
                    print(f"[bench_tp] {name} {pol} tp={n}: {type(e).__name__}: {e}", flush=True)
                    save()
                    continue
                r.pop("trace", None)
                tput = wl["batch"] / r["step_s"]
                base = tput if n == 1 else base
                row = {"workload": name, "shape": wl["shape"], "batch": wl["batch"], "context": ctx, "policy": pol,
                       "tp": n, "step_s": r["step_s"], "tokens_per_s": tput,
                       "speedup_vs_1": (tput / base) if base else None, "wall_s": time.perf_counter() - t0, **r}
                res["runs"].append(row)
                print(f"[bench_tp] {name} {pol} tp={n}: {r['step_s'] * 1e3:.1f} ms/step, {tput:.0f} tok/s"
                      + (f", {row['speedup_vs_1']:.2f}x vs 1" if row["speedup_vs_1"] else ""), flush=True)
                save()
        del model
        gc.collect()
    print(json.dumps([{k: r.get(k) for k in ("workload", "policy", "tp", "step_s", "tokens_per_s", "speedup_vs_1",
                                             "error")} for r in res["runs"]], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
