#!/usr/bin/env python
"""Where a selection miss spends its time on the GPU (issues 11 and 12): the pieces of `tokenselect`'s and
`clo`'s miss path timed alone at the speed benchmark's shapes (Llama-3-8B: 8 KV heads of 4 query heads,
d 128, bf16; a pool of the batch's contexts in 64-token blocks, position-major as the allocator places
prompts, extents of 32K tokens; the per-request space's bound is ctx / 64 blocks), each one jitted
program repeated back to back (GPU time, no host sync inside):

* ``space``       ``token_space``: each request's own blocks from the block tables (owners, compaction)
* ``soft_vote``   tokenselect's scores (every K row read once against its owner's query, softmax per head
                  over the request's tokens, group sums), laid out per request: [B, n_kv, T]
* ``exact``       clo's scores (max over the group of q.k), per request
* ``top_k``       ``jax.lax.top_k`` of the per-request scores [B, n_kv, T] (XLA sorts whole rows for a large k)
* ``choose``      ``choose_tokens``: forced sinks / recent, top-k, sorted ascending, mapped to pool tokens
* ``*_pool``      (batch > 1) the same over the batch's whole pool, N = B x T tokens per request row: the
                  space scoring and top-k ran over before the per-request space (issues 11, 12)
* ``gather``      the selected K and V rows from the device extents (``gather_rows``)
* ``attend``      ``ops.sparse_attention`` over the gathered rows
* ``read_k``      a plain read of every K row (the floor of any scoring)

    PYTHONPATH=src python scripts/bench_select_parts.py --out $OUT/select_parts.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def timed(fn, *args, reps=20):
    import jax

    jax.block_until_ready(fn(*args))  # compile
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best.append((time.perf_counter() - t) / reps)
    return min(best)


def parts(ctx: int, batch: int, budget: int, extent_tokens=32768, blk=64, n_kv=8, G=4, d=128):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload import ops
    from kvoffload.offload.pool import BlockTables
    from kvoffload.policies.clo import exact_scores
    from kvoffload.policies.tokenselect import choose_tokens, gather_rows, soft_vote, token_positions, token_space

    dt = jnp.bfloat16
    blocks = batch * ctx // blk
    per_ext = extent_tokens // blk
    n_ext = -(-blocks // per_ext)
    key = jax.random.key(0)
    keys = [jax.random.normal(jax.random.fold_in(key, e), (per_ext, n_kv, blk, d), dt) for e in range(n_ext)]
    vals = [jax.random.normal(jax.random.fold_in(key, 100 + e), (per_ext, n_kv, blk, d), dt) for e in range(n_ext)]
    # position-major: block j of request r is block id j * batch + r
    ids = (np.arange(ctx // blk)[None] * batch + np.arange(batch)[:, None])  # [B, ctx/blk]
    table, count = [], []
    for e in range(n_ext):
        t = np.zeros((batch, per_ext), np.int32)
        c = np.zeros(batch, np.int32)
        for r in range(batch):
            mine = ids[r][(ids[r] >= e * per_ext) & (ids[r] < (e + 1) * per_ext)] - e * per_ext
            t[r, :len(mine)] = mine
            c[r] = len(mine)
        table.append(jnp.asarray(t)), count.append(jnp.asarray(c))
    first = np.zeros(n_ext * per_ext, np.int32)
    first[ids.reshape(-1)] = (np.arange(ctx // blk)[None] * blk).repeat(batch, 0).reshape(-1)
    tables = BlockTables(table=tuple(table), count=tuple(count),
                         first_pos=tuple(jnp.asarray(first[e * per_ext:(e + 1) * per_ext]) for e in range(n_ext)))
    q = jax.random.normal(jax.random.fold_in(key, 7), (batch, n_kv * G, d), dt)
    pool_tokens = jnp.full((batch,), ctx, jnp.int32)
    context = pool_tokens + 1
    n_select = jnp.full((batch,), budget, jnp.int32)

    R = ctx // blk  # the most blocks one request owns (no generated blocks here)

    def space_of(per_request):
        return token_space(tables, blk, R if per_request else 0)

    def choose_in(per_request):
        def run(s):
            sp = space_of(per_request)
            return choose_tokens(s, sp.positions(tables), pool_tokens, context, n_select, budget, 4, 64, 1,
                                 token_ids=sp.token_ids())
        return jax.jit(run)

    fns = {}
    for tag, per_request in (("", True),) + ((("_pool", False),) if batch > 1 else ()):
        vote = jax.jit(lambda q, keys, pr=per_request: soft_vote(q, keys, tables, space=space_of(pr)))
        exact = jax.jit(lambda q, keys, pr=per_request: exact_scores(q, keys, tables, space_of(pr)))
        scores = vote(q, keys)
        fns.update({"soft_vote" + tag: (vote, q, keys), "exact" + tag: (exact, q, keys),
                    "top_k" + tag: (jax.jit(lambda s: jax.lax.top_k(s, budget)), scores),
                    "choose" + tag: (choose_in(per_request), scores)})
        if per_request:
            idx, nv = choose_in(True)(scores)
            tokens = scores.shape[-1]
    fns["space"] = (jax.jit(lambda t: token_space(t, blk, R)), tables)
    gather = jax.jit(lambda i: (gather_rows(keys, i, blk), gather_rows(vals, i, blk)))
    ks, vs = gather(idx)
    slot_ids = jnp.broadcast_to(jnp.arange(budget, dtype=jnp.int32), idx.shape)
    attend = jax.jit(lambda k, v: ops.sparse_attention(q, k, v, slot_ids, num_valid=nv))
    read_k = jax.jit(lambda ks: sum(jnp.sum(k.astype(jnp.float32)) for k in ks))
    fns.update(gather=(gather, idx), attend=(attend, ks, vs), read_k=(read_k, keys))
    us = lambda s: round(s * 1e6, 1)  # noqa: E731
    out = {"ctx": ctx, "batch": batch, "budget": budget, "pool_tokens": blocks * blk, "space_tokens": tokens,
           "extents": n_ext, "us": {name: us(timed(f, *a)) for name, (f, *a) in fns.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="32k:1:2048,128k:1:2048,32k:8:2048,32k:1:3277,128k:1:13108,8k:64:820",
                    help="CTX:BATCH:BUDGET,... (budget: tokens selected per request and KV head)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax

    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "runs": []}
    for item in args.runs.split(","):
        c, b, k = item.split(":")
        ctx = int(float(c[:-1]) * 1024) if c[-1] in "kK" else int(c)
        r = parts(ctx, int(b), int(k))
        print(json.dumps(r), flush=True)
        res["runs"].append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
