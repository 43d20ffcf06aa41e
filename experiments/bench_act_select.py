#!/usr/bin/env python
"""Top-k over activations vs over K/V: `clo` with store=kv and store=act (and auto) on an
MHA model's shape (default OPT-6.7B, random weights, bf16) at a long context, per batch size: decode step
time and the bytes each step reads from the host pool (V / K rows, or the X rows of the union of the heads'
selections), the per-layer choice auto makes and why, the memory plans. JSON to --out.

    python experiments/bench_act_select.py --out $OUT/act_select.json
    python experiments/bench_act_select.py --batches 1,4 --retrievals quest --stores kv,act,auto --out $OUT/a.json
    python experiments/bench_act_select.py --option topk_ratio=1.0 --option fixed_threshold=2.0 ...

Defaults: --tokens 32768, --batches 1, --retrievals quest,exact (quest: K and V on the host, where X is half
their bytes; exact: K on the GPU, only V crosses, the size of X for MHA), --stores kv,act, clo's defaults
(topk_ratio 0.1, layer 0 persistent, speculative prefetch) plus prefill_chunk_tokens=8192. --option key=value
adds any clo option to every run (JSON values). Each run: prefill, --warmup steps, --steps timed steps.
"""

import os
import sys

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # as bench_long_context (it set it on import)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # _common

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402



def run_one(model, opts, batch, tokens, warmup, steps):
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.offload.bench import timed_decode
    from kvoffload.plan.memory import MemoryPlanError
    from kvoffload.policies import make_policy

    cfg = model.config
    pol = make_policy("clo", **opts)
    ids = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size - 1, (batch, tokens)), jnp.int32)
    lengths = jnp.full((batch,), tokens, jnp.int32)
    try:
        prefill_s, times, logits, state, _ = timed_decode(pol, model, ids, lengths, tokens + warmup + steps + 1,
                                                          warmup + steps)
    except MemoryPlanError as e:
        return {"refused": str(e)}
    n = warmup + steps
    c = pol.describe(state)["clo"]
    per_step = {k: c.get(k, 0) / n for k in ("v_bytes_fetched", "k_bytes_fetched", "x_bytes_fetched")}
    plan = pol.pipeline.memory_plan
    out = {"prefill_s": prefill_s, "decode_step_s": float(np.median(times[warmup:])), "step_times_s": times,
           "bytes_per_step": {**per_step, "total": sum(per_step.values())},
           "x_rows_per_layer_step_request": c.get("x_rows_fetched", 0) / (n * cfg.num_layers * batch),
           "selected_per_head": c.get("selected_per_head"), "hit_rate": c.get("hit_rate"),
           "store_per_layer": c.get("store_per_layer"), "store_reasons": sorted(set(c.get("store_reasons", []))),
           "guess_hit_rate": (c.get("speculative_prefetch") or {}).get("guess_hit_rate"),
           "memory_plan": {"host_bytes": plan.host_bytes, "gpu_bytes": plan.gpu_bytes, "describe": plan.describe()}}
    del state, logits, pol
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="opt-6.7b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--retrievals", default="quest,exact")
    ap.add_argument("--stores", default="kv,act")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from kvoffload.device import memory as M
    from _common import parse_options
    from kvoffload.offload.bench import make_model

    out_path = args.out or os.path.join(os.environ.get("OUT") or ".", "bench_act_select.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    base = {"prefill_chunk_tokens": 8192, **parse_options(args.option)}
    model = make_model(args.shape, jnp.dtype(args.dtype), offload_weights=False)
    result = {"shape": args.shape, "tokens": args.tokens, "options": base, "device": M.default_device().device_kind,
              "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": []}
    for batch in [int(b) for b in args.batches.split(",")]:
        for retrieval in args.retrievals.split(","):
            for store in args.stores.split(","):
                opts = {**base, "retrieval": retrieval, "store": store}
                t = time.perf_counter()
                try:
                    r = run_one(model, opts, batch, args.tokens, args.warmup, args.steps)
                except Exception as e:  # noqa: BLE001  (one run's failure is that run's result)
                    r = {"error": f"{type(e).__name__}: {e}"}
                r.update(batch=batch, retrieval=retrieval, store=store, wall_s=time.perf_counter() - t)
                result["runs"].append(r)
                print(json.dumps({k: r.get(k) for k in ("batch", "retrieval", "store", "decode_step_s", "bytes_per_step",
                                                        "x_rows_per_layer_step_request", "store_per_layer", "error",
                                                        "refused")}, default=str), flush=True)
                with open(out_path, "w") as f:
                    json.dump(result, f, indent=1, default=str)
                gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
