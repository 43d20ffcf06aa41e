"""Where a decode step's host time goes: per step, the host seconds spent issuing the pipeline's
transfers (`LayerPipeline.to_device`), dispatching the layer programs (`pipeline.layer_step`) and waiting for the
device (`jax.block_until_ready`), for any layered policy, shape and tensor-parallel size. Where a step is
host-bound (kvpr on 4 GPUs, clo at b1), these say which part to cut; the step time alone cannot.

    PYTHONPATH=src python experiments/host_time.py --policy kvpr --tp 4 --option split_point=512 --out $OUT/host.json
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" PYTHONPATH=src python experiments/host_time.py --policy kvpr --tp 4

Random weights in the named shape (`offload.bench.make_model`; timing only), a random prompt of --prompt
tokens for --batch requests, --warmup steps, then --steps timed steps each ending when its tokens are on the
host. One JSON line per run on stdout ("HOST_TIME {...}") and, with --out, the same record in a file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # _common


def main(argv=None) -> dict:
    from _common import add_random_prompt_args, parse_options, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_random_prompt_args(ap, policy="kvpr", shape="opt-6.7b", batch=64, prompt=512)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel")
    ap.add_argument("--offload-weights", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from kvoffload.runtime import layer as RL, pipeline as PL
    from _common import host_gauge, random_prompt_state
    from kvoffload.offload.bench import decode_steps

    spent, calls = collections.Counter(), collections.Counter()  # host seconds and calls by part

    def timed(name, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
                calls[name] += 1
        return wrapped

    patched = [(PL.LayerPipeline, "to_device"), (RL, "layer_step"), (jax, "block_until_ready")]
    saved = [getattr(obj, name) for obj, name in patched]
    for (obj, name), fn in zip(patched, saved):
        setattr(obj, name, timed({"to_device": "issue transfers", "layer_step": "dispatch layer programs",
                                  "block_until_ready": "wait"}[name], fn))
    try:
        options = parse_options(args.option)
        if args.offload_weights:
            options["offload_weights"] = True
        model, pol, state, nxt = random_prompt_state(args.shape, args.policy, options, args.batch, args.prompt,
                                                     args.warmup + args.steps, args.dtype, args.tp)
        _, _, state, nxt = decode_steps(pol, model, state, nxt, args.warmup)
        spent.clear()
        calls.clear()
        times, issued, dispatch = [], [], []  # issued: the host done with the step, every program dispatched
        gauge = [host_gauge()]
        for _ in range(args.steps):  # one step a call: the layer programs' dispatch time is read between steps
            before = spent["dispatch layer programs"]
            step, _, state, nxt = decode_steps(pol, model, state, nxt, 1, issued=issued)
            times += step
            dispatch.append(spent["dispatch layer programs"] - before)
        gauge.append(host_gauge())
    finally:
        for (obj, name), fn in zip(patched, saved):
            setattr(obj, name, fn)
    last = state.records[-1] if getattr(state, "records", None) else {}
    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, policy=args.policy, shape=args.shape,
               batch=args.batch, prompt=args.prompt, tp=args.tp, options=options,
               xla_flags=os.environ.get("XLA_FLAGS", ""), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               step_ms=1e3 * float(np.median(times)),
               host_ms_per_step={k: 1e3 * v / args.steps for k, v in spent.items()},
               # per step: wall, the host's share (decode_step returned: every program dispatched; a step whose
               # wall is barely above it is host-bound) and the layer programs' dispatch within it
               step_ms_each=[1e3 * x for x in times], issued_ms_each=[1e3 * x for x in issued],
               dispatch_ms_each=[1e3 * x for x in dispatch],
               host_gauge=gauge,  # the host's speed before and after the timed steps (`_common.host_gauge`)
               calls_per_step={k: v / args.steps for k, v in calls.items()},
               recompute_extents=last.get("recompute_extents"), used_extents=last.get("used_extents"))
    print("HOST_TIME", json.dumps(rec), flush=True)
    if args.out:
        write_json(args.out, rec)
    return rec


if __name__ == "__main__":
    main()
