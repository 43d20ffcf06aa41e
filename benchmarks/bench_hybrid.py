#!/usr/bin/env python
"""HybridServe benchmark: `hybrid` vs KV-only and ACT-only, a KV:ACT ratio sweep, `kvpr`
and FlexGen, one model shape per call (random weights in the real shapes, weights in host memory).

    PYTHONPATH=src python benchmarks/bench_hybrid.py --model opt-13b --flexgen --out $OUT
    PYTHONPATH=src python benchmarks/bench_hybrid.py --model opt-30b --ratios 0,1 --flexgen --out $OUT
    python benchmarks/plot_hybrid.py $OUT/bench_hybrid_opt-13b.json      # the plot (here, no GPU needed)

Method. Every configuration runs under the same budgets: GPU memory `--gpu-budget-gb` (24: the
paper's card; the planner counts weights in flight, transfer buffers, GPU tails, GPU-resident
blocks and the prefill's workspace) and host memory (what the machine has free after the weights,
less `--host-reserve-gb`). Each configuration serves the largest batch of prompt P + gen G requests
its allocation fits in both (found with the planner, which refuses before allocating), prefills it,
runs `--warmup` decode steps and times `--steps` more (each ends with its tokens on the host);
decode throughput = batch / median step. The configurations: `hybrid` (the balanced split of the
cost model, GPU-resident ACT blocks in the GPU budget), the host ACT share forced to each of
`--ratios` (0 = KV-only, 1 = ACT-only; the same runtime), `kvpr` (split store) and FlexGen (its own
code in a subprocess before JAX starts, benchmarks/bench_flexgen.py, its own policy search's config for
the budget and a GPU-attention variant). Per configuration the cost model's prediction of the step
is recorded beside the measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

# XLA's pinned pool grows by doubling regions: cap it below the machine's memory, or one growth step
# past the free memory gets the process killed
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "100")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402

FLEXGEN = {  # FlexGen's own policy search for the 24 GB budget (benchmarks/bench_flexgen.py), and attention on the GPU
    "opt-13b": ["opt-13b:68,32,0,100,0,100:32x5:cpu", "opt-13b:68,32,0,100,0,100:32x4"],
    "opt-30b": ["opt-30b:31,69,0,100,0,100:4x15:cpu", "opt-30b:31,69,0,100,0,100:16x4"],
}


def log(msg):
    print(f"[bench_hybrid] {msg}", file=sys.stderr, flush=True)


def run_flexgen(model: str, out_dir: str, budget_gb: float, prompt: int, gen: int, timeout: int, configs=None) -> dict:
    path = os.path.join(out_dir, f"bench_flexgen_{model}.json")
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_flexgen.py"),
           "--gpu-mem-budget-gb", str(budget_gb), "--prompt-len", str(prompt), "--gen-len", str(gen),
           "--out", path, "--timeout-s", str(timeout), "--total-timeout-s", str(timeout * 2 + 30)]
    for c in configs or FLEXGEN[model]:
        cmd += ["--config", c]
    log("FlexGen: " + " ".join(cmd[1:]))
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(r.stderr[-4000:])
    log(f"FlexGen done in {time.time() - t:.0f} s (rc {r.returncode})")
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "stderr": r.stderr[-2000:]}


def flexgen_best(fg: dict) -> dict | None:
    ok = [r for r in fg.get("results", []) if r.get("status") == "ok" and r.get("decode_throughput_tok_s")]
    return max(ok, key=lambda r: r["decode_throughput_tok_s"]) if ok else None


def largest_batch(pol, model, prompt: int, gen: int, hi: int) -> tuple[int, str]:
    """The largest batch whose plan fits the budgets (binary search; the planner allocates nothing)."""
    from kvoffload.errors import KVOffloadError

    cap = prompt + gen

    def fits(b):
        try:
            pol.pipeline.plan(model, np.full(b, prompt), prompt, cap)
            return True
        except (KVOffloadError, ValueError):
            return False

    lo = 0
    if fits(hi):
        return hi, "cap"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        return 0, "nothing fits"
    return lo, "budget"


def traced_step(pol, model, state, nxt, out_dir: str, name: str) -> str | None:
    """One more decode step under jax.profiler.trace; the .xplane.pb is copied to out_dir (a device
    call brings back files at most two folders down)."""
    import glob
    import shutil
    import tempfile

    import jax

    tmp = tempfile.mkdtemp()
    with jax.profiler.trace(tmp):
        logits, state = pol.decode_step(model, state, nxt)
        jax.block_until_ready(logits)
    found = sorted(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True))
    if not found:
        return None
    dest = os.path.join(out_dir, f"trace_{name.replace(' ', '_')}.xplane.pb")
    shutil.copy(found[-1], dest)
    return dest


def measure(pol, model, batch: int, prompt: int, gen: int, warmup: int, steps: int, trace_to=None) -> dict:
    import jax.numpy as jnp

    from kvoffload.offload.bench import timed_decode

    cfg = model.config
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size - 1, (batch, prompt)), jnp.int32)
    prefill_s, times, logits, state, nxt = timed_decode(pol, model, tokens, np.full(batch, prompt), prompt + gen,
                                                        warmup + steps)
    trace = traced_step(pol, model, state, nxt, *trace_to) if trace_to else None
    rec = dict(state.records[-1])
    step = float(np.median(times[warmup:]))
    out = {"batch": batch, "prefill_s": prefill_s, "step_times_s": times, "step_s": step, "tok_s": batch / step,
           "predicted_step_s": rec.get("predicted_s"), "predicted_tok_s": batch / rec["predicted_s"] if rec.get("predicted_s") else None,
           "record": rec, "memory_plan": pol.pipeline.memory_plan.describe() if pol.pipeline.memory_plan else None,
           "describe": pol.describe(None), "profiler_trace": trace}
    out["bytes_h2d_per_step"] = rec.get("bytes_h2d")
    del state, logits
    gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="opt-13b", help="opt-13b | opt-30b | opt-6.7b (random weights in that shape)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--gpu-budget-gb", type=float, default=24.0)
    ap.add_argument("--host-reserve-gb", type=float, default=5.0, help="host memory left free beside the pool")
    ap.add_argument("--mini-batch-gb", type=float, default=0.5, help="hybrid's transfer buffer per mini-batch")
    ap.add_argument("--ratios", default="0,0.167,0.333,0.5,0.667,0.833,1", help="forced host ACT shares to sweep")
    ap.add_argument("--no-kvpr", action="store_true")
    ap.add_argument("--flexgen", action="store_true", help="run FlexGen first (needs peers/FlexLLMGen)")
    ap.add_argument("--flexgen-config", action="append", default=None)
    ap.add_argument("--flexgen-timeout", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=2048)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--resident-layers", type=int, default=0, help="layers whose weights stay on the GPU")
    ap.add_argument("--trace", default="", help="comma list of configuration names (e.g. act-only) whose "
                    "one extra step is captured with jax.profiler into $OUT/trace_<name>.xplane.pb")
    ap.add_argument("--time-limit-s", type=float, default=540, help="skip what is left after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    fg = run_flexgen(args.model, args.out, args.gpu_budget_gb, args.prompt, args.gen, args.flexgen_timeout,
                     args.flexgen_config) if args.flexgen else None

    import jax
    import jax.numpy as jnp

    from kvoffload.device import memory as M
    from kvoffload.offload.bench import make_model
    from kvoffload.plan.profiler import model_shape, run_profile, write_profile
    from kvoffload.policies import make_policy

    dev = M.default_device()
    cfg = model_shape(args.model)
    path = os.path.join(args.out, f"bench_hybrid_{args.model}.json")
    res = {"device": dev.device_kind, "jax": jax.__version__, "model": args.model, "prompt": args.prompt,
           "gen": args.gen, "gpu_budget_gb": args.gpu_budget_gb,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "method": __doc__.split("Method.")[1].strip(),
           "flexgen": fg, "rows": []}

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    prof = run_profile(cfg, 64, "bfloat16", quick=True, progress=lambda m: log(f"profile: {m}"))
    ppath = os.path.join(args.out, f"profile_{args.model}.json")
    write_profile(prof, ppath)
    model = make_model(args.model, jnp.bfloat16, offload_weights=True)
    from kvoffload.plan.memory import weight_bytes

    w_gb = cfg.num_layers * weight_bytes(cfg, jnp.bfloat16, model.params).per_layer / 1e9
    cap_gb = float(os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) * 2**30 / 1e9
    host_gb = min((M.available_host_bytes() or 0) / 1e9 - args.host_reserve_gb, cap_gb - w_gb - args.host_reserve_gb)
    res["host_budget_gb"] = host_gb
    log(f"{dev.device_kind}: model {args.model} in host memory; host budget {host_gb:.1f} GB, GPU budget "
        f"{args.gpu_budget_gb} GB")
    base = dict(block_tokens=args.block_tokens, profile=ppath, host_memory_limit_gb=host_gb,
                gpu_memory_limit_gb=args.gpu_budget_gb, offload_weights=True, schedule="column",
                resident_layers=args.resident_layers)
    mb = {"mini_batch_gb": args.mini_batch_gb}
    configs = [("hybrid", "hybrid", dict(mb))]
    for r in [float(x) for x in args.ratios.split(",") if x.strip()]:
        name = "kv-only" if r == 0 else "act-only" if r == 1 else f"act-share {r:.3f}"
        configs.append((name, "hybrid", {"act_share": r, **mb}))
    if not args.no_kvpr:
        configs.append(("kvpr", "kvpr", {"kvpr_store": "split", "gpu_batches": 4}))
    for name, policy, opts in configs:
        left = args.time_limit_s - (time.time() - t_start)
        if left < 45:
            log(f"skipping {name}: {left:.0f} s left")
            res["rows"].append({"name": name, "skipped": "time limit"})
            continue
        try:
            pol = make_policy(policy, **base, **opts)
            b, why = largest_batch(pol, model, args.prompt, args.gen, args.max_batch)
            if b == 0:
                raise RuntimeError("no batch fits the budgets")
            log(f"{name}: batch {b} ({why})")
            trace_to = (args.out, name) if name in args.trace.split(",") else None
            row = {"name": name, "policy": policy, "options": opts, **measure(pol, model, b, args.prompt, args.gen,
                                                                              args.warmup, args.steps, trace_to)}
            log(f"{name}: batch {b}: {row['step_s'] * 1e3:.0f} ms/step, {row['tok_s']:.1f} tok/s "
                f"(predicted {row['predicted_tok_s'] or 0:.1f}), prefill {row['prefill_s']:.1f} s")
        except Exception as e:  # noqa: BLE001  (keep the other numbers)
            row = {"name": name, "policy": policy, "options": opts, "error": f"{type(e).__name__}: {str(e)[:800]}"}
            log(f"{name}: FAILED {row['error']}")
        res["rows"].append(row)
        save()
        del pol
        gc.collect()
    res["summary"] = summarize(res)
    save()
    print(json.dumps(res["summary"], indent=1))
    log(f"done in {time.time() - t_start:.0f} s")
    return 0


def summarize(res) -> dict:
    ok = {r["name"]: r for r in res["rows"] if "tok_s" in r}
    s = {k: {"batch": r["batch"], "tok_s": r["tok_s"], "predicted_tok_s": r.get("predicted_tok_s")} for k, r in ok.items()}
    out = {"throughput": s}
    if "hybrid" in ok:
        h = ok["hybrid"]["tok_s"]
        for k in ("kv-only", "act-only"):
            if k in ok:
                out[f"hybrid_over_{k}"] = h / ok[k]["tok_s"]
        sweep = {k: r for k, r in ok.items() if k != "kvpr"}
        best = max(sweep.values(), key=lambda r: r["tok_s"])
        out["best_measured"] = {"name": best["name"], "tok_s": best["tok_s"]}
        out["hybrid_vs_best_measured"] = h / best["tok_s"]
        out["predicted_error"] = {k: r["predicted_tok_s"] / r["tok_s"] - 1 for k, r in ok.items() if r.get("predicted_tok_s")}
        fb = flexgen_best(res.get("flexgen") or {})
        if fb:
            out["flexgen_best"] = {"config": fb.get("config"), "decode_tok_s": fb["decode_throughput_tok_s"]}
            out["hybrid_over_flexgen"] = h / fb["decode_throughput_tok_s"]
        if "kvpr" in ok:
            out["hybrid_over_kvpr"] = h / ok["kvpr"]["tok_s"]
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
