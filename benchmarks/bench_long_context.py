#!/usr/bin/env python
"""Long-context run on one GPU: random weights in a model's shape (default
Llama-3-8B), batch 1, a prompt of --tokens tokens prefilled in token chunks, then a few decode steps.
Reports prefill time, decode step time, host and GPU memory (planned and measured) in JSON to --out;
when the run does not fit, the planner's refusal (MemoryPlanError: what is needed, what is there, what
to change) is the result, before anything large is allocated.

    python benchmarks/bench_long_context.py --tokens 131072 --out $OUT/long_128k.json
    python benchmarks/bench_long_context.py --tokens 1048576 --layers 2 --out $OUT/long_1m_2layers.json
    python benchmarks/bench_long_context.py --policy clo --option host_dtype=int4 --tokens 1048576 ...

Default policy `offload` with host_dtype=int4 and prefill_chunk_tokens=8192; --policy takes any
registered policy and --option key=value any of its options (values parsed as JSON, else strings; an
option the policy does not take is refused with the policy's own message). --layers N keeps the
first N layers of the shape: prefill and step times scale with the layers (a 1M-token prefill of all 32
is minutes per layer of attention), memory per layer too; the JSON says how many ran. --random-prefill
replaces each prefill layer program by random K/V of its shapes (`_common.random_kv_prefill`; the rest is
the runtime's own prefill: plan, pool, extents, metadata): every layer's decode step and memory at a context
whose real prefill would not fit one run; the JSON's prefill_s is then not a prefill time (prefill = "random
K/V"). Measure the prefill rate on a few real layers beside it.
"""

import os
import sys

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

DEFAULT_OPTIONS = {"host_dtype": "int4", "prefill_chunk_tokens": 8192}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=131072, help="prompt tokens (batch 1)")
    ap.add_argument("--shape", default="llama-3-8b", help="a named shape (plan/profiler.py) or an HF config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--policy", default="offload")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help=f"a policy option (repeatable); defaults {DEFAULT_OPTIONS}, 'KEY=null' drops one")
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=1, help="decode steps before the timed ones (compilation)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_long_context.json)")
    ap.add_argument("--random-prefill", action="store_true",
                    help="random K/V in place of the prefill's layer programs (decode and memory only; see above)")
    args = ap.parse_args(argv)

    import logging

    import jax
    import jax.numpy as jnp
    import numpy as np

    logging.basicConfig(format="%(asctime)s %(message)s", stream=sys.stdout)  # progress: a 1M prefill is minutes
    logging.getLogger("kvoffload").setLevel(logging.INFO)

    from kvoffload.models import Model
    from kvoffload.device import memory as M
    from _common import parse_options
    from kvoffload.offload.bench import make_model, timed_decode
    from kvoffload.plan.memory import MemoryPlanError
    from kvoffload.models.transformer import init_params
    from kvoffload.plan.profiler import model_shape
    from kvoffload.policies import make_policy

    out_path = args.out or os.path.join(os.environ.get("OUT") or ".", "bench_long_context.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    opts = {k: v for k, v in {**DEFAULT_OPTIONS, **parse_options(args.option)}.items() if v is not None}
    cfg = model_shape(args.shape)
    layers = cfg.num_layers if args.layers is None else min(int(args.layers), cfg.num_layers)
    dev = M.default_device()
    result = {"shape": args.shape, "layers": layers, "of_layers": cfg.num_layers, "tokens": args.tokens, "batch": 1,
              "policy": args.policy, "options": opts, "dtype": args.dtype, "device": dev.device_kind,
              "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "prefill": "random K/V (not a prefill time)" if args.random_prefill else "real"}

    def finish(rc):
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(json.dumps(result, default=str))
        return rc

    def refused(e):
        result["refused"] = str(e)
        plan = getattr(getattr(pol, "pipeline", None), "memory_plan", None)
        if plan is not None:
            result["memory_plan"] = {"host_bytes": plan.host_bytes, "gpu_bytes": plan.gpu_bytes, "describe": plan.describe()}
        return finish(3)

    try:
        pol = make_policy(args.policy, **opts)
    except (KeyError, ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
        return finish(2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size - 1, (1, args.tokens)), jnp.int32)
    lengths = jnp.asarray([args.tokens], jnp.int32)
    capacity = args.tokens + args.warmup + args.steps + 1
    small = dataclasses.replace(cfg, num_layers=layers)
    if hasattr(pol, "pipeline"):  # plan on abstract weights first: a refusal allocates nothing, weights included
        try:
            pol.pipeline.plan(Model(small, jax.eval_shape(lambda: init_params(small, jax.random.key(0), jnp.dtype(args.dtype)))),
                              np.asarray(lengths), args.tokens, capacity)
        except MemoryPlanError as e:
            return refused(e)
    model = make_model(args.shape, jnp.dtype(args.dtype), offload_weights=False)
    if layers < cfg.num_layers:
        model = Model(dataclasses.replace(model.config, num_layers=layers),
                      dataclasses.replace(model.params, layers=model.params.layers[:layers]))
    from _common import random_kv_prefill

    try:
        with random_kv_prefill(getattr(getattr(pol, "pipeline", None), "mesh", None)) if args.random_prefill \
                else contextlib.nullcontext():
            prefill_s, times, logits, state, _ = timed_decode(pol, model, tokens, lengths, capacity,
                                                              args.warmup + args.steps)
    except MemoryPlanError as e:  # refused before allocating the pool
        return refused(e)
    stats = {}
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001  (a backend without memory stats)
        pass
    timed = times[args.warmup:]
    result.update({
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": args.tokens / prefill_s,
        "decode_step_s": float(np.median(timed)) if timed else None,
        "decode_step_times_s": timed,
        "warmup_step_times_s": times[:args.warmup],
        "gpu_peak_bytes": stats.get("peak_bytes_in_use"),
        "gpu_bytes_in_use": stats.get("bytes_in_use"),
        "gpu_bytes_limit": stats.get("bytes_limit"),
        "host_rss_bytes": M.proc_field_bytes("/proc/self/status", "VmRSS"),
        "last_step": dict(state.records[-1]) if getattr(state, "records", None) else None,
    })
    plan = getattr(getattr(pol, "pipeline", None), "memory_plan", None)
    if plan is not None:
        result["memory_plan"] = {"host_bytes": plan.host_bytes, "gpu_bytes": plan.gpu_bytes, "host": plan.host,
                                 "gpu": plan.gpu, "describe": plan.describe()}
        result["host_pool_bytes"] = int(sum(v for k, v in plan.host.items() if k != "weights"))
    del state, logits
    return finish(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
