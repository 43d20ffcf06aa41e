"""The host's cost of one decode step's layer program calls, with the real program and buffers, in
variants interleaved in one process, so that the lent host's CPU speed, which moves by 2x over stretches of steps
(BENCHMARKS 'Host cost of a decode step'), falls on every variant alike.

    PYTHONPATH=src python scripts/probe_layer_call.py --shape llama-3-8b --prompt 131072 --policy clo \\
        --option retrieval=quest --option quest_dtype=int8 --option topk=13107 --option replay_hit_rate=0.86 \\
        --out $OUT/layer_call.json

One decode step is run with `pipeline.layer_step` watched, to take each layer's arguments; then the layers
1..L-1 are called again and again in order, as a step does (each call another layer's weights and slots), in
blocks of --calls, without waiting between calls: the time until the last call returns is the host's (the
device runs behind), and the time until its result is ready the block's. Variants:

- ``as run``: as the pipeline calls it (with the policy's `split_slots`, the slots' read-only part neither
  donated nor returned);
- ``whole slots``: every slot field donated and returned (what the pipeline did before the split);
- ``one layer``: as run, but layer 1 every call: no buffer of the program changes between calls but the hidden
  state, so XLA need not re-point its CUDA graph at another layer's buffers (the share of that update);
- ``as run, KEY=VALUE`` (with ``--versus KEY=VALUE``, repeatable): a second state prefilled with those options
  changed (e.g. ``extent_mb=256``: one pool extent instead of four at 128K, fewer leaves a call), as run;
- ``N layers a program`` (with ``--per-program N``, repeatable): as run, but N consecutive layers in one
  `pipeline.layers_step` call (what ``layers_per_program=N`` runs): a call's fixed costs (the launch, the
  command buffer's update) paid once for N layers, its kernels and leaves N times. Its times are per layer.

Policies without a split skip ``whole slots``. Reported per variant: host us per call (median and min over
--rounds blocks), block us per call, and the layer program's argument and output leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main(argv=None) -> dict:
    from kvoffload.offload.bench import add_random_prompt_args, parse_options, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_random_prompt_args(ap, policy="clo", shape="llama-3-8b", batch=1, prompt=8192)
    ap.add_argument("--calls", type=int, default=93, help="calls per block (default: three rounds of 31 layers)")
    ap.add_argument("--rounds", type=int, default=8, help="blocks per variant, interleaved")
    ap.add_argument("--versus", action="append", default=[], metavar="KEY=VALUE",
                    help="also a second state with these options changed (repeatable), its layers as run")
    ap.add_argument("--per-program", action="append", type=int, default=[], metavar="N",
                    help="also N layers in one program call (repeatable); reported per layer")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from kvoffload.runtime import fused as RF, layer as RL, state as RS
    from kvoffload.offload.bench import decode_steps, random_prompt_state, watch_layer_calls

    options = parse_options(args.option)
    versus = parse_options(args.versus)

    shared = {}

    def watched_state(opts: dict):
        """A prefilled, warm state of the policy with opts, and the arguments each layer_step call of one
        decode step took: (calls, live buffers per layer, layers to cycle, the attend hook). Every state
        shares the first one's weights."""
        model, pol, state, nxt = random_prompt_state(args.shape, args.policy, opts, args.batch, args.prompt,
                                                     3, args.dtype, model=shared.get("model"))
        shared.setdefault("model", model)  # room for 3 more tokens: two warm-up steps and the watched one
        _, _, state, nxt = decode_steps(pol, model, state, nxt, 2)  # compiled, warm
        calls, state = watch_layer_calls(pol, model, state, nxt)
        if len(state.groups) != 1:
            raise SystemExit("probe_layer_call takes one GPU batch (its layers' buffers are read from groups[0])")
        gr = state.groups[0]
        L = model.config.num_layers
        if len(calls) != L:
            raise SystemExit(f"expected one layer_step call per layer ({L}), saw {len(calls)} (layers_per_program?)")
        # what a call reads and does not donate comes from the watched step; the donated tails and slots are the
        # state's (the watched step's were consumed by it)
        live = {i: dict(k=gr.tail_k[i], v=gr.tail_v[i], x=gr.tail_x[i], slots=gr.slots[i] if gr.slots else None)
                for i in range(L)}
        layers = list(range(1, L)) if L > 1 else [0]  # layer 0 may be its own program (clo: kept whole)
        return calls, live, layers, calls[layers[0]][12]

    base = watched_state(options)
    attend = base[3]
    has_split = getattr(attend, "split_slots", None) is not None

    def block(setup, split: bool, cycle: list, per_program: int = 1):
        """One block of --calls layer calls; (host, whole) seconds per layer."""
        calls, live, _, attend = setup
        t0 = time.perf_counter()
        last = None
        if per_program > 1:  # groups of consecutive distinct layers (each buffer donated once a call)
            for n in range(0, args.calls, per_program):
                idx = [cycle[(n + j) % len(cycle)] for j in range(per_program)]
                cfg, _, h, pos, _, _, _, tail_len, _, tables, _, _, _, opts = calls[idx[0]]
                moving, fixed = zip(*(RS.split_slots(attend, live[i]["slots"]) for i in idx))
                _, ks, vs, xs, sls = RF.layers_step(
                    cfg, tuple(calls[i][1] for i in idx), h, pos, tuple(live[i]["k"] for i in idx),
                    tuple(live[i]["v"] for i in idx), tuple(live[i]["x"] for i in idx), tail_len,
                    tuple(calls[i][8] for i in idx), tables, moving, fixed, attend, opts)
                for j, i in enumerate(idx):
                    cur = live[i]
                    cur["k"], cur["v"], cur["x"] = ks[j], vs[j], xs[j]
                    cur["slots"] = RS.join_slots(attend, sls[j], fixed[j])
                last = sls
            n_layers = len(range(0, args.calls, per_program)) * per_program
        else:
            for n in range(args.calls):
                i = cycle[n % len(cycle)]
                (cfg, lp, h, pos, _, _, _, tail_len, src, tables, _, _, _, opts) = calls[i]
                cur = live[i]
                slot, fixed = RS.split_slots(attend, cur["slots"]) if split else (cur["slots"], None)
                _, cur["k"], cur["v"], cur["x"], slot = RL.layer_step(cfg, lp, h, pos, cur["k"], cur["v"], cur["x"],
                                                                      tail_len, src, tables, slot, fixed, attend, opts)
                cur["slots"] = RS.join_slots(attend, slot, fixed)
                last = slot
            n_layers = args.calls
        t_host = time.perf_counter() - t0
        jax.block_until_ready(last)
        return t_host / n_layers, (time.perf_counter() - t0) / n_layers

    layers = base[2]
    variants = {"as run": (base, has_split, layers)}
    if has_split:
        variants["whole slots"] = (base, False, layers)
    variants["one layer"] = (base, has_split, layers[:1])
    if versus:
        other = watched_state({**options, **versus})
        variants["as run, " + ", ".join(args.versus)] = (other, has_split, other[2])
    for n in args.per_program:
        if not 1 < n <= len(layers):
            raise SystemExit(f"--per-program {n}: give 2..{len(layers)} (the layers cycled)")
        if not has_split:
            raise SystemExit("--per-program needs a policy whose slots split (clo)")
        variants[f"{n} layers a program"] = (base, has_split, layers, n)
    for v in variants.values():  # compile each variant before timing
        block(*v)
    times = {name: ([], []) for name in variants}
    for _ in range(args.rounds):
        for name, v in variants.items():
            host, whole = block(*v)
            times[name][0].append(host)
            times[name][1].append(whole)

    def leaves(setup, split: bool, n: int = 1):
        """(argument leaves, output leaves) of one call: of layer_step, or of layers_step over n layers."""
        calls, live, layers, attend = setup
        idx = layers[:n]
        parts = [RS.split_slots(attend, live[i]["slots"]) if split else (live[i]["slots"], None) for i in idx]
        c = calls[idx[0]]
        per_layer = [(calls[i][1], live[i]["k"], live[i]["v"], live[i]["x"], calls[i][8], part)
                     for i, part in zip(idx, parts)]
        ins = jax.tree.leaves((c[2], c[3], c[7], c[9], per_layer))
        outs = 1 + len(jax.tree.leaves([(live[i]["k"], live[i]["v"], live[i]["x"], part[0])
                                        for i, part in zip(idx, parts)]))
        return len(ins), outs

    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, policy=args.policy, shape=args.shape,
               batch=args.batch, prompt=args.prompt, options=options, calls_per_block=args.calls,
               rounds=args.rounds, versus=versus, per_program=args.per_program,
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), variants={})
    for name, (setup, split, _, *per) in variants.items():
        host, whole = (np.array(t) * 1e6 for t in times[name])
        n_in, n_out = leaves(setup, split, per[0] if per else 1)
        rec["variants"][name] = dict(host_us_median=float(np.median(host)), host_us_min=float(host.min()),
                                     block_us_median=float(np.median(whole)), host_us_each=host.tolist(),
                                     arguments=n_in, outputs=n_out)
    print(f"device {rec['device']} | jax {rec['jax']} | {args.policy} {args.shape} b{args.batch} ctx {args.prompt}")
    print("| variant | host us a layer (median) | min | block us a layer | arguments a call | outputs a call |")
    print("|---|--:|--:|--:|--:|--:|")
    for name, v in rec["variants"].items():
        print(f"| {name} | {v['host_us_median']:.1f} | {v['host_us_min']:.1f} | {v['block_us_median']:.1f} | "
              f"{v['arguments']} | {v['outputs']} |")
    print("PROBE_LAYER_CALL", json.dumps({k: v for k, v in rec.items() if k != "variants"}), flush=True)
    if args.out:
        write_json(args.out, rec)
    return rec


if __name__ == "__main__":
    main()
