"""Decode benchmark: full, offload, kvpr, the cost model's prediction for each, and HF transformers'
offloaded / on-GPU caches on the same shapes (random weights in real shapes). `kvoffload bench` and
scripts/bench_decode.py run it; one call prints a table last and writes JSON.

Method. A step's time is affine in the context length s (attention and K/V transfer grow with s,
the rest is constant), so for each policy and batch the benchmark prefills at a few contexts s,
runs `warmup` decode steps (compilation) and times `steps` more, one by one (each ends when its
greedy tokens are on the host, as in generation), fits t(s) = a + b s to the per-step medians,
and reports decode time for (prompt P, gen G) as sum_{t<G} t(P + t) = G t(P + (G-1)/2). It does
not generate all G tokens (that would not fit one device call). The HF baseline is timed as
(generate(1 + n) - generate(1)) / n in a separate process (so JAX and torch do not share the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

from kvoffload.errors import check_finite_result

QUICK_WORKLOADS = ["opt67b", "llama8b"]


def _workloads(quick: bool):
    w = {
        "opt67b": dict(shape="opt-6.7b", batch=64, gpu_batches=1, schedule="row", offload_weights=False,
                       prompts=(512, 1024), gens=(32, 128), contexts=(512,) if quick else (512, 1024, 1152),
                       policies=("full", "offload", "kvpr"), hf=True, kvpr_store="both"),
        "opt13b_col": dict(shape="opt-13b", batch=128, gpu_batches=4, schedule="column", offload_weights=True,
                           prompts=(512,), gens=(32,), contexts=(512,), policies=("offload", "kvpr"), hf=False,
                           kvpr_store="split"),
        "llama8b": dict(shape="llama-3-8b", batch=32, gpu_batches=1, schedule="row", offload_weights=False,
                        prompts=(1024,), gens=(32,), contexts=(1024,), policies=("full", "offload", "kvpr"),
                        hf=False, kvpr_store="both"),
        # a ragged batch: prompts 512-2048 tokens (the pool moves only real blocks)
        "opt67b_ragged": dict(shape="opt-6.7b", batch=64, gpu_batches=1, schedule="row", offload_weights=False,
                              prompts=(2048,), gens=(32,), contexts=(2048,), policies=("offload",), hf=False,
                              kvpr_store="both", lengths=tuple(int(x) for x in np.linspace(512, 2048, 64))),
        # CPU smoke test of the whole path (tests, `kvoffload bench --workloads tiny`)
        "tiny": dict(shape="tiny-opt", batch=4, gpu_batches=2, schedule="column", offload_weights=True,
                     prompts=(64,), gens=(8,), contexts=(64, 128), policies=("offload", "kvpr"), hf=True,
                     kvpr_store="both"),
        "tiny_row": dict(shape="tiny-opt", batch=4, gpu_batches=1, schedule="row", offload_weights=False,
                         prompts=(64,), gens=(8,), contexts=(64,), policies=("full", "offload", "kvpr"), hf=False,
                         kvpr_store="both"),
    }
    return w


# ------------------------------------------------------------------------------------------------
# HF transformers baseline (own process)
# ------------------------------------------------------------------------------------------------

HF_SNIPPET = r"""
import json, sys, time, torch, transformers
spec = json.loads(sys.argv[1])
cfg = transformers.AutoConfig.for_model(**spec["shape"])
dev = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if dev == "cuda" else torch.float32
torch.manual_seed(0)
with torch.device(dev):
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
model.eval()
B, P, n = spec["batch"], spec["prompt"], spec["steps"]
ids = torch.randint(4, cfg.vocab_size - 1, (B, P), device=dev)
mask = torch.ones_like(ids)
out = {}
for cache in spec["caches"]:
    kw = {} if cache == "dynamic" else {"cache_implementation": cache}
    def run(k):
        if dev == "cuda": torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=0, **kw)
        if dev == "cuda": torch.cuda.synchronize()
        return time.perf_counter() - t
    try:
        run(2)  # warm-up
        t1 = run(1)
        tn = run(1 + n)
    except Exception as e:
        out[cache] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"[hf] {cache}: FAILED {out[cache]['error']}", file=sys.stderr, flush=True)
        continue
    out[cache] = {"step_s": (tn - t1) / n, "prefill_s": t1}
    print(f"[hf] {cache}: {(tn - t1) / n * 1e3:.1f} ms/step (prefill {t1:.2f} s)", file=sys.stderr, flush=True)
    if dev == "cuda": torch.cuda.empty_cache()
