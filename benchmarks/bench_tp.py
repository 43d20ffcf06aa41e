"""Tensor-parallel decode benchmark: `offload`, `kvpr` (and `hybrid` with --policies) decode
throughput on 1, 2 and 4 GPUs of one host (random weights in OPT-6.7B b64 P512 and OPT-13B shapes), and each GPU's host->GPU bandwidth
alone and with every link active at once. One call; JSON to --out.

    PYTHONPATH=src python benchmarks/bench_tp.py --out $OUT            # 1, 2 and 4 GPUs where present
    PYTHONPATH=src python benchmarks/bench_tp.py --tp 1,2 --workloads opt67b --out $OUT
    PYTHONPATH=src python benchmarks/bench_tp.py --tp 2,4 --workloads opt67b --policies kvpr --sweep-splits --out $OUT
    PYTHONPATH=src python benchmarks/bench_tp.py --workloads opt13b_col --policies offload,kvpr,hybrid --out $OUT
    PYTHONPATH=src python benchmarks/bench_tp.py --processes --profile $OUT --tp 1,2,4 --policies kvpr --out $OUT/proc

Each (workload, policy, N) is `kvoffload.offload.bench.measure` (prefill, warm-up steps, timed steps each
ending when its tokens are on the host) with tensor_parallel=N: heads, weights and the pinned host pool
split over N GPUs, each moving its heads' blocks over its own link. Throughput = batch / median step time;
speedup = throughput(N) / throughput(1). The bandwidth probe moves a pinned_host array sharded over the N
GPUs (one `size_mb` shard per GPU) to device memory with one eager device_put and reports GB/s per GPU and
in total, against one GPU alone: when the N links together fall short of N times one link, the host's
memory bandwidth (or the PCIe switch) caps them and tensor parallelism cannot scale past that. Each row says
so (`link_terms`): its transfer floor (its step's host->GPU bytes per GPU at the N-link rate) and the links' cap
on its speed-up, N x rate(N) / rate(1) (4x H100 hosts: ~2.9x at N=4).

kvpr's scheduler prices one device of the mesh (plan/cost.py: 1/N of X and K/V over its link, 1/N of the
recompute, and the NVLink exchange recomputing needs: X is split by token, so each device recomputes every
head of its tokens and the devices swap partial softmaxes). With --profile auto (the default) each
(shape, N) is first profiled on the N-GPU mesh (`plan.profiler.run_profile(tensor_parallel=N)`, quick:
transfers with every link busy, compute, the collectives; JSON beside the results) and both policies run
with that profile; each kvpr row reports the split it chose, the predicted step (the last step's record)
against the measured one, and the predicted exchange. `hybrid` (HybridServe: weights streamed, each
request's blocks split into host KV, host ACT and GPU-resident ACT blocks by its per-device cost model)
runs under a GPU budget per device (--hybrid-gpu-budget-gb, the 24 GB card of bench_hybrid.py; its GPU-
resident blocks would otherwise fill the card and nothing would be offloaded); each hybrid row reports
its blocks of each class and the mini-batches, the predicted step and exchange against the measured. --sweep-splits also runs kvpr at every forced
split (0 .. all extents in use) per N, so the chosen split can be checked against the measured best.

--processes runs each N as N processes on this host, one GPU each (`jax.distributed`, the way a multi-host
user runs it; CUDA_VISIBLE_DEVICES picks each process's GPU), instead of one process driving N GPUs: each GPU
then has its own host thread for its transfers and launches (one process dispatching to 4 GPUs spent ~1.75 ms
per layer launching). The parent only starts the processes and joins process 0's JSON (rows tagged
"processes": N; the 1-GPU row is one process on GPU 0). It needs measured profiles (--profile DIR, e.g. an
earlier single-process run's --out, or none): the profiler and the bandwidth probe run single-process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
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

    from kvoffload.device import sharding as S

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


def link_terms(row: dict, bandwidths) -> dict:
    """What this host's links allow a row on N GPUs (bandwidths: the `bandwidth` probes): the step's transfer floor
    (the host->GPU bytes its last step moved, per GPU, at the probe's per-GPU rate with N links busy) and the
    speed-up over one GPU that a step bound by those bytes can reach, N x rate(N) / rate(1): where the links
    together fall short of N times one, no policy scales past it on this host."""
    rate = {b["gpus"]: b["per_gpu_gb_s"] * 1e9 for b in bandwidths}
    n, out = row["tp"], {}
    if n in rate and 1 in rate:
        out["links_cap_vs_1"] = n * rate[n] / rate[1]
    moved = (row.get("plan") or {}).get("bytes_h2d")
    if moved and n in rate:
        out["transfer_floor_s"] = moved / n / rate[n]
    return out


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
    ap.add_argument("--profile", default="auto",
                    help="auto: profile each (shape, N) on the mesh first and run with it; none: the built-in "
                         "default cost model; a folder: reuse its profile_<shape>_tp<N>.json where one was measured on "
                         "this kind of GPU (else profile as auto); or a profile JSON for every N")
    ap.add_argument("--hybrid-gpu-budget-gb", type=float, default=24.0,
                    help="hybrid: the GPU memory per device its plan may use (GPU-resident blocks included); 0: "
                         "the free memory")
    ap.add_argument("--hybrid-gpu-blocks", default="auto",
                    help="hybrid: GPU-resident blocks (auto: as many as the budget holds; 0: every block on the host)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a policy option for every run (value as JSON, else a string), e.g. extent_mb=256")
    ap.add_argument("--sweep-splits", action="store_true",
                    help="kvpr: also time every forced split 0..extents in use at each N (measured best vs chosen)")
    ap.add_argument("--processes", action="store_true",
                    help="run each N as N processes, one GPU each (jax.distributed on this host); needs --profile DIR or none")
    # one process of a --processes run (set by the parent)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from _common import parse_options

    options = parse_options(args.option)
    if args.processes:
        return run_processes(args)

    import jax
    import jax.numpy as jnp

    if args.coordinator:
        if os.environ.get("JAX_PLATFORMS") == "cpu":  # CPU collectives across processes (the tests)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    lead = jax.process_index() == 0  # under jax.distributed only process 0 writes and prints

    from kvoffload.offload.bench import _workloads, make_model, measure
    from kvoffload.plan.profiler import model_shape, run_profile, write_profile

    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    n_dev = len(jax.devices())
    tps = [int(x) for x in args.tp.split(",")] if args.tp else [n for n in (1, 2, 4) if n <= n_dev]
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "platform": dev.platform, "devices": n_dev, "jax": jax.__version__,
           "dtype": str(dtype), "options": options, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "tp": tps,
           "bandwidth": [], "profiles": {}, "runs": []}
    path = os.path.join(out_dir, "bench_tp.json")

    def save():
        if lead:
            with open(path, "w") as f:
                json.dump(res, f, indent=1, default=str)

    def profile_for(wl, n):
        """The profile JSON kvpr and offload run with at N GPUs (None: the default cost model)."""
        if args.profile == "none":
            return None
        name = f"profile_{wl['shape']}_tp{n}.json"
        if os.path.isdir(args.profile):  # an earlier run's profiles: reused where measured on this GPU model
            old = os.path.join(args.profile, name)
            if os.path.exists(old):
                with open(old) as f:
                    measured_on = json.load(f).get("device")
                if measured_on == jax.devices()[0].device_kind:
                    print(f"[bench_tp] tp={n}: reusing {old} ({measured_on})", flush=True)
                    return old
        elif args.profile != "auto":
            return args.profile
        p = os.path.join(out_dir, name)
        if p not in res["profiles"]:
            prof = run_profile(model_shape(wl["shape"]), wl["batch"] // wl["gpu_batches"], str(dtype), quick=True,
                               progress=lambda m: print(f"[bench_tp] profile tp={n}: {m}", flush=True),
                               tensor_parallel=n)
            write_profile(prof, p)
            res["profiles"][p] = prof["fits"]
            save()
        return p

    def run_one(name, wl, model, pol, n, extra=None):
        ctx = wl["contexts"][0]
        opts = dict(schedule=wl["schedule"], gpu_batches=wl["gpu_batches"], offload_weights=wl["offload_weights"],
                    tensor_parallel=n, **options, **(extra or {}))
        if pol == "kvpr":
            opts["kvpr_store"] = wl["kvpr_store"]
        if pol == "hybrid" and args.hybrid_gpu_budget_gb > 0:
            opts["gpu_memory_limit_gb"] = args.hybrid_gpu_budget_gb
        if pol == "hybrid":
            opts["gpu_blocks"] = args.hybrid_gpu_blocks if args.hybrid_gpu_blocks == "auto" else int(args.hybrid_gpu_blocks)
        prof = profile_for(wl, n)
        if prof:
            opts["profile"] = prof
        t0 = time.perf_counter()
        try:
            r = measure(model, pol, opts, wl["batch"], ctx, args.warmup, args.steps)
        except Exception as e:  # noqa: BLE001  (record and go on: one failing size must not lose the rest)
            row = {"workload": name, "policy": pol, "tp": n, **(extra or {}), "error": f"{type(e).__name__}: {e}"}
            res["runs"].append(row)
            print(f"[bench_tp] {name} {pol} tp={n} {extra or ''}: {type(e).__name__}: {e}", flush=True)
            save()
            return None
        r.pop("trace", None)
        plan = r.get("plan") or {}
        row = {"workload": name, "shape": wl["shape"], "batch": wl["batch"], "context": ctx, "policy": pol, "tp": n,
               **(extra or {}), "step_s": r["step_s"], "tokens_per_s": wl["batch"] / r["step_s"],
               "recompute_extents": plan.get("recompute_extents"), "used_extents": plan.get("used_extents"),
               "predicted_step_s": plan.get("predicted_s"), "predicted_gather_s": plan.get("predicted_gather_s"),
               "bytes_gather": plan.get("bytes_gather"), "split_reason": plan.get("split_reason"),
               "profile": prof, "wall_s": time.perf_counter() - t0, **r}
        if row["predicted_step_s"]:
            row["predicted_over_measured"] = row["predicted_step_s"] / r["step_s"]
        if plan.get("gpu_batches"):  # hybrid: the blocks of each class over its mini-batches (the last step)
            mbs = plan["gpu_batches"]
            row["blocks"] = {k: sum(m.get(k, 0) for m in mbs) for k in ("kv_host", "act_host", "act_gpu", "kv_gpu")}
            row["mini_batches"] = len(mbs)
        row.update(link_terms(row, res["bandwidth"]))
        res["runs"].append(row)
        save()
        return row

    def say(row, base):
        if row is None:
            return
        line = f"[bench_tp] {row['workload']} {row['policy']} tp={row['tp']}"
        if "split_point" in row:
            line += f" forced split_point={row['split_point']}"
        line += f": {row['step_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tok/s"
        if base and "split_point" not in row:
            line += f", {row['speedup_vs_1']:.2f}x vs 1"
            if row.get("links_cap_vs_1"):
                line += f" (the host's links cap {row['links_cap_vs_1']:.2f}x)"
        if row.get("transfer_floor_s"):
            line += f", transfer floor {row['transfer_floor_s'] * 1e3:.1f} ms"
        if row["policy"] == "kvpr":
            line += (f"; split {row['recompute_extents']}/{row['used_extents']} extents recomputed, predicted "
                     f"{(row['predicted_step_s'] or 0) * 1e3:.1f} ms (exchange {(row['predicted_gather_s'] or 0) * 1e3:.1f} ms,"
                     f" {(row['bytes_gather'] or 0) / 1e6:.2f} MB per GPU) vs measured {row['step_s'] * 1e3:.1f} ms")
        if row["policy"] == "hybrid" and row.get("blocks"):
            line += (f"; blocks {row['blocks']} in {row['mini_batches']} mini-batches, predicted "
                     f"{(row['predicted_step_s'] or 0) * 1e3:.1f} ms (exchange {(row['predicted_gather_s'] or 0) * 1e3:.1f} ms)"
                     f" vs measured {row['step_s'] * 1e3:.1f} ms")
        if lead:
            print(line, flush=True)

    for n in tps if not args.coordinator else ():  # the probe runs single-process
        res["bandwidth"].append(bandwidth(n, args.bw_mb, args.bw_repeats))
        print(f"[bench_tp] h2d {n} GPU(s) at once: {res['bandwidth'][-1]['per_gpu_gb_s']:.1f} GB/s per GPU", flush=True)
        save()
    wls = _workloads(False)
    for name in args.workloads.split(","):
        wl = wls[name]
        model = make_model(wl["shape"], dtype, wl["offload_weights"])
        for pol in args.policies.split(","):
            base = None
            for n in tps:
                row = run_one(name, wl, model, pol, n)
                if row is not None:
                    base = row["tokens_per_s"] if n == 1 else base
                    row["speedup_vs_1"] = row["tokens_per_s"] / base if base else None
                    save()
                say(row, base)
                if pol != "kvpr" or not args.sweep_splits or row is None or not row["used_extents"]:
                    continue
                # every split the layout allows: extents hold equal token ranges of every sequence
                used, ctx = row["used_extents"], wl["contexts"][0]
                swept = {row["recompute_extents"]: (row["step_s"], row["predicted_step_s"])}  # r: (measured, predicted)
                for k in range(used + 1):
                    if k == row["recompute_extents"]:
                        continue
                    forced = run_one(name, wl, model, pol, n, {"split_point": ctx * k // used})
                    say(forced, None)
                    if forced is not None:
                        swept.setdefault(forced["recompute_extents"], (forced["step_s"], forced["predicted_step_s"]))
                best = min(swept, key=lambda k: swept[k][0])
                row["sweep"] = {str(k): {"measured_s": m, "predicted_s": p} for k, (m, p) in sorted(swept.items())}
                row["measured_best_split"] = best
                save()
                print(f"[bench_tp] {name} kvpr tp={n}: chose {row['recompute_extents']}/{used}, measured best {best}/{used}; "
                      "r: measured/predicted ms " + " ".join(f"{k}: {m * 1e3:.1f}/{(p or 0) * 1e3:.1f}"
                                                            for k, (m, p) in sorted(swept.items())), flush=True)
        del model
        gc.collect()
    print(json.dumps([{k: r.get(k) for k in ("workload", "policy", "tp", "split_point", "step_s", "tokens_per_s",
                                             "speedup_vs_1", "links_cap_vs_1", "transfer_floor_s", "recompute_extents",
                                             "used_extents", "predicted_step_s", "blocks",
                                             "measured_best_split", "error")} for r in res["runs"]], indent=1))
    return 0


def run_processes(args) -> int:
    """--processes: each N of --tp as N processes of this script (one GPU each, jax.distributed with a coordinator
    on this host; N=1 one process on GPU 0); joins process 0's rows, tagged "processes": N, with the speed-up
    against the 1-GPU row."""
    if args.profile == "auto":
        raise SystemExit("--processes runs with measured profiles: give --profile DIR (an earlier single-process "
                         "run's --out, whose profile_<shape>_tp<N>.json it reuses) or --profile none")
    if not args.tp:
        raise SystemExit("--processes needs --tp (the GPU counts to run, e.g. 1,2,4)")
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    cpu = os.environ.get("JAX_PLATFORMS") == "cpu"
    merged = {"mode": "processes", "tp": [int(x) for x in args.tp.split(",")], "bandwidth": [], "profiles": {}, "runs": []}
    for n in merged["tp"]:
        sub_out = os.path.join(out_dir, f"processes_{n}")
        os.makedirs(sub_out, exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--tp", str(n), "--workloads", args.workloads, "--policies",
               args.policies, "--dtype", args.dtype, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--bw-mb", str(args.bw_mb), "--bw-repeats", str(args.bw_repeats), "--profile", args.profile,
               "--hybrid-gpu-budget-gb", str(args.hybrid_gpu_budget_gb), "--hybrid-gpu-blocks", args.hybrid_gpu_blocks,
               "--out", sub_out] + (["--sweep-splits"] if args.sweep_splits else []) + \
            [x for o in args.option for x in ("--option", o)]
        if n > 1:
            with socket.socket() as s:
                s.bind(("localhost", 0))
                port = s.getsockname()[1]
            cmd += ["--coordinator", f"localhost:{port}", "--num-processes", str(n)]
        procs, logs = [], []
        for i in range(n):
            env = dict(os.environ)
            if cpu:
                env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
            else:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            logs.append(open(os.path.join(sub_out, f"process_{i}.log"), "w"))
            procs.append(subprocess.Popen(cmd + (["--process-id", str(i)] if n > 1 else []), env=env,
                                          stdout=None if i == 0 else logs[-1], stderr=logs[-1], text=True))
        rcs = [p.wait() for p in procs]
        for f in logs:
            f.close()
        if any(rcs):
            print(f"[bench_tp] {n} processes: exit codes {rcs}; logs in {sub_out}", flush=True)
            merged["runs"].append({"tp": n, "processes": n, "error": f"exit codes {rcs} (logs: {sub_out})"})
            continue
        with open(os.path.join(sub_out, "bench_tp.json")) as f:
            child = json.load(f)
        for k in ("device", "platform", "jax", "dtype", "date"):
            merged.setdefault(k, child.get(k))
        merged["bandwidth"] += child.get("bandwidth", [])
        merged["profiles"].update(child.get("profiles", {}))
        merged["runs"] += [{**r, "processes": n} for r in child["runs"]]
    base = {(r["workload"], r["policy"]): r["tokens_per_s"] for r in merged["runs"]
            if r.get("tp") == 1 and "split_point" not in r and r.get("tokens_per_s")}
    for r in merged["runs"]:
        key = (r.get("workload"), r.get("policy"))
        if r.get("tokens_per_s") and key in base and "split_point" not in r:
            r["speedup_vs_1"] = r["tokens_per_s"] / base[key]
            print(f"[bench_tp] {key[0]} {key[1]} {r['tp']} process(es): {r['step_s'] * 1e3:.1f} ms/step, "
                  f"{r['speedup_vs_1']:.2f}x vs 1", flush=True)
    with open(os.path.join(out_dir, "bench_tp.json"), "w") as f:
        json.dump(merged, f, indent=1, default=str)
    return 1 if any("error" in r for r in merged["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
