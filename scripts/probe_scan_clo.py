"""`clo`'s real decode layers as one program looping over stacked layers, against the pipeline's one call per
layer (issue 11; docs/ARCHITECTURE.md "A step in one program"): the same layer code (`pipeline.layer_body` with
clo's attend), the same buffers, and the pool read as the plan has it -- ONE host extent per kind holding every
looped layer's blocks, layer j's rows at token ids offset by j x E x blk (`SelectSources.row_offset`).

    PYTHONPATH=src python scripts/probe_scan_clo.py --shape llama-3-8b --prompt 131072 --option retrieval=quest \\
        --option topk=13107 --option quest_page_tokens=32 --option quest_dtype=int8 --option replay_hit_rate=0.86 \\
        --option block_tokens=64 --option host_dtype=int4 --option int4_k_quant=int8 --out $OUT/scan_clo.json

A prefilled state is decoded two steps (compiled, warm), one more step is watched to take each layer's
arguments, and layers 1..L-1 (layer 0 is clo's dense layer, a call of its own either way) are then run from
those arguments both ways: once to check that the loop's hidden state, tails and slots equal the calls' bit for
bit (`--linear einsum`, the model's), then --rounds interleaved blocks of --steps each, timed as a step is (the
host's time to issue, the wall time with the hidden state waited for). The stacked copies (weights on the GPU,
the pool on the host) are made once, outside the timing. `--linear mulsum` runs the model's matmuls as a multiply
and sum in both variants (XLA reads a stacked weight's slice in place only so; `probe_stacked_linear.py`): its
bits differ from the einsum's, so the check compares the loop with the calls in the same form.

Takes one GPU batch, a single pool extent per kind (clo's default extent size holds a 128K prompt's K in one),
Quest or HATA retrieval (exact retrieval reads every key of the pool: not offset here) and no speculative
prefetch, and layers 1..L-1 that share one program (no persistent heads); otherwise it says which.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main(argv=None) -> dict:
    from kvoffload.offload.bench import add_random_prompt_args, parse_options, report_variants, use_mulsum_linear

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_random_prompt_args(ap, policy="clo", shape="llama-3-8b", batch=1, prompt=8192)
    ap.add_argument("--linear", default="einsum", choices=("einsum", "mulsum"))
    ap.add_argument("--steps", type=int, default=8, help="timed steps a block")
    ap.add_argument("--rounds", type=int, default=3, help="blocks per variant, interleaved")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.policy != "clo":
        raise SystemExit("probe_scan_clo runs the clo policy")

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    if args.linear == "mulsum":  # before anything compiles: both variants use it
        use_mulsum_linear()

    from kvoffload.offload import pipeline as PL
    from kvoffload.offload.bench import (decode_steps, random_prompt_state, time_variants,
                                        watch_layer_calls)
    from kvoffload.policies.tokenselect import SelectSources

    options = parse_options(args.option)
    if options.get("retrieval", "quest") == "exact" or str(options.get("speculative_prefetch", "")).lower() == "true":
        raise SystemExit("probe_scan_clo takes Quest or HATA retrieval without speculative prefetch")
    model, pol, state, nxt = random_prompt_state(args.shape, args.policy, options, args.batch, args.prompt, 3,
                                                 args.dtype)
    _, _, state, nxt = decode_steps(pol, model, state, nxt, 2)
    calls, state = watch_layer_calls(pol, model, state, nxt)
    if len(state.groups) != 1:
        raise SystemExit("probe_scan_clo takes one GPU batch")
    gr = state.groups[0]
    L = model.config.num_layers
    if len(calls) != L or L < 3:
        raise SystemExit(f"expected one layer_step call for each of >= 3 layers, saw {len(calls)} of {L}")
    idx = list(range(1, L))
    cfg, _, h0, pos, _, _, _, tail_len, src1, tables, _, _, attend, opts = calls[1]
    if attend.speculative:
        raise SystemExit("probe_scan_clo takes no speculative prefetch")
    live = [dict(k=gr.tail_k[i], v=gr.tail_v[i], x=gr.tail_x[i], slots=gr.slots[i]) for i in range(L)]
    keys = {PL.program_key((calls[i][1], calls[i][8], live[i]["k"], live[i]["v"], live[i]["x"], live[i]["slots"]))
            for i in idx}
    if len(keys) != 1:
        raise SystemExit("layers 1..L-1 do not share one program (persistent heads?): nothing to loop over")
    if live[1]["x"] is not None or len(src1.pool.k) != 1 or len(src1.pool.v) != 1:
        raise SystemExit("probe_scan_clo takes K/V rows in one extent per kind (no X tail; raise extent_mb)")
    blk = gr.layout.block_tokens
    E = jax.tree.leaves(src1.pool.k[0])[0].shape[0]

    copy = functools.partial(jax.tree.map, lambda a: a.copy())
    stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    split = [PL.split_slots(attend, live[i]["slots"]) for i in idx]
    host_kind = jax.tree.leaves(src1.pool.k[0])[0].sharding

    def one_extent(part):  # every looped layer's extent of a kind, concatenated on the host, in host memory
        exts = [getattr(calls[i][8].pool, part)[0] for i in idx]
        return jax.tree.map(lambda *a: jax.device_put(np.concatenate([np.asarray(x) for x in a]), host_kind), *exts)

    pool = dataclasses.replace(src1.pool, k=[one_extent("k")], v=[one_extent("v")])
    stacked = dict(lp=stack([calls[i][1] for i in idx]), k=stack([live[i]["k"] for i in idx]),
                   v=stack([live[i]["v"] for i in idx]), moving=stack([m for m, _ in split]),
                   fixed=stack([f for _, f in split]))
    per_call = dict(k=[copy(live[i]["k"]) for i in idx], v=[copy(live[i]["v"]) for i in idx],
                    moving=[copy(m) for m, _ in split])
    fixed = [f for _, f in split]
    jax.block_until_ready((pool, stacked, per_call))
    n = len(idx)

    @functools.partial(jax.jit, static_argnames=("cfg", "attend", "options"), donate_argnames=("tk", "tv", "moving"))
    def loop_step(cfg, lp, h, positions, tk, tv, tail_len, pool, tables, moving, fixed, attend, options):
        def body(j, carry):
            h, tk, tv, moving = carry
            at = functools.partial(jax.tree.map, lambda a: a[j])
            src = SelectSources(pool=pool, tail_len=tail_len, request_blocks=src1.request_blocks,
                                row_offset=(j * E * blk).astype(jnp.int32))
            h, k, v, _, m = PL.layer_body(cfg, at(lp), h, positions, tk[j], tv[j], None, tail_len, src, tables,
                                          at(moving), at(fixed), attend, options)
            return (h, tk.at[j].set(k), tv.at[j].set(v),
                    jax.tree.map(lambda s, x: s.at[j].set(x), moving, m))
        return jax.lax.fori_loop(0, n, body, (h, tk, tv, moving))

    def run(variant):
        t = time.perf_counter()
        if variant == "calls":
            h = h0
            for j, i in enumerate(idx):
                h, per_call["k"][j], per_call["v"][j], _, per_call["moving"][j] = PL.layer_step(
                    cfg, calls[i][1], h, pos, per_call["k"][j], per_call["v"][j], None, tail_len, calls[i][8], tables,
                    per_call["moving"][j], fixed[j], attend, opts)
        else:
            h, stacked["k"], stacked["v"], stacked["moving"] = loop_step(
                cfg, stacked["lp"], h0, pos, stacked["k"], stacked["v"], tail_len, pool, tables, stacked["moving"],
                stacked["fixed"], attend, opts)
        issued = time.perf_counter() - t
        jax.block_until_ready(h)
        return h, issued, time.perf_counter() - t

    ha, _, _ = run("calls")
    hb, _, _ = run("loop")

    def max_diff(a, b):
        return max((float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) if x.size else 0.0)
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    check = dict(hidden=max_diff(ha, hb), tails=max_diff((per_call["k"], per_call["v"]),
                                                         ([stacked["k"][j] for j in range(n)],
                                                          [stacked["v"][j] for j in range(n)])),
                 slots=max_diff(per_call["moving"], [jax.tree.map(lambda a: a[j], stacked["moving"])
                                                     for j in range(n)]))
    print(f"loop vs calls, max |diff|: hidden {check['hidden']:.3g}, tails {check['tails']:.3g}, "
          f"slots {check['slots']:.3g}", flush=True)
    variants = time_variants(run, ("calls", "loop"), args.steps, args.rounds)
    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=args.shape, batch=args.batch,
               prompt=args.prompt, options=options, linear=args.linear, layers_looped=n, extent_blocks=E,
               steps=args.steps, rounds=args.rounds, max_abs_diff=check,
               xla_flags=os.environ.get("XLA_FLAGS", ""), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               variants=variants)
    print(f"layers 1..{L - 1} of clo {args.shape} b{args.batch} ctx {args.prompt}, linear {args.linear}")
    return report_variants(rec, args.out)


if __name__ == "__main__":
    main()