print("HFJSON" + json.dumps(out))
"""


def run_hf(shape: dict, batch: int, prompt: int, steps: int, caches=("offloaded", "dynamic"), python=None,
           timeout=240) -> dict:
    spec = json.dumps({"shape": shape, "batch": batch, "prompt": prompt, "steps": steps, "caches": list(caches)})
    py = python or os.environ.get("KVOFFLOAD_HF_PYTHON") or sys.executable
    try:
        r = subprocess.run([py, "-c", HF_SNIPPET, spec], capture_output=True, text=True, timeout=timeout)
    except Exception as e:  # pragma: no cover
        return {"error": f"{type(e).__name__}: {e}"}
    sys.stderr.write(r.stderr[-3000:])
    for line in r.stdout.splitlines():
        if line.startswith("HFJSON"):
            return json.loads(line[6:])
    return {"error": (r.stderr or r.stdout)[-800:]}


# ------------------------------------------------------------------------------------------------
# kvoffload policies
# ------------------------------------------------------------------------------------------------


def _greedy(logits):
    import jax
    import jax.numpy as jnp

    global _GREEDY
    if _GREEDY is None:
        _GREEDY = jax.jit(lambda x: jnp.argmax(x, -1).astype(jnp.int32))
    return _GREEDY(logits)


_GREEDY = None


def write_json(path, record) -> None:
    """A benchmark's record as indented JSON at path (its folder made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def parse_options(pairs) -> dict:
    """Command-line KEY=VALUE policy options ({key: value}; VALUE parsed as JSON, else kept a string)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--option takes key=value, got {pair!r}")
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def on_host(x):
    """x as a NumPy array; under jax.distributed a replicated array spanning processes (the greedy tokens of a
    multi-process mesh) is read from this process's own shard."""
    return np.asarray(x if getattr(x, "is_fully_addressable", True) else x.addressable_data(0))


def timed_decode(pol, model, tokens, lengths, capacity: int, n_steps: int, t0: float | None = None):
    """Prefill, then n_steps greedy decode steps each ending when its tokens are on the host (as a
    generation loop that reads every token). Returns (prefill seconds since t0, per-step seconds,
    logits, state, the last tokens)."""
    t0 = time.perf_counter() if t0 is None else t0
    logits, state = pol.prefill(model, tokens, lengths, capacity)
    nxt = _greedy(logits)
    on_host(nxt)
    prefill_s = time.perf_counter() - t0
    times, logits, state, nxt = decode_steps(pol, model, state, nxt, n_steps, logits)
    return prefill_s, times, logits, state, nxt


def add_random_prompt_args(ap, policy: str, shape: str, batch: int, prompt: int) -> None:
    """The command-line arguments of `random_prompt_state` (--policy, --shape, --batch, --prompt, --dtype,
    --option KEY=VALUE, repeated) with these defaults."""
    ap.add_argument("--policy", default=policy)
    ap.add_argument("--shape", default=shape, help="a named shape (plan.profiler.model_shape) or config.json")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--prompt", type=int, default=prompt)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a policy option")


_GAUGE_PROGRAM = None


