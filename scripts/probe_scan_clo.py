"""`clo`'s real decode layers as one program looping over stacked layers, against the pipeline's one call per
layer (docs/ARCHITECTURE.md "Execution modes"): the same layer code (`pipeline.layer_body` with
clo's attend), the same buffers, and the pool read as the plan has it -- ONE host extent per kind holding every
looped layer's blocks, layer j's rows at token ids offset by j x E x blk (`SelectSources.row_offset`).

    PYTHONPATH=src python scripts/probe_scan_clo.py --shape llama-3-8b --prompt 131072 --option retrieval=quest \\
        --option topk=13107 --option quest_page_tokens=32 --option quest_dtype=int8 --option replay_hit_rate=0.86 \\
        --option block_tokens=64 --option host_dtype=int4 --option int4_k_quant=int8 --out $OUT/scan_clo.json

A prefilled state is decoded two steps (compiled, warm), one more step is watched to take each layer's
arguments, and layers 1..L-1 (layer 0 is clo's dense layer, a call of its own either way) are then run from
those arguments both ways: once to check that the loop's hidden state, tails and slots equal the calls' bit for
bit, then --rounds interleaved blocks of --steps each, timed as a step is (the host's time to issue, the wall
time with the hidden state waited for). The stacked copies (weights on the GPU, the pool on the host; a 1-byte
extent of 2-4 GiB padded past 4 GiB, `addressable_rows`) are made once, outside the timing, and the loop is
compiled once, ahead, its writes of >= --list-min-kib listed (what it copies that the calls do not).

Weights (`--linear`): `einsum`, the model's (the loop slices each layer's: XLA writes the slice out in fp32);
`pallas`, read by index from the stacked arrays through the stacked-linear kernel (`models.common.LayerSlice`)
in the loop and in the calls alike, so the bits compare, with a third variant `calls_einsum` timing the calls as
the pipeline runs them; `mulsum`, a multiply and sum in both (reads in place; too slow for a long prefill).
Row buffers (`--buffers`): `in-place`, every layer's along the rows of one array a kind, refilled and attended
in place (`pipeline.LayerRows`); `sliced`, stacked [n, ...] and sliced like the other slots.

`--policy full` runs `full`'s layers the same way (its pool's device extents concatenated, the block tables
shifted by j x E in the loop): the exactness reference of the selection policies, on the same loop.

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
    ap.add_argument("--linear", default="einsum", choices=("einsum", "mulsum", "pallas"),
                    help="pallas: 2-D weights read from the stacked arrays by layer index (models.common."
                         "LayerSlice, the stacked_linear kernel), in the loop and in the calls alike")
    ap.add_argument("--steps", type=int, default=8, help="timed steps a block")
    ap.add_argument("--rounds", type=int, default=3, help="blocks per variant, interleaved")
    ap.add_argument("--buffers", default="in-place", choices=("in-place", "sliced"),
                    help="the selection's row buffers: all layers' along the rows of one array a kind, each layer's "
                         "refilled and read in place at its row offset (pipeline.LayerRows), or stacked [n, ...] "
                         "and sliced per layer like the other slots (XLA copies the slice out and back)")
    ap.add_argument("--list-min-kib", type=int, default=1024, help="list the loop's writes of at least this size")
    ap.add_argument("--list-opcodes", default=None,
                    help="comma list: list only these instructions (e.g. copy,dynamic-update-slice: the loop's copies)")
    ap.add_argument("--dump-hlo", default=None, help="write the loop's optimized HLO text to this file")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.policy not in ("clo", "full"):
        raise SystemExit("probe_scan_clo runs the clo policy (or full, its exactness reference, on the same loop)")

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    if args.linear == "mulsum":  # before anything compiles: both variants use it
        use_mulsum_linear()

    from kvoffload.hlo_text import large_writes
    from kvoffload.models.common import layer_weights, stack_trees
    from kvoffload.runtime import layer as RL, loop as RO, state as RS
    from kvoffload.pallas.common import addressable_rows
    from kvoffload.offload.bench import (decode_steps, random_prompt_state, time_variants,
                                        watch_layer_calls)
    from kvoffload.policies.tokenselect import SelectSources

    options = parse_options(args.option)
    selects = args.policy == "clo"
    speculative = str(options.get("speculative_prefetch", "")).lower() == "true"
    if (selects and options.get("retrieval", "quest") == "exact") or speculative:
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
    if getattr(attend, "speculative", False):
        raise SystemExit("probe_scan_clo takes no speculative prefetch")
    slot_of = lambda i: gr.slots[i] if gr.slots else None  # noqa: E731  (full keeps none)
    live = [dict(k=gr.tail_k[i], v=gr.tail_v[i], x=gr.tail_x[i], slots=slot_of(i)) for i in range(L)]
    keys = {RL.program_key((calls[i][1], calls[i][8], live[i]["k"], live[i]["v"], live[i]["x"], live[i]["slots"]))
            for i in idx}
    if len(keys) != 1:
        raise SystemExit("layers 1..L-1 do not share one program (persistent heads?): nothing to loop over")
    pool1 = src1.pool if selects else src1  # full's sources are the pool itself
    if live[1]["x"] is not None or len(pool1.k) != 1 or len(pool1.v) != 1:
        raise SystemExit("probe_scan_clo takes K/V rows in one extent per kind (no X tail; raise extent_mb)")
    blk = gr.layout.block_tokens
    E = jax.tree.leaves(pool1.k[0])[0].shape[0]

    copy = functools.partial(jax.tree.map, lambda a: a.copy())
    split = [RS.split_slots(attend, live[i]["slots"]) for i in idx]
    host_kind = jax.tree.leaves(pool1.k[0])[0].sharding  # clo: pinned host; full: the device

    def one_extent(part):  # every looped layer's extent of a kind, concatenated on the host, in host memory
        exts = [getattr(calls[i][8].pool if selects else calls[i][8], part)[0] for i in idx]
        whole = jax.tree.map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *exts)
        # 1-byte codes of 2-4 GiB (int8 K of 31 layers at 128K) would be addressed with wrapping 32-bit offsets:
        # unread blocks take such an extent past 4 GiB
        leaves = jax.tree.leaves(whole)
        rows = max([addressable_rows(a.shape[0], a[0].nbytes) for a in leaves if a.itemsize == 1],
                   default=leaves[0].shape[0])
        return jax.tree.map(lambda a: jax.device_put(
            np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)]), host_kind), whole)

    pool = dataclasses.replace(pool1, k=[one_extent("k")], v=[one_extent("v")])
    sources = SelectSources(pool=pool, tail_len=tail_len, request_blocks=src1.request_blocks) if selects else pool
    # the library's stacked state and loop (`pipeline.stack_layers` / `loop_layers`), as the runtime would run them
    lp_st = stack_trees([calls[i][1] for i in idx])
    st, fixed_st = RS.stack_layers(attend, [live[i]["k"] for i in idx], [live[i]["v"] for i in idx],
                                   [live[i]["slots"] for i in idx], rows_in_place=args.buffers == "in-place")
    stacked = dict(st=st)
    per_call = dict(k=[copy(live[i]["k"]) for i in idx], v=[copy(live[i]["v"]) for i in idx],
                    moving=[copy(m) for m, _ in split])
    fixed = [f for _, f in split]
    jax.block_until_ready((pool, lp_st, st, fixed_st, per_call))
    n = len(idx)
    by_index = args.linear == "pallas"
    # layer j's blocks at j x E of the one extent: clo reads rows at token ids + j E blk, full's tables shift by j E
    loop_args = dict(cfg=cfg, attend=attend, options=opts, row_stride=E * blk if selects else 0,
                     table_stride=() if selects else (E,), linear_by_index=by_index)

    # compiled once, ahead: the program that runs, and the one whose large writes are listed (what the loop copies
    # that the calls do not: a stacked array's slice an opaque kernel needs as its own buffer)
    loop_exe = RO.loop_layers.lower(lp=lp_st, st=st, fixed=fixed_st, h=h0, positions=pos, tail_len=tail_len,
                                    sources=sources, tables=tables, **loop_args).compile()
    opcodes = set(args.list_opcodes.split(",")) if args.list_opcodes else None
    hlo = loop_exe.as_text()
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as f:
            f.write(hlo)
    writes = large_writes(hlo, args.list_min_kib << 10, opcodes)
    print(f"loop program: {len(writes)} instructions writing >= {args.list_min_kib} KiB"
          + (f" ({args.list_opcodes})" if opcodes else ""), *writes[:40 if opcodes is None else 400],
          sep="\n  ", flush=True)

    # --linear pallas: the calls read the same stacked weights by index (the loop's bits); made once, outside the
    # timing (an eager slice of each small leaf costs ~0.7 ms of host a layer). "calls_einsum" is then the calls
    # as the pipeline runs them (each layer's own arrays, XLA's matmul): another summation order, timed only
    lp_calls = [layer_weights(lp_st, j) for j in range(n)] if by_index else [calls[i][1] for i in idx]

    def run(variant):
        t = time.perf_counter()
        if variant in ("calls", "calls_einsum"):
            h = h0
            for j, i in enumerate(idx):
                lp_i = lp_calls[j] if variant == "calls" else calls[i][1]
                h, per_call["k"][j], per_call["v"][j], _, per_call["moving"][j] = RL.layer_step(
                    cfg, lp_i, h, pos, per_call["k"][j], per_call["v"][j], None, tail_len, calls[i][8], tables,
                    per_call["moving"][j], fixed[j], attend, opts)
        else:
            h, stacked["st"] = loop_exe(lp=lp_st, st=stacked["st"], fixed=fixed_st, h=h0, positions=pos,
                                        tail_len=tail_len, sources=sources, tables=tables)
        issued = time.perf_counter() - t
        jax.block_until_ready(h)
        return h, issued, time.perf_counter() - t

    ha, _, _ = run("calls")
    hb, _, _ = run("loop")

    def max_diff(a, b):
        return max([(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) if x.size else 0.0)
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))], default=0.0)  # full: no slots

    layers = [RS.unstack_layer(stacked["st"], j) for j in range(n)]
    check = dict(hidden=max_diff(ha, hb), tails=max_diff((per_call["k"], per_call["v"]),
                                                         ([t[0] for t in layers], [t[1] for t in layers])),
                 slots=max_diff(per_call["moving"], [t[2] for t in layers]))
    print(f"loop vs calls, max |diff|: hidden {check['hidden']:.3g}, tails {check['tails']:.3g}, "
          f"slots {check['slots']:.3g}", flush=True)
    names = ("calls", "loop") + (("calls_einsum",) if args.linear == "pallas" else ())
    variants = time_variants(run, names, args.steps, args.rounds)
    rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=args.shape, batch=args.batch,
               prompt=args.prompt, options=options, linear=args.linear, buffers=args.buffers, layers_looped=n, extent_blocks=E,
               steps=args.steps, rounds=args.rounds, max_abs_diff=check, loop_large_writes=writes,
               xla_flags=os.environ.get("XLA_FLAGS", ""), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               variants=variants)
    print(f"layers 1..{L - 1} of {args.policy} {args.shape} b{args.batch} ctx {args.prompt}, linear {args.linear}")
    return report_variants(rec, args.out)


if __name__ == "__main__":
    main()
