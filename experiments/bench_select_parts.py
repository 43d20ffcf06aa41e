#!/usr/bin/env python
"""Where a selection miss spends its time on the GPU: the pieces of `tokenselect`'s and
`clo`'s miss path timed alone at the speed benchmark's shapes (Llama-3-8B: 8 KV heads of 4 query heads,
d 128, bf16; a pool of the batch's contexts in 64-token blocks, position-major as the allocator places
prompts, extents of 32K tokens; the per-request space's bound is ctx / 64 blocks), each one jitted
program repeated back to back (GPU time, no host sync inside):

* ``space``       ``token_space``: each request's own blocks from the block tables (owners, compaction)
* ``soft_vote``   tokenselect's scores (every K row read once against its owner's query, softmax per head
                  over the request's tokens, group sums), laid out per request: [B, n_kv, T]
* ``exact``       clo's scores (max over the group of q.k), per request
* ``top_k``       ``jax.lax.top_k`` of the per-request scores [B, n_kv, T] (XLA sorts whole rows for a large k)
* ``choose``      ``choose_tokens``: forced sinks / recent, top-k (radix select, ascending), mapped to pool tokens
* ``*_pool``      (batch > 1) the same over the batch's whole pool, N = B x T tokens per request row: the
                  space scoring and top-k ran over before the per-request space
* ``gather``      the selected K and V rows from the device extents (``ops.gather_pool_rows``)
* ``attend``      ``ops.sparse_attention`` over the gathered rows
* ``read_k``      a plain read of every K row (the floor of any scoring)

With ``--clo-breakdown`` (the CLO paper's Fig. 11): clo's attention of one layer in four parts
(retrieval, transfer, cache management, attention; `clo_breakdown`) for exact and HATA retrieval at three miss
patterns (every head, one KV head per request, none), the parts' floors over bandwidths measured in the same
run, and `full`'s attention of the same pool; plotted by plot_clo_breakdown.py (``--smoke``: tiny, CPU).

    PYTHONPATH=src python experiments/bench_select_parts.py --out $OUT/select_parts.json
    PYTHONPATH=src python experiments/bench_select_parts.py --clo-breakdown --out $OUT/clo_breakdown.json
    python experiments/plot_clo_breakdown.py $OUT/clo_breakdown.json --out $OUT/clo_breakdown.png
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # bench_selection's bandwidth probes


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


def pool_arrays(ctx: int, batch: int, extent_tokens=32768, blk=64, n_kv=8, d=128):
    """(keys, vals, tables): a pool of the batch's contexts as the allocator places prompts (position-major:
    block j of request r is block id j * batch + r), in extents of extent_tokens tokens, K and V per extent
    [E, n_kv, blk, d] bf16 random in device memory, and the block tables."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.runtime.pool import BlockTables

    dt = jnp.bfloat16
    blocks = batch * ctx // blk
    per_ext = extent_tokens // blk
    n_ext = -(-blocks // per_ext)
    key = jax.random.key(0)
    keys = [jax.random.normal(jax.random.fold_in(key, e), (per_ext, n_kv, blk, d), dt) for e in range(n_ext)]
    vals = [jax.random.normal(jax.random.fold_in(key, 100 + e), (per_ext, n_kv, blk, d), dt) for e in range(n_ext)]
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
    return keys, vals, tables


def parts(ctx: int, batch: int, budget: int, extent_tokens=32768, blk=64, n_kv=8, G=4, d=128):
    import jax
    import jax.numpy as jnp

    from kvoffload import ops
    from kvoffload.policies.clo import exact_scores
    from kvoffload.policies.selection.choose import choose_tokens
    from kvoffload.policies.selection.space import token_space
    from kvoffload.ops import gather_pool_rows as gather_rows
    from kvoffload.policies.tokenselect import soft_vote

    dt = jnp.bfloat16
    blocks = batch * ctx // blk
    keys, vals, tables = pool_arrays(ctx, batch, extent_tokens, blk, n_kv, d)
    n_ext = len(keys)
    key = jax.random.key(0)
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


# ---------------------------------------------------------------------------------------------
# clo's per-layer breakdown (the CLO paper's Fig. 11)
# ---------------------------------------------------------------------------------------------

PARTS = ("retrieval", "transfer", "cache_management", "attention")
PATTERNS = ("all_miss", "one_head_misses", "all_hit")
BREAKDOWN_RUNS = "32k:1:3277,128k:1:13108,32k:8:3277"  # clo's top 10% of the context (bench_selection's topk)
# --smoke: tiny shapes for the CPU (a test runs them); the GPU runs use the defaults of clo_breakdown
SMOKE = dict(runs="512:1:96,256:2:80", extent_tokens=256, blk=16, n_kv=4, G=2, d=32, hata_bits=64, reps=2)


def miss_pattern(name: str, batch: int, n_kv: int):
    """[B, n_kv] bool: the (request, KV head) whose cached selection is not reused. one_head_misses: KV head 0
    of every request (1 of 8 at Llama-3-8B's shape; clo's replayed rate 0.86 gives ~1.1 of 8)."""
    import numpy as np

    miss = np.zeros((batch, n_kv), bool)
    if name == "all_miss":
        miss[:] = True
    elif name == "one_head_misses":
        miss[:, 0] = True
    elif name != "all_hit":
        raise ValueError(f"miss pattern must be one of {PATTERNS}, got {name!r}")
    return miss


def clo_breakdown(ctx: int, batch: int, budget: int, probes: dict, extent_tokens=32768, blk=64, n_kv=8, G=4,
                  d=128, hata_bits=128, reps=20, retrievals=("exact", "hata")) -> list:
    """clo's attention of one layer split into its parts, each the library's own functions in one jitted
    program timed alone (`timed`), per retrieval and miss pattern; one row per (retrieval, pattern):

    * retrieval: the token space, the scores (``exact_scores`` with ``skip`` = the hit heads: their keys are
      not read; ``hata_token_scores``: every head's codes, it has no skip) and ``choose_tokens`` (top-k over
      every head, as in the library, where the hit heads' picks are dropped; sinks and recent forced in, best
      first as clo without speculation asks)
    * transfer: ``HostRows`` of the K and V extents (V in pinned_host memory; K in device memory for exact,
      pinned_host for hata), the missed heads' selected rows only (a hit head's count is 0: its rows are -1
      and move nothing)
    * cache_management: the query cosines and group aggregation (``query_cosines``, ``aggregate_similarity``
      harmonic, against tau), the row buffers merged (hit heads' K and V buffers, the others' fetched rows),
      the indices and the cached queries updated
    * attention: ``ops.sparse_attention`` over the K and V row buffers (GPU), the same in every pattern
    With every head hitting, the library's ``lax.cond`` skips retrieval and transfer: 0 by construction,
    not measured (``not_run``). Floors: the bytes each part must move over the bandwidths of `probes`
    (bench_selection.bandwidth_probes, measured in this process). `full`'s attention of the same pool
    (``ops.paged_decode_attention`` per extent, merged, as the pipeline's attend_pool) comes with each row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvoffload import ops
    from kvoffload.device import memory as M
    from kvoffload.runtime.attention import PoolSources, attend_pool
    from kvoffload.policies.clo import aggregate_similarity, exact_scores, hata_token_scores, key_metadata
    from kvoffload.policies.selection.cache import query_cosines
    from kvoffload.policies.selection.choose import choose_tokens
    from kvoffload.policies.selection.rows import HostRows
    from kvoffload.policies.selection.space import token_space

    dt = jnp.bfloat16
    item = jnp.dtype(dt).itemsize
    H, K, R = n_kv * G, budget, ctx // blk
    keys, vals, tables = pool_arrays(ctx, batch, extent_tokens, blk, n_kv, d)
    v_host = jax.block_until_ready(M.to_host(vals))
    k_host = jax.block_until_ready(M.to_host(keys)) if "hata" in retrievals else None
    key = jax.random.key(1)
    q = jax.random.normal(jax.random.fold_in(key, 0), (batch, H, d), dt)
    cached_q = q.astype(jnp.float32) + 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (batch, H, d))
    w = jax.random.normal(jax.random.fold_in(key, 2), (n_kv, d, hata_bits), jnp.float32) / np.sqrt(d)
    meta = tuple(key_metadata(k, w, "hata", 1) for k in keys) if "hata" in retrievals else None
    weights, tau = jnp.ones((n_kv, G), jnp.float32), jnp.full((n_kv,), 0.8, jnp.float32)
    pool_tokens = jnp.full((batch,), ctx, jnp.int32)
    n_select = jnp.full((batch, n_kv), K, jnp.int32)

    def choose(scores, sp):
        return choose_tokens(scores, sp.positions(tables), pool_tokens, pool_tokens + 1, n_select, K, 4, 64, 1,
                             token_ids=sp.token_ids())

    retrieve = {
        "exact": jax.jit(lambda q, keys, miss: choose(
            exact_scores(q, keys, tables, token_space(tables, blk, R), skip=~miss), token_space(tables, blk, R))),
        "hata": jax.jit(lambda q, meta, w: choose(
            hata_token_scores(q, meta, w, tables, token_space(tables, blk, R)), token_space(tables, blk, R))),
    }
    transfer = jax.jit(lambda k_ext, v_ext, idx, miss_nv: HostRows(extents=(tuple(k_ext), tuple(v_ext)))(
        idx, miss_nv, (dt, dt), blk)[0])

    @jax.jit
    def manage(q, cached_q, miss, k_buf, v_buf, fetched, cached_idx, cached_nv, fresh_idx, fresh_nv):
        rule = aggregate_similarity(query_cosines(q, cached_q).reshape(batch, n_kv, G), weights, "harmonic") >= tau
        reuse = ~miss  # the pattern decides, as clo's replayed rate does; the rule is evaluated all the same
        hit = reuse[..., None, None]
        keep_q = jnp.repeat(reuse, G, axis=1)[..., None]
        return (rule, jnp.where(hit, k_buf, fetched[0]), jnp.where(hit, v_buf, fetched[1]),
                jnp.where(reuse[..., None], cached_idx, fresh_idx), jnp.where(reuse, cached_nv, fresh_nv),
                jnp.where(keep_q, cached_q, q.astype(jnp.float32)))

    attend = jax.jit(lambda q, k, v, nv: ops.sparse_attention(
        q, k, v, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), nv.shape + (K,)), num_valid=nv))

    @jax.jit
    def full_attention(q, keys, vals):  # `full`: every extent of the pool in device memory, the pipeline's fold
        src = PoolSources(k=tuple(keys), v=tuple(vals), x=(None,) * len(keys), recompute=jnp.int32(0))
        return attend_pool(None, None, q, ops.empty_attention(q), src, tables, None, "auto", "auto")[0]

    # one fresh selection (every head scored) gives the rows every pattern moves and attends
    idx, nv = jax.block_until_ready(retrieve["exact"](q, keys, jnp.ones((batch, n_kv), bool)))
    k_buf, v_buf = transfer(keys, v_host, idx, nv)  # the buffers as a previous miss left them
    cached_idx, cached_nv = jnp.roll(idx, 1, axis=1), nv
    hbm, pcie = probes["hbm_bytes_per_s"], probes.get("pcie_bytes_per_s") or float("nan")
    us = lambda s: round(s * 1e6, 1)  # noqa: E731
    row = d * item
    pool_kv = batch * ctx * n_kv * row  # K (or V) of the whole pool
    buffers = batch * n_kv * K * row  # one row buffer (K or V)
    full_us = us(timed(full_attention, q, keys, vals, reps=reps))
    attend_us = us(timed(attend, q, k_buf, v_buf, nv, reps=reps))
    out = []
    for retrieval in retrievals:
        k_src = keys if retrieval == "exact" else k_host
        for pattern in PATTERNS:
            miss = jnp.asarray(miss_pattern(pattern, batch, n_kv))
            miss_nv = jnp.where(miss, nv, 0)
            rows_moved = int(jnp.sum(miss_nv))  # per K or V
            t = {"attention": attend_us}
            if pattern != "all_hit":  # else the lax.cond skips both: 0 by construction
                args = (q, keys, miss) if retrieval == "exact" else (q, meta, w)
                t["retrieval"] = us(timed(retrieve[retrieval], *args, reps=reps))
                t["transfer"] = us(timed(transfer, k_src, v_host, idx, miss_nv, reps=reps))
            fetched = transfer(k_src, v_host, idx, miss_nv)
            t["cache_management"] = us(timed(manage, q, cached_q, miss, k_buf, v_buf, fetched, cached_idx, cached_nv,
                                             idx, nv, reps=reps))
            scored = int(jnp.sum(miss)) * pool_kv // (batch * n_kv) if retrieval == "exact" else batch * ctx * n_kv * hata_bits // 8
            hbm_bytes = {"retrieval": scored if pattern != "all_hit" else 0,
                         "transfer": rows_moved * row if retrieval == "exact" else 0,  # exact: K rows of the GPU
                         "cache_management": 3 * 2 * buffers,  # both buffers and the fetched rows read, one written
                         "attention": 2 * buffers}
            pcie_bytes = {"transfer": rows_moved * row * (1 if retrieval == "exact" else 2)}
            floor = {p: us(hbm_bytes[p] / hbm + pcie_bytes.get(p, 0) / pcie) for p in PARTS}
            out.append({"ctx": ctx, "batch": batch, "budget": K, "retrieval": retrieval, "pattern": pattern,
                        "pool_tokens": batch * ctx, "extents": len(keys), "missed_heads": int(jnp.sum(miss)),
                        "heads": batch * n_kv, "us": {p: t.get(p, 0.0) for p in PARTS},
                        "not_run": [p for p in PARTS if p not in t], "floor_us": floor, "hbm_bytes": hbm_bytes,
                        "pcie_bytes": pcie_bytes, "full_attention_us": full_us,
                        "full_attention_floor_us": us(2 * pool_kv / hbm)})
    return out


def breakdown_main(args) -> dict:
    import jax

    from bench_selection import bandwidth_probes

    shape = {k: SMOKE[k] for k in ("extent_tokens", "blk", "n_kv", "G", "d", "hata_bits", "reps")} if args.smoke else {}
    probes = bandwidth_probes(args.smoke)
    res = {"mode": "clo_breakdown", "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "probes": probes, "shape": shape or "Llama-3-8B: 8 KV heads of 4 query heads, d 128, bf16, blk 64",
           "parts": clo_breakdown.__doc__, "runs": []}
    for c, b, k in parse_runs(args.runs or (SMOKE["runs"] if args.smoke else BREAKDOWN_RUNS)):
        for r in clo_breakdown(c, b, k, probes, **shape):
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
    return res


def parse_runs(text: str) -> list:
    """[(ctx, batch, budget)] from CTX:BATCH:BUDGET,... (ctx as 32k or 32768)."""
    out = []
    for item in text.split(","):
        c, b, k = item.split(":")
        out.append((int(float(c[:-1]) * 1024) if c[-1] in "kK" else int(c), int(b), int(k)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=None,
                    help="CTX:BATCH:BUDGET,... (budget: tokens selected per request and KV head); default "
                         "32k:1:2048,128k:1:2048,32k:8:2048,32k:1:3277,128k:1:13108,8k:64:820, with --clo-breakdown "
                         f"{BREAKDOWN_RUNS}")
    ap.add_argument("--clo-breakdown", action="store_true",
                    help="clo's attention of one layer in four parts per miss pattern (clo_breakdown)")
    ap.add_argument("--smoke", action="store_true", help="with --clo-breakdown: tiny shapes, for the CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax

    if args.clo_breakdown:
        res = breakdown_main(args)
    else:
        res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "runs": []}
        for ctx, b, k in parse_runs(args.runs or "32k:1:2048,128k:1:2048,32k:8:2048,32k:1:3277,128k:1:13108,8k:64:820"):
            r = parts(ctx, b, k)
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