def host_gauge(dispatches: int = 200, loop: int = 100_000) -> dict:
    """The host's speed now, by two fixed pieces of work: us per dispatch of a trivial jitted program on the
    default device (back to back, waited for once at the end: the host's cost, the device idle) and ns per turn
    of a fixed Python loop. A lent GPU host's speed moves ~2x over stretches of steps (BENCHMARKS, host
    cost); read before and after timed steps, these say whether a slow run had a slow host (both slower: the
    CPU; only the dispatch: the driver or the runtime)."""
    import jax
    import jax.numpy as jnp

    global _GAUGE_PROGRAM
    if _GAUGE_PROGRAM is None:
        _GAUGE_PROGRAM = jax.jit(lambda x: x + 1)
    x = jax.block_until_ready(_GAUGE_PROGRAM(jnp.zeros((8,), jnp.float32)))
    t = time.perf_counter()
    for _ in range(dispatches):
        x = _GAUGE_PROGRAM(x)
    jax.block_until_ready(x)
    dispatch_us = (time.perf_counter() - t) / dispatches * 1e6
    t = time.perf_counter()
    acc = 0
    for i in range(loop):
        acc += i & 7
    loop_ns = (time.perf_counter() - t) / loop * 1e9
    return {"dispatch_us": dispatch_us, "python_loop_ns": loop_ns}


def random_prompt_state(shape: str, policy: str, options: dict, batch: int, prompt: int, extra_tokens: int,
                        dtype="bfloat16", tensor_parallel: int = 1, seed: int = 0, model=None):
    """(model, policy, state, next tokens): random weights in the named shape (`make_model`; or `model`, one
    made before, so that two states share its weights), `policy` with `options` prefilled with a random prompt
    of `prompt` tokens per request, room for `extra_tokens` more."""
    import jax.numpy as jnp

    from kvoffload.policies import make_policy

    if model is None:
        model = make_model(shape, jnp.dtype(dtype), bool(options.get("offload_weights")))
    tokens = jnp.asarray(np.random.default_rng(seed).integers(4, model.config.vocab_size - 1, (batch, prompt)),
                         jnp.int32)
    pol = make_policy(policy, tensor_parallel=tensor_parallel, **options)
    logits, state = pol.prefill(model, tokens, jnp.full((batch,), prompt, jnp.int32), prompt + extra_tokens + 1)
    nxt = _greedy(logits)
    on_host(nxt)
    return model, pol, state, nxt


def decode_steps(pol, model, state, nxt, n_steps: int, logits=None, issued: list | None = None):
    """n_steps greedy decode steps from state and the tokens nxt, each ending when its tokens are on the
    host. Returns (per-step seconds, the last logits, state, the last tokens). issued (a list): per step, the
    seconds until decode_step returned, every program dispatched (a step ending right after is host-bound)."""
    from kvoffload.engine import frozen_gc

    times = []
    with frozen_gc():  # as `engine.generate` decodes
        for _ in range(n_steps):
            t = time.perf_counter()
            logits, state = pol.decode_step(model, state, nxt)
            if issued is not None:
                issued.append(time.perf_counter() - t)
            nxt = _greedy(logits)
            on_host(nxt)
            times.append(time.perf_counter() - t)
    return times, logits, state, nxt


def decode_windows(pol, model, state, nxt, n_windows: int, window: int):
    """n_windows windows of `window` greedy decode steps each, as `engine.generate` decodes (the host reads the
    device once a window, `engine.SYNC_EVERY` steps: it dispatches step t + 1 while the device runs step t, so a
    step costs the larger of its host and device times, not their sum up to the first program's dispatch).
    Returns (per-step seconds of each window: its wall time / window, state, the last tokens)."""
    from kvoffload.engine import frozen_gc

    per_step = []
    with frozen_gc():
        for _ in range(n_windows):
            t = time.perf_counter()
            for _ in range(window):
                logits, state = pol.decode_step(model, state, nxt)
                nxt = _greedy(logits)
            on_host(nxt)
            per_step.append((time.perf_counter() - t) / window)
    return per_step, state, nxt


def watch_layer_calls(pol, model, state, nxt):
    """One decode step with `runtime.layer.layer_step` watched: (the arguments of each layer call in order, the state
    after the step). The host probes re-run the real layer programs from these."""
    from kvoffload.runtime import layer as PL

    calls = []
    real = PL.layer_step

    def watched(*a):
        calls.append(a)
        return real(*a)

    PL.layer_step = watched
    try:
        _, state = pol.decode_step(model, state, nxt)
    finally:
        PL.layer_step = real
    return calls, state


def mulsum_linear(x, w, b=None):
    """x @ w (+ b) as an fp32 multiply and sum, in x's dtype: the form in which XLA reads a stacked weight's
    slice in place inside a loop (`use_mulsum_linear`)."""
    import jax.numpy as jnp

    y = jnp.sum(x.astype(jnp.float32)[..., :, None] * w.astype(jnp.float32), axis=-2)
    return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)


def use_mulsum_linear():
    """Runs the model families' linear layers as an fp32 multiply and sum from here on (the host probes'
    --linear mulsum, before anything compiles): inside a loop over stacked layers XLA reads a weight's slice
    in place in that form, where for its dot it writes the slice out in fp32 first (BENCHMARKS 'Host cost
    of a decode step'). Bits differ from the default einsum's (another summation order). Returns a function that puts
    the default back (for programs compiled after it)."""
    from kvoffload.models import common, llama, opt

    modules = (common, llama, opt)
    saved = [m.linear for m in modules]
    for m in modules:
        m.linear = mulsum_linear

    def restore():
        for m, f in zip(modules, saved):
            m.linear = f
    return restore


def time_variants(run, variants, steps: int, rounds: int, warmup: int = 1) -> dict:
    """Step timings of several variants in interleaved rounds (a lent host's speed moves over stretches: every
    variant sees it alike). run(variant) -> (out, issued s, wall s): one step, issued when the host has dispatched
    it. Per round and variant: warmup untimed steps, then `steps` timed. Returns per variant issued_ms and
    step_ms (each) with their medians and the step's minimum; prints each round's medians."""
    res = {v: {"issued_ms": [], "step_ms": []} for v in variants}
    for r in range(rounds):
        for v in variants:
            for _ in range(warmup):
                run(v)
            for _ in range(steps):
                _, issued, wall = run(v)
                res[v]["issued_ms"].append(1e3 * issued)
                res[v]["step_ms"].append(1e3 * wall)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{v} {np.median(res[v]['step_ms'][-steps:]):.2f} ms"
                                                    for v in variants), flush=True)
    return {v: dict(step_ms_median=float(np.median(d["step_ms"])), step_ms_min=float(np.min(d["step_ms"])),
                    issued_ms_median=float(np.median(d["issued_ms"])), **d) for v, d in res.items()}


def report_variants(rec: dict, out=None) -> dict:
    """Prints the table of rec["variants"] (`time_variants`' result), writes rec to out (when given) and
    returns it."""
    print("| variant | step ms (median) | min | host issued ms (median) |\n|---|--:|--:|--:|")
    for v, d in rec["variants"].items():
        print(f"| {v} | {d['step_ms_median']:.2f} | {d['step_ms_min']:.2f} | {d['issued_ms_median']:.2f} |")
    if out:
        write_json(out, rec)
    return rec


def median_time(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() until its outputs are ready (after warm-up calls)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def measure(model, policy_name, opts, batch, context, warmup, steps, seed=0, lengths=None, back_to_back=0):
    """Prefill at `context` (or ragged `lengths`), `warmup` decode steps, then `steps` timed steps, each
    ending when its greedy tokens are on the host (as a generation loop that reads every token), and
    with back_to_back > 0 also that many steps dispatched without a host read (one wait at the end)."""
    import jax.numpy as jnp

    from kvoffload.policies import make_policy

    cfg = model.config
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size - 1, (batch, context)), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    capacity = context + warmup + steps + back_to_back + 1
    t0 = time.perf_counter()
    # `full` takes the same pool options (same blocks and extents) but keeps everything on the device
    pol = make_policy(policy_name, **{k: v for k, v in opts.items() if policy_name != "full" or k != "offload_weights"})
    prefill_s, times, logits, state, nxt = timed_decode(pol, model, tokens, lengths, capacity, warmup + steps, t0)
    res = {"policy": policy_name, "context": context, "prefill_s": prefill_s, "step_times_s": times[warmup:],
           "step_s": float(np.median(times[warmup:])), "warmup_s": times[:warmup]}
    if back_to_back:
        from kvoffload.engine import frozen_gc

        t = time.perf_counter()
        with frozen_gc():
            for _ in range(back_to_back):
                logits, state = pol.decode_step(model, state, nxt)
                nxt = _greedy(logits)
        on_host(nxt)
        res["back_to_back_step_s"] = (time.perf_counter() - t) / back_to_back
    res["plan"] = dict(state.records[-1]) if state.records else None
    res["memory_plan"] = pol.pipeline.memory_plan.describe() if pol.pipeline.memory_plan else None
    res["trace"] = list(state.records)
    res["real_kv_bytes_per_layer"] = float(np.asarray(lengths).sum()) * cfg.kv_bytes_per_token * jnp.dtype(
        model.params.layers[0].wk.dtype).itemsize
    del state, logits, pol
    gc.collect()
    return res


def make_model(shape_name: str, dtype, offload_weights: bool, seed=0):
    """Random weights in the shape; offloaded layers are put in host memory one by one (never all
    on the GPU at once); all layers share one random draw (timing only)."""
    import jax

    from kvoffload.models import Model
    from kvoffload.models.transformer import init_params
    from kvoffload.device import memory as M
    from kvoffload.plan.profiler import model_shape

    cfg = model_shape(shape_name)
    one = dataclasses.replace(cfg, num_layers=1)
    p1 = init_params(one, jax.random.key(seed), dtype)
    lp = p1.layers[0]
    if offload_weights:
        layers = tuple(jax.block_until_ready(M.to_host(lp)) for _ in range(cfg.num_layers))
    else:
        layers = tuple(jax.tree.map(lambda a: a.copy(), lp) for _ in range(cfg.num_layers))
    params = dataclasses.replace(p1, layers=layers)
    jax.block_until_ready(params)
    return Model(cfg, params)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from kvoffload.device import memory as M
    from kvoffload.plan.cost import LayerShape, predict_step
    from kvoffload.plan.profiler import MODEL_SHAPES, model_shape, run_profile, write_profile
    from kvoffload.plan.memory import weight_bytes

    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    dtype = jnp.dtype(args.dtype)
    wl_all = _workloads(args.quick)
    names = args.workloads.split(",") if args.workloads else (
        QUICK_WORKLOADS if args.quick else [n for n in wl_all if not n.startswith("tiny")])
    hf = {}
    if not args.no_hf:  # first, in its own process, before JAX takes the GPU memory
        for name in names:
            wl = wl_all[name]
            if wl["hf"]:
                print(f"[bench] HF transformers {wl['shape']} batch {wl['batch']} prompt {wl['prompts'][0]}",
                      file=sys.stderr, flush=True)
                hf[name] = run_hf(MODEL_SHAPES[wl["shape"]], wl["batch"], wl["prompts"][0], args.hf_steps)
    dev = M.default_device()
    results = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "dtype": str(dtype),
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "quick": args.quick,
               "method": __doc__.split("Method.")[1].strip(), "workloads": {}}
    from kvoffload.provenance import make_provenance

    results["provenance"] = make_provenance(same={"workloads": {n: wl_all[n] for n in names}, "dtype": str(dtype)},
                                            info={"arguments": vars(args), "device": dev.device_kind})
    for name in names:
        wl = wl_all[name]
        cfg = model_shape(wl["shape"])
        print(f"[bench] {name}: {wl['shape']} batch {wl['batch']} ({wl['gpu_batches']} GPU batches, "
              f"{wl['schedule']}), weights {'offloaded' if wl['offload_weights'] else 'on GPU'}",
              file=sys.stderr, flush=True)
        sub_b = wl["batch"] // wl["gpu_batches"]
        prof = run_profile(cfg, sub_b, str(dtype), quick=True, progress=lambda m: print(f"[profile] {m}",
                                                                                       file=sys.stderr, flush=True))
        ppath = os.path.join(out_dir, f"profile_{name}.json")
        write_profile(prof, ppath)
        from kvoffload.plan.cost import CostModel

        cost = CostModel.from_fits(prof["fits"], prof["device"])
        model = make_model(wl["shape"], dtype, wl["offload_weights"])
        wb = weight_bytes(cfg, dtype, model.params)
        shape = LayerShape.of(cfg, dtype.itemsize, wb.per_layer, wb.kv_per_layer)
        rows = []
        for pol in wl["policies"]:
            for ctx in wl["contexts"]:
                opts = dict(schedule=wl["schedule"], offload_weights=wl["offload_weights"],
                            gpu_batches=wl["gpu_batches"], profile=ppath, block_tokens=64, sync_depth=args.sync_depth)
                if pol == "kvpr":
                    opts["kvpr_store"] = wl["kvpr_store"]
                if pol == "full" and wl["offload_weights"]:
                    continue
                print(f"[bench]   {pol} at context {ctx}", file=sys.stderr, flush=True)
                try:
                    r = measure(model, pol, opts, wl["batch"], ctx, args.warmup, args.steps,
                                lengths=wl.get("lengths"), back_to_back=args.back_to_back if pol == "full" else 0)
                except Exception as e:  # keep the other numbers
                    r = {"policy": pol, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:600]}"}
                    print(f"[bench]   FAILED: {r['error']}", file=sys.stderr, flush=True)
                    rows.append(r)
                    continue
                # a measurement that is not a number is not a result: refused before any file gets it
                check_finite_result(f"the measured step time of {pol} at context {ctx} ({name})",
                                    [r.get("step_s", float("nan")), r.get("prefill_s", 0.0)])
                l = (r.get("plan") or {}).get("split_point", 0) or 0
                # the pipeline's own prediction of the step it ran (its LayerWork: real blocks, extents,
                # recompute); the scalar model beside it for reference
                pred = predict_step(cost, cfg, shape, sub_b, ctx, l, offload_weights=wl["offload_weights"],
                                    gpu_batches=wl["gpu_batches"], policy=pol)
                r["predicted_step_s"] = (r.get("plan") or {}).get("predicted_s") or pred["step_s"]
                r["predicted_scalar_model"] = pred
                r["split_point"] = l
                if pol != "full":
                    moved = (r.get("plan") or {}).get("bytes_h2d", 0)
                    r["bytes_h2d"] = moved
                    r["bytes_over_bw_s"] = moved / cost.pcie_bw
                    kv_layer = (r.get("plan") or {}).get("bytes_kv", 0) / cfg.num_layers
                    r["moved_over_real_tokens"] = kv_layer / r["real_kv_bytes_per_layer"]
                    r["step_over_bytes_bw"] = r["step_s"] / r["bytes_over_bw_s"] if moved else None
                print(f"[bench]   {pol} ctx {ctx}: {r['step_s'] * 1e3:.1f} ms/step (model {pred['step_s'] * 1e3:.1f}), "
                      f"l={l}, prefill {r['prefill_s']:.1f} s", file=sys.stderr, flush=True)
                if pol == "kvpr" and args.trace and "trace" in r:
                    with open(os.path.join(out_dir, f"trace_{name}_kvpr_{ctx}.json"), "w") as f:
                        json.dump({"policy": "kvpr", "workload": name, "steps": r["trace"]}, f, indent=1)
                r.pop("trace", None)
                rows.append(r)
        del model
        gc.collect()
        results["workloads"][name] = {"spec": wl, "rows": rows, "hf": hf.get(name),
                                      "cost_model": cost.to_json(), "summary": summarize(wl, rows, hf.get(name))}
        with open(os.path.join(out_dir, "bench_decode.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def _fit(rows, pol, key="step_s"):
    pts = [(r["context"], r[key]) for r in rows if r.get("policy") == pol and key in r]
    if not pts:
        return None
    if len(pts) == 1:
        c, t = pts[0]
        return lambda s, c=c, t=t: t  # one context: no slope known
    xs, ys = np.array(pts, float).T
    b, a = np.polyfit(xs, ys, 1)
    return lambda s: a + b * s


def summarize(wl, rows, hf) -> list:
    """Per (prompt, gen): decode seconds of each policy, predicted, and the targets' ratios."""
    out = []
    for p in wl["prompts"]:
        for g in wl["gens"]:
            mid = p + (g - 1) / 2
            d = {"prompt": p, "gen": g}
            for pol in wl["policies"]:
                f, fp = _fit(rows, pol), _fit(rows, pol, "predicted_step_s")
                if f is not None:
                    d[f"{pol}_step_ms"] = f(mid) * 1e3
                    d[f"{pol}_decode_s"] = f(mid) * g
                    d[f"{pol}_tok_s"] = wl["batch"] / f(mid)
                if fp is not None:
                    d[f"{pol}_pred_step_ms"] = fp(mid) * 1e3
            fb = _fit(rows, "offload", "bytes_over_bw_s")
            if fb is not None:
                d["offload_bytes_over_bw_ms"] = fb(mid) * 1e3
            if "kvpr_step_ms" in d and "offload_step_ms" in d:
                d["kvpr_over_offload"] = d["kvpr_step_ms"] / d["offload_step_ms"]
            if "kvpr_pred_step_ms" in d and "kvpr_step_ms" in d:
                d["kvpr_vs_model"] = d["kvpr_step_ms"] / d["kvpr_pred_step_ms"] - 1
            if "offload_bytes_over_bw_ms" in d and "offload_step_ms" in d:
                d["offload_vs_bytes_bw"] = d["offload_step_ms"] / d["offload_bytes_over_bw_ms"] - 1
            if hf and p == wl["prompts"][0]:
                if "step_s" in hf.get("offloaded", {}) and "kvpr_step_ms" in d:
                    d["hf_offloaded_step_ms"] = hf["offloaded"]["step_s"] * 1e3
                    d["kvpr_speedup_vs_hf_offloaded"] = d["hf_offloaded_step_ms"] / d["kvpr_step_ms"]
                if "step_s" in hf.get("dynamic", {}) and "full_step_ms" in d:
                    d["hf_dynamic_step_ms"] = hf["dynamic"]["step_s"] * 1e3
                    d["full_speedup_vs_hf_dynamic"] = d["hf_dynamic_step_ms"] / d["full_step_ms"]
            out.append(d)
    return out


def table(results) -> str:
    lines = [f"device {results['device']} | jax {results['jax']} | {results['dtype']} | {results['date']}"]
    hdr = (f"{'workload':12s} {'P':>5s} {'G':>4s} | {'full':>7s} {'offload':>8s} {'kvpr':>7s} ms/step | "
           f"{'pred off':>8s} {'pred kvpr':>9s} | {'kvpr/off':>8s} {'kvpr-model':>10s} {'off-B/bw':>8s} | "
           f"{'HF off':>7s} {'HF gpu':>7s} {'x HFoff':>7s} {'x HFgpu':>7s}")
    lines.append(hdr)

    def f(d, k, fmt="{:.1f}"):
        v = d.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    for name, w in results["workloads"].items():
        for d in w["summary"]:
            lines.append(
                f"{name:12s} {d['prompt']:5d} {d['gen']:4d} | {f(d, 'full_step_ms'):>7s} {f(d, 'offload_step_ms'):>8s} "
                f"{f(d, 'kvpr_step_ms'):>7s}         | {f(d, 'offload_pred_step_ms'):>8s} {f(d, 'kvpr_pred_step_ms'):>9s} | "
                f"{f(d, 'kvpr_over_offload', '{:.3f}'):>8s} {f(d, 'kvpr_vs_model', '{:+.1%}'):>10s} "
                f"{f(d, 'offload_vs_bytes_bw', '{:+.1%}'):>8s} | {f(d, 'hf_offloaded_step_ms'):>7s} "
                f"{f(d, 'hf_dynamic_step_ms'):>7s} {f(d, 'kvpr_speedup_vs_hf_offloaded', '{:.2f}'):>7s} "
                f"{f(d, 'full_speedup_vs_hf_dynamic', '{:.2f}'):>7s}")
        for r in w["rows"]:
            if "moved_over_real_tokens" in r or "back_to_back_step_s" in r:
                lines.append(f"  {name} {r['policy']} ctx {r['context']}: step {r['step_s'] * 1e3:.1f} ms synced"
                             + (f", {r['back_to_back_step_s'] * 1e3:.1f} ms back-to-back" if "back_to_back_step_s" in r else "")
                             + (f"; K/V moved / real tokens {r['moved_over_real_tokens']:.3f}, step / (bytes / PCIe bw) "
                                f"{r['step_over_bytes_bw']:.3f}" if r.get("step_over_bytes_bw") else ""))
        errs = [r for r in w["rows"] if "error" in r]
        for r in errs:
            lines.append(f"  {name} {r['policy']} ctx {r['context']}: ERROR {r['error'][:200]}")
    return "\n".join(lines)


def build_parser(prog="kvoffload bench"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset: OPT-6.7B batch 64 at context 512 and "
                    "Llama-3-8B batch 32 at 1024")
    ap.add_argument("--workloads", default=None, help="comma list of: opt67b, opt13b_col, llama8b")
    ap.add_argument("--out", default=None, help="output folder (default $OUT or .)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hf-steps", type=int, default=4)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--sync-depth", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="write kvpr's per-step traces")
    ap.add_argument("--back-to-back", type=int, default=16,
                    help="also time this many `full` steps dispatched without a host read per step")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    t = time.time()
    res = run(args)
    print(f"[bench] done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    print(table(res), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# a prefill stand-in for decode benchmarks (scripts/bench_selection.py, scripts/bench_long_context.py)
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _random_kv_layer():
    import jax

    @functools.partial(jax.jit, static_argnames=("cfg", "keep_x", "chunk_tokens"))
    def layer(cfg, lp, h, positions, lengths, keep_x, chunk_tokens=None):
        b, t, hidden = h.shape
        dtype = lp.wk.dtype
        kk, kv, kx = jax.random.split(jax.random.fold_in(jax.random.key(7), t), 3)
        shape = (b, cfg.num_kv_heads, t, cfg.head_dim)
        k = jax.random.normal(kk, shape, dtype)
        v = jax.random.normal(kv, shape, dtype)
        x = jax.random.normal(kx, (b, t, hidden), dtype) if keep_x else None
        return h, k, v, x

    return layer


@contextlib.contextmanager
def random_kv_prefill(mesh=None):
    """Within: the pipeline's prefill computes no layer; each layer's K/V (and X) are random, of the shapes
    and dtype the layer program would give, and the hidden state passes through: the decode step of a long
    context measured without minutes of prefill attention (everything else is the runtime's own prefill:
    memory plan, pool layout, extents, tails, retrieval metadata from the keys). On a
    tensor-parallel mesh the outputs are placed as the real program's are (K/V by head, X along H, h replicated)."""
    import jax

    from kvoffload.device import memory as M
    from kvoffload.runtime import prefill as pipeline

    layer = _random_kv_layer()
    dev = M.default_device()

    def committed(cfg, lp, h, positions, lengths, keep_x, chunk_tokens=None, attention_impl=None):
        # the prefill's _layer_prefill signature; committed to the device, as the real program's outputs are
        # (it reads the committed weights): the tails made from them then enter the first decode step as
        # later steps' do (one compilation)
        out = layer(cfg, lp, h, positions, lengths, keep_x, chunk_tokens)
        if mesh is None:
            return jax.device_put(out, dev)
        from kvoffload.device import sharding as S

        h, k, v, x = out
        return (jax.device_put(h, S.replicated(mesh)), *jax.device_put((k, v), S.kv_sharding(mesh)),
                None if x is None else jax.device_put(x, S.x_shardings(x, mesh)))

    real = pipeline._layer_prefill
    pipeline._layer_prefill = committed
    try:
        yield
    finally:
        pipeline._layer_prefill = real
