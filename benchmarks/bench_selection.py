#!/usr/bin/env python
"""Speed of the selection policies on one GPU: `full`, `tokenselect` (kv=gpu, kv=split),
`offload`, `clo` (exact keys, HATA codes) in the Llama-3-8B shape (32 layers, 32/8 heads, d 128), bf16 random
weights, contexts 32K and 128K, batch 1 and 8; one call, JSON after every run, a markdown table last.

    PYTHONPATH=src python benchmarks/bench_selection.py --out $OUT/bench_selection.json --budget-s 540
    PYTHONPATH=src python benchmarks/bench_selection.py --only clo_exact:128k:1,full:128k:1 --step-extremes
    PYTHONPATH=src python benchmarks/bench_selection.py --cpu-smoke --out /tmp/sel.json   # CPU, tiny, < 20 s
    PYTHONPATH=src python benchmarks/bench_selection.py --tensor-parallel 2 --only full:32k:1,clo_exact:32k:1

``--tensor-parallel N``: every run on an N-device mesh (policies' tensor_parallel; weights placed Megatron-style
once, before the runs; the memory check per device). On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N.

What is measured, per (policy, context, batch); the JSON's "method" says the same:

* **Hit rates are replayed.** Random weights give unrelated queries from step to step, so the similarity rule
  would almost never reuse a selection. `tokenselect` and `clo` run with ``replay_hit_rate`` (the policies'
  option): each look at a valid cached selection (request, layer, KV head, step) reuses it with the given
  probability, a seeded Bernoulli draw on the device; the similarity is still computed. Defaults: clo 0.86
  (T+G, exact keys, measured on RULER with SmolLM2), tokenselect 0.8 (a placeholder until measured):
  --hit-rate-clo / --hit-rate-tokenselect take a number or one per layer (a list of another length is
  resampled over relative depth). A miss re-selects from a random query: its rows are mostly new (a real
  model's next selection overlaps its last one more), so row fetches on misses are the pessimistic side.
* **Prefill writes random K/V.** A real 128K prefill of 32 layers is minutes of attention; the decode step is
  what is measured. The script replaces the pipeline's per-layer prefill program (`pipeline._layer_prefill`,
  patched in this process only) by one returning random K/V of the prompt's shape; everything else is the
  runtime's own prefill (memory plan and check, pool layout, extents in host or GPU memory, tails, HATA codes
  from the keys) and the decode is unmodified. The plan counts a chunked prefill (prefill_chunk_tokens 8192).
* **Decode step**: `warmup` steps (compilation), then `steps` steps each ending with its tokens on the host
  (as `offload/bench.py`'s `timed_decode`); the median. Hit rates, scoring and bytes over the timed steps.
  Then "as generate": --generate-windows windows of `engine.SYNC_EVERY` steps, the host reading the device once a
  window as `engine.generate` does (it dispatches the next step while the device runs this one, so the host's
  work before a step's first large program is hidden); the median window's time per step.
* **Attention per layer** (a jitted microbenchmark): the policy's `attend` (what the layer program folds
  the pool with: scoring, top-k, cache decision, gathers, sparse or paged attention; not the GPU tail's few
  tokens) on the run's own state for layer L/2 (clo's layer 0 attends everything), `attn_reps` fresh random
  queries with the slots carried from call to call, so the replayed draws vary. Where every source is in GPU
  memory: one `lax.scan` program (GPU time per call); where some are in pinned host memory (kv=split, clo):
  back-to-back jitted calls waited for once (a loop would make the host arrays operands of a while loop,
  which the decode step never does), which includes host dispatch the GPU cannot hide (--attn-method).
  Also with the rate forced to 0 (every head misses) and 1 (every head hits where valid). `offload`: over
  extents already fetched (the transfer is the PCIe floor below).
* **Floors**: bytes the attention must read in GPU memory over the measured copy bandwidth (a jitted
  read+write probe), plus bytes it reads over PCIe (selected rows gathered from pinned host memory, on the
  compute stream) over the measured host->GPU rate; counts (scoring steps, rows fetched) from the
  microbenchmark itself. `full`: K+V of the pool. tokenselect: the scored fraction of K + the selected rows of
  K and V (kv=split: V rows over PCIe). clo: scored fraction of K (exact) or of the HATA codes + the row
  buffers; V rows (and K for HATA) fetched on misses over PCIe.
* **Memory**: the planner's plan (host / GPU parts) and the state's arrays by part and memory kind (pool
  extents, GPU tails, slots: selection caches, row buffers, metadata); `jax` memory_stats (in use after the
  steps; the peak is process-wide, so it only grows across runs). Runs that do not fit are the planner's
  refusal (MemoryPlanError, nothing allocated), checked against the card's memory as a fresh process would.
"""

import os
import sys

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

# name -> (policy, options, which hit rate it replays: "tokenselect", "clo", a number, or None). clo's top 10%
# is given as a count, topk = 10% of the context ("topk_of_context"); the prompts here are all of one length,
# so the count is the ratio (topk_ratio sizes the slots by the most tokens one request can own,
# `request_token_bound`, the same here).
VARIANTS = {
    "full": ("full", {}, None),
    "tokenselect_gpu": ("tokenselect", {"kv": "gpu"}, "tokenselect"),
    "tokenselect_split": ("tokenselect", {"kv": "split"}, "tokenselect"),
    # the vote over an int8 copy of the keys (`selection.vote_keys`)
    "tokenselect_gpu_int8vote": ("tokenselect", {"kv": "gpu", "vote_keys": "int8"}, "tokenselect"),
    "clo_exact": ("clo", {"retrieval": "exact", "topk_of_context": 0.1}, "clo"),
    "clo_hata": ("clo", {"retrieval": "hata", "topk_of_context": 0.1}, "clo"),
    "clo_quest": ("clo", {"retrieval": "quest", "topk_of_context": 0.1}, "clo"),
    "clo_exact_int4": ("clo", {"retrieval": "exact", "topk_of_context": 0.1, "host_dtype": "int4"}, "clo"),  # int4 rows
    # the "naive top-k offload" baseline: the same selection, no cache, no speculative prefetch
    "clo_naive": ("clo", {"retrieval": "exact", "topk_of_context": 0.1, "speculative_prefetch": False}, 0.0),
    # the same for clo's Quest selection (as clo_quest: a naive baseline of the selection compared)
    "clo_quest_naive": ("clo", {"retrieval": "quest", "topk_of_context": 0.1, "speculative_prefetch": False}, 0.0),
    "offload": ("offload", {}, None),
}
DEFAULT_POLICIES = ("full", "tokenselect_gpu", "tokenselect_split", "offload", "clo_exact", "clo_hata")
COST_RANK = {name: i for i, name in enumerate(
    ("full", "tokenselect_gpu", "tokenselect_gpu_int8vote", "tokenselect_split", "clo_exact", "clo_exact_int4", "clo_hata", "clo_quest",
     "clo_naive", "clo_quest_naive", "offload"))}
GB = 1e9


def parse_tokens(text: str) -> int:
    """'32768', '32k' (x 1024), '1m' (x 2^20)."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1 << 20}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def parse_rate(text: str):
    """A number or a comma list (one per layer)."""
    vals = [float(x) for x in str(text).split(",") if x.strip()]
    return vals[0] if len(vals) == 1 else vals


def per_layer(rate, num_layers: int):
    """rate as the policies take it: a number, or one per layer (a list of another length resampled over
    relative depth: measured on one model, replayed on another shape). Returns (rate, note)."""
    if np.ndim(rate) == 0 or len(rate) == num_layers:
        return rate, None
    src = np.linspace(0, 1, len(rate))
    out = np.interp(np.linspace(0, 1, num_layers), src, np.asarray(rate, float))
    return [round(float(x), 6) for x in out], f"{len(rate)} per-layer rates resampled to {num_layers} layers by depth"


def parse_options(pairs):
    """--option VARIANT:KEY=VALUE (VALUE as JSON, else a string) -> {variant: {key: value}}."""
    out: dict = {}
    for pair in pairs:
        if ":" not in pair or "=" not in pair:
            raise SystemExit(f"--option takes VARIANT:KEY=VALUE, got {pair!r}")
        name, kv = pair.split(":", 1)
        k, v = kv.split("=", 1)
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            pass
        out.setdefault(name, {})[k] = v
    return out


from kvoffload import ops  # noqa: E402
# random K/V instead of the prefill's layer programs (shared with benchmarks/bench_long_context.py)
from _common import random_kv_prefill  # noqa: E402
from kvoffload.profile import scope_breakdown  # noqa: E402


# ------------------------------------------------------------------------------------------------
# probes
# ------------------------------------------------------------------------------------------------


def bandwidth_probes(smoke: bool) -> dict:
    """GPU memory bandwidth (a jitted x * 2 reading and writing an array), host->GPU bandwidth (an eager
    device_put of one pinned_host array) and, on a GPU, the zero-copy row gather's rate out of a 2 GiB pool,
    measured here."""
    from _common import median_time

    import jax
    import jax.numpy as jnp

    from kvoffload.device import memory as M

    n = (16 if smoke else 512) << 20  # bytes
    out = {}
    x = jnp.ones((n // 2,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2)
    t = median_time(lambda: double(x))
    out["hbm_bytes_per_s"] = 2 * n / t
    out["hbm_probe"] = f"jit(x * 2) over {n >> 20} MiB bf16 (read + write), median of 5: {t * 1e6:.1f} us"
    del x
    kind, _ = M.host_memory_kind()
    if kind is None:
        out["pcie_bytes_per_s"] = None
        out["pcie_probe"] = "no host memory kind on this backend"
        return out
    h = jax.block_until_ready(M.to_host(jnp.ones((n // 2,), jnp.bfloat16)))
    t = median_time(lambda: M.to_device(h))
    out["pcie_bytes_per_s"] = n / t
    out["pcie_probe"] = f"device_put of one {n >> 20} MiB {kind} array to the device, median of 5: {t * 1e3:.2f} ms"
    del h
    if jax.default_backend() == "gpu":  # the zero-copy row gather out of a 2 GiB pool (its rate falls with the
        # pool's size and swings between processes: BENCHMARKS 'Transfer probes')
        import numpy as np

        from kvoffload.pallas import gather as ga

        E, n_kv, blk, d, rows = 16384, 8, 64, 128, 13107
        try:
            pool = jax.block_until_ready(M.to_host(jnp.ones((E, n_kv, blk, d), jnp.bfloat16)))
            tok = np.stack([np.sort(np.random.default_rng(h).permutation(E * blk)[:rows]) for h in range(n_kv)])[None]
            b, o = jnp.asarray(tok // blk, jnp.int32), jnp.asarray(tok % blk, jnp.int32)
            gather = jax.jit(ga.gather_rows_kernel)
            t = median_time(lambda: gather(pool, b, o))
            out["row_gather_bytes_per_s"] = rows * n_kv * d * 2 / t
            out["row_gather_probe"] = (f"kvo_gather_rows of {rows} random rows x {n_kv} heads (bf16, d {d}) from a "
                                       f"2 GiB {kind} extent, median of 5: {t * 1e6:.1f} us")
        except Exception as e:  # noqa: BLE001  (a diagnostic: the runs go on without it)
            out["row_gather_probe"] = f"failed: {type(e).__name__}: {e}"[:500]
    return out


def memory_stats() -> dict:
    from kvoffload.device import memory as M

    try:
        s = M.default_device().memory_stats() or {}
    except Exception:  # noqa: BLE001  (a backend without memory stats)
        s = {}
    return {k: s.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def state_bytes(state) -> dict:
    """Bytes of the decode state's arrays by part and memory kind ('device' or the host kind)."""
    import jax

    from kvoffload.device import memory as M

    out: dict = {}

    def add(part, tree):
        for a in jax.tree.leaves(tree):
            kind = M.memory_kind_of(a) or "device"
            key = f"{part} ({'GPU' if kind == 'device' else kind})"
            out[key] = out.get(key, 0) + int(a.nbytes)

    for gr in state.groups:
        add("pool K", gr.pool_k)
        add("pool V", gr.pool_v)
        add("pool X", gr.pool_x)
        add("GPU tails", (gr.tail_k, gr.tail_v, gr.tail_x))
        add("slots", gr.slots)
    out["gpu_kv_total"] = sum(v for k, v in out.items() if k.endswith("(GPU)"))
    return out


# ------------------------------------------------------------------------------------------------
# counters of the selection policies' slots
# ------------------------------------------------------------------------------------------------


def counters(state) -> dict | None:
    """Summed over requests, GPU batches and layers: hits, looks (request steps x KV heads that can hit: not
    clo's persistent ones), scoring runs, V rows fetched (clo); None for a policy without slots."""
    if not state.groups[0].slots:
        return None
    c = {"hits": 0, "looks": 0, "scored": 0, "v_rows": 0, "rule_hits": 0}
    for gr in state.groups:
        for s in gr.slots:
            sel = getattr(s, "selection", s)
            c["hits"] += int(np.asarray(sel.hits).sum())
            # clo's persistent heads (layer 0) never count a hit: looks of the cached heads only
            heads = int((~np.asarray(s.persistent)).sum()) if hasattr(s, "persistent") else int(sel.hits.shape[1])
            c["looks"] += int(np.asarray(sel.steps).sum()) * heads
            c["scored"] += int(sel.scored)
            if hasattr(s, "v_rows_fetched"):
                c["v_rows"] += int(np.asarray(s.v_rows_fetched).sum())
                if getattr(s, "spec_rows_fetched", None) is not None:
                    c["v_rows"] += int(np.asarray(s.spec_rows_fetched).sum())
            if sel.replay is not None:
                c["rule_hits"] += int(np.asarray(sel.rule_hits).sum())
    return c


def with_rate(slot, rate):
    """A layer's slots with its replayed reuse probability set to rate."""
    import jax
    import jax.numpy as jnp

    sel = getattr(slot, "selection", slot)
    rate = jax.device_put(jnp.asarray(rate, jnp.float32), sel.replay.rate.sharding)  # committed like the slots
    sel = dataclasses.replace(sel, replay=dataclasses.replace(sel.replay, rate=rate))
    return dataclasses.replace(slot, selection=sel) if hasattr(slot, "selection") else sel


# ------------------------------------------------------------------------------------------------
# the attention microbenchmark
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _scan_attend():
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnames=("cfg", "attend", "impls"))
    def run(cfg, attend, impls, lp, qs, src, tables, slot):
        def body(carry, q):
            slot, total = carry
            acc, slot = attend(cfg, lp, q, ops.empty_attention(q), src, tables, slot, *impls)
            return (slot, total + sum(jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0)) for a in acc)), None

        (slot, total), _ = jax.lax.scan(body, (slot, jnp.zeros((), jnp.float32)), qs)
        return slot, total

    return run


@functools.lru_cache(maxsize=None)
def _attend_once():
    import jax

    @functools.partial(jax.jit, static_argnames=("cfg", "attend", "impls"))
    def run(cfg, attend, impls, lp, q, src, tables, slot):
        acc, slot = attend(cfg, lp, q, ops.empty_attention(q), src, tables, slot, *impls)
        return acc, slot

    return run


def time_attend(method, cfg, attend, impls, lp, qs, src, tables, slot, timing_reps):
    """(seconds per call, the slots after the calls, first call's seconds) of `reps` = len(qs) calls of
    attend carrying the slots: "scan" one program (a lax.scan: GPU time, no dispatch), "calls" one jitted call
    per query dispatched back to back and waited for once (as the decode step's layer programs: arrays in host
    memory stay plain arguments of the program, never operands of a loop)."""
    from _common import median_time

    import jax

    reps = qs.shape[0] if method == "scan" else len(qs)
    if method == "scan":
        run = _scan_attend()
        call = lambda: run(cfg, attend, impls, lp, qs, src, tables, slot)  # noqa: E731
    else:
        once = _attend_once()

        def call():
            s, outs = slot, []
            for q in qs:
                acc, s = once(cfg, attend, impls, lp, q, src, tables, s)
                outs.append(acc)
            return s, outs
    t0 = time.perf_counter()
    out_slot, _ = jax.block_until_ready(call())
    first = time.perf_counter() - t0
    return median_time(call, timing_reps) / reps, out_slot, first


def attention_bench(pol, model, state, layer: int, reps: int, extremes: bool, timing_reps: int,
                    method: str = "auto") -> dict:
    """GPU seconds per call of the policy's attend for `layer` on the run's state (module doc), with the
    counts the floors need."""
    import jax
    import jax.numpy as jnp

    from kvoffload.device import memory as M

    pipe, hooks = pol.pipeline, pol.pipeline.hooks
    cfg = model.config
    gr = state.groups[0]
    plan = hooks.plan_group(pipe, model, gr)
    early, late = hooks.fetch(pipe, gr, plan, layer)
    fetched = (pipe.to_device(early) if early else [], pipe.to_device(late) if late else [])
    src = hooks.sources(pipe, gr, plan, layer, fetched)
    slot = gr.slots[layer] if gr.slots else None
    lp = pipe.layers(model)[layer]
    dtype = lp.wk.dtype
    qs = jax.random.normal(jax.random.key(11), (reps, gr.size, cfg.num_heads, cfg.head_dim), dtype)
    impls = (pipe.opts.recompute_impl, pipe.opts.attention_impl)
    if method == "auto":  # a loop whose operands live in host memory: what XLA does with them is not the step's
        on_host = any((M.memory_kind_of(a) or "device") != "device" for a in jax.tree.leaves(src))
        method = "calls" if on_host else "scan"
    if method == "calls":
        qs = list(qs)

    def timed(s):
        t, out_slot, first = time_attend(method, cfg, hooks.attend, impls, lp, qs, src, gr.tables, s, timing_reps)
        res = {"s_per_call": t, "first_call_s": first}
        if s is not None:
            sel0, sel1 = getattr(s, "selection", s), getattr(out_slot, "selection", out_slot)
            looks = reps * int(np.prod(sel0.hits.shape))
            res["hit_rate"] = int(np.asarray(sel1.hits - sel0.hits).sum()) / looks
            res["scored_fraction"] = int(sel1.scored - sel0.scored) / reps
            if hasattr(s, "v_rows_fetched"):
                rows = np.asarray(out_slot.v_rows_fetched - s.v_rows_fetched).sum()
                res["v_rows_fetched_per_call"] = float(rows) / reps
        return res

    out = {"layer": layer, "reps": reps, "method": method, "method_note": {
        "scan": "one jitted lax.scan of the policy's attend over fresh random queries (slots carried): GPU time per call",
        "calls": "one jitted attend per fresh random query (slots carried), dispatched back to back, one wait: "
                 "includes any host dispatch the GPU cannot hide"}[method]}
    out["replayed"] = timed(slot)
    replay = slot is not None and getattr(slot, "selection", slot).replay is not None
    if extremes and replay:
        out["all_miss"] = timed(with_rate(slot, 0.0))
        out["all_hit"] = timed(with_rate(slot, 1.0))
    # the floors' inputs: the layer's pool tokens and what one call must read
    blk = gr.layout.block_tokens
    pool_tokens = sum(len(t) for t in gr.alloc.tables) * blk
    itemsize = jnp.dtype(dtype).itemsize
    out["pool_tokens"] = pool_tokens
    out["bytes"] = attention_bytes(pol, cfg, slot, pool_tokens, itemsize, out)
    del fetched, src
    return out


def gathered_row_bytes(pol, d: int, itemsize: int) -> int:
    """Bytes one gathered token moves per KV head, as the host pool stores them (int4: codes + scales): its V row,
    and its K row where K is on the host too (clo quest / hata)."""
    pipe = pol.pipeline
    k_too = not pipe.hooks.capabilities.keys_on_device
    return pipe.host_row_bytes(d, itemsize) + (pipe.host_row_bytes(d, itemsize, key=True) if k_too else 0)


def attention_bytes(pol, cfg, slot, pool_tokens: int, itemsize: int, bench: dict) -> dict:
    """Bytes one call of the layer's attend must read, per case of the microbenchmark: {case: (GPU memory
    bytes, PCIe bytes)} from the measured scoring fraction and rows fetched."""
    n_kv, row = cfg.num_kv_heads, cfg.head_dim * itemsize
    kv_pool = pool_tokens * n_kv * row  # K (or V) of every pool token of the layer
    name = pol.name
    hooks = pol.pipeline.hooks
    out = {}
    for case in ("replayed", "all_miss", "all_hit"):
        m = bench.get(case)
        if m is None:
            continue
        if slot is None:  # full, offload: K and V of the pool
            out[case] = (2 * kv_pool, 0)
            continue
        sel = getattr(slot, "selection", slot)
        rows = int(np.prod(sel.indices.shape)) * row  # every selected row of K (or V) of the batch
        f = m["scored_fraction"]
        if name == "tokenselect":
            split = hooks.split
            # vote over every K row when some head misses; the selected K rows, the V rows (kv=split: over PCIe)
            out[case] = (f * kv_pool + (1 if split else 2) * rows, rows if split else 0)
        else:  # clo: scoring (exact K, HATA codes or Quest pages), the K rows and the V buffer, rows over PCIe
            retrieval = hooks.attend.retrieval
            if retrieval == "hata":
                score = pool_tokens * n_kv * (hooks.hata_bits // 8)
            elif retrieval == "quest":  # a min and a max key per page (int8: a byte a channel, a scale a page)
                pages = pool_tokens // hooks.attend.page_size * n_kv
                int8 = hooks.attend.quest_dtype == "int8"
                score = pages * (2 * cfg.head_dim + 4) if int8 else 2 * kv_pool // hooks.attend.page_size
            else:
                score = kv_pool
            fetched = m.get("v_rows_fetched_per_call", 0.0) * gathered_row_bytes(pol, cfg.head_dim, itemsize)
            out[case] = (f * score + 2 * rows, fetched)
    return out


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------


def run_one(args, model, variant: str, ctx: int, batch: int, rate_override, probes: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from kvoffload.engine import SYNC_EVERY
    from _common import decode_windows, host_gauge
    from kvoffload.offload.bench import decode_steps, timed_decode
    from kvoffload.plan.memory import MemoryPlanError
    from kvoffload.policies import make_policy

    cfg = model.config
    policy, vopts, rate_of = VARIANTS[variant]
    opts = {"block_tokens": 64, "prefill_chunk_tokens": min(8192, ctx), **vopts, **args.extra.get(variant, {})}
    if args.tensor_parallel > 1:
        opts["tensor_parallel"] = args.tensor_parallel
    share = opts.pop("topk_of_context", None)
    if share is not None and "topk" not in opts and "topk_ratio" not in opts:  # an --option's budget wins
        opts["topk"] = max(math.ceil(share * ctx), opts.get("num_sink", 4) + opts.get("num_recent", 64))
    rate = rate_override if rate_override is not None else (
        rate_of if isinstance(rate_of, float) else {"tokenselect": args.hit_rate_tokenselect,
                                                    "clo": args.hit_rate_clo}.get(rate_of))
    note = None
    if rate_of is not None:
        rate, note = per_layer(rate, cfg.num_layers)
        opts["replay_hit_rate"] = rate
    r = {"variant": variant, "policy": policy, "context": ctx, "batch": batch, "options": dict(opts),
         "replay_hit_rate": rate if rate_of is not None else None}
    if note:
        r["replay_note"] = note
    base = memory_stats()
    # one device's weights (its shard on a mesh): what the device's memory_stats count
    weights_bytes = int(sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(model.params)))
    if args.host_limit_gb is not None:
        opts["host_memory_limit_gb"] = args.host_limit_gb
    if base["bytes_limit"] is not None:  # the card's budget as a fresh process sees it: the weights are in the plan
        opts["gpu_memory_limit_gb"] = (base["bytes_limit"] - base["bytes_in_use"] + weights_bytes) / GB
    pol = make_policy(policy, **opts)
    lengths = np.full((batch,), ctx, np.int64)
    capacity = ctx + args.warmup + args.steps + 1 + args.generate_windows * SYNC_EVERY
    try:
        pol.pipeline.plan(model, lengths, ctx, capacity)
    except MemoryPlanError as e:
        r["refused"] = str(e)
        r["memory_plan"] = plan_json(pol.pipeline.memory_plan)
        return r
    r["memory_plan"] = plan_json(pol.pipeline.memory_plan)
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size - 1, (batch, ctx)), jnp.int32)
    with random_kv_prefill(pol.pipeline.mesh):
        prefill_s, warm, logits, state, nxt = timed_decode(pol, model, tokens, jnp.asarray(lengths, jnp.int32),
                                                            capacity, args.warmup)
    del tokens
    c0 = counters(state)
    issued = []
    gauge = [host_gauge()]
    times, _, state, nxt = decode_steps(pol, model, state, nxt, args.steps, issued=issued)
    gauge.append(host_gauge())
    c1 = counters(state)
    # the host's share of each step: a step ending within ~1 ms of its last dispatch is host-bound; the host's
    # speed just before and after the timed steps (`host_gauge`)
    r.update(prefill_random_kv_s=prefill_s, warmup_step_times_s=warm, step_times_s=times,
             step_s=float(np.median(times)), host_issued_s=issued,
             host_slack_s=float(np.median(np.subtract(times, issued))), host_gauge=gauge)
    recs = state.records[-len(times):]
    flushed = [bool(x.get("flushed")) for x in recs]
    r["flush_step_times_s"] = [t for t, f in zip(times, flushed) if f]  # a flush's writes (their first compiles)
    r["step_s_without_flushes"] = float(np.median([t for t, f in zip(times, flushed) if not f] or [np.nan]))
    # the mean over the timed steps but a run's first flush (it compiles the flush's programs): a steady flush
    # (one every block_tokens steps) is in it, which the median hides
    first = flushed.index(True) if any(flushed) else None
    r["step_s_mean"] = float(np.mean([t for i, t in enumerate(times) if i != first] or [np.nan]))
    r["bytes_h2d_per_step"] = float(np.mean([x.get("bytes_h2d", 0) for x in recs]))  # whole extents fetched
    if args.generate_windows:  # the step as `engine.generate` runs it: the host a step ahead, one read a window
        win, state, nxt = decode_windows(pol, model, state, nxt, args.generate_windows, SYNC_EVERY)
        # the median window: a flush (one every block_tokens steps) falls in some windows, not most
        r.update(generate_window_step_s=win, generate_step_s=float(np.median(win)), generate_window=SYNC_EVERY)
    if c1 is not None:
        looks = max(1, c1["looks"] - c0["looks"])
        r["hit_rate_timed_steps"] = (c1["hits"] - c0["hits"]) / looks
        r["similarity_rule_hit_rate_timed_steps"] = (c1["rule_hits"] - c0["rule_hits"]) / looks
        r["scored_fraction_timed_steps"] = (c1["scored"] - c0["scored"]) / (len(times) * cfg.num_layers * len(state.groups))
        itemsize = jnp.dtype(model.params.layers[0].wk.dtype).itemsize
        row = pol.pipeline.host_row_bytes(cfg.head_dim, itemsize)  # as the host pool stores it
        if policy == "clo":  # clo's counters: rows of the missed heads (and the guesses')
            rows_kv = gathered_row_bytes(pol, cfg.head_dim, itemsize)
            r["bytes_rows_per_step"] = (c1["v_rows"] - c0["v_rows"]) * rows_kv / len(times)
            r["bytes_rows_note"] = "clo's counters: V rows (and K for quest / hata) of missed heads, guesses included"
        elif pol.pipeline.hooks.split:  # tokenselect kv=split gathers every selected V row each step
            K = state.groups[0].slots[0].indices.shape[-1]
            r["bytes_rows_per_step"] = sum(gr.size for gr in state.groups) * cfg.num_kv_heads * K * row * cfg.num_layers
            r["bytes_rows_note"] = "from shapes: kv=split gathers the K selected V rows per head every step"
        desc = pol.describe(state)
        sel = desc.get("clo") or desc.get("selection") or {}
        r["selected_per_head"] = sel.get("selected_per_head")
        r["hit_rate_per_layer_run"] = sel.get("hit_rate_per_layer")
        if "speculative_prefetch" in sel:
            r["speculative_prefetch"] = {k: v for k, v in sel["speculative_prefetch"].items()
                                         if k != "guess_hit_rate_per_layer"}
    if args.trace:  # one more step under the profiler (experiments/trace_summary.py reads it)
        path = fresh_dir(os.path.join(args.trace, f"{variant}_{ctx}_{batch}"))
        with jax.profiler.trace(path):
            _, _, state, nxt = decode_steps(pol, model, state, nxt, 1)
        r["trace_dir"] = path
        try:  # the traced step's device time by the runtime's named scopes (the CLO paper's Fig. 11 parts)
            r["scope_breakdown"] = layer_breakdown(scope_breakdown(path), cfg.num_layers)
            r["scope_breakdown"]["traced_step_flushed"] = bool(state.records[-1].get("flushed"))
        except Exception as e:  # noqa: BLE001  (keep the step numbers)
            r["scope_breakdown_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    r["state_bytes"] = state_bytes(state)
    r["memory_stats_after"] = memory_stats()
    if base["bytes_in_use"] is not None and r["memory_stats_after"]["bytes_in_use"] is not None:
        r["gpu_bytes_in_use_over_baseline"] = r["memory_stats_after"]["bytes_in_use"] - base["bytes_in_use"]
    del logits
    layer = cfg.num_layers // 2
    try:
        from kvoffload.device import sharding as S

        with S.context(pol.pipeline.mesh):  # a mesh run's attend traces per device (its kernels: per_shard)
            a = attention_bench(pol, model, state, layer, args.attn_reps, not args.no_extremes, args.timing_reps,
                                args.attn_method)
        r["attention"] = a
        floors = {}
        for case, (hbm, pcie) in a["bytes"].items():
            fl = hbm / probes["hbm_bytes_per_s"] + (pcie / probes["pcie_bytes_per_s"] if pcie and probes.get(
                "pcie_bytes_per_s") else 0.0)
            floors[case] = {"hbm_bytes": hbm, "pcie_bytes": pcie, "floor_s": fl,
                            "measured_over_floor": a[case]["s_per_call"] / fl if fl else None}
        a["floors"] = floors
    except Exception as e:  # noqa: BLE001  (keep the step numbers)
        r["attention_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    if policy == "offload" and probes.get("pcie_bytes_per_s"):
        r["step_pcie_floor_s"] = r["bytes_h2d_per_step"] / probes["pcie_bytes_per_s"]
    del state, nxt, pol
    gc.collect()
    return r


def fresh_dir(path: str) -> str:
    """path, or path_2, path_3, ... where path is taken: a second run of one variant into the same --trace
    folder must not mix its trace files with the first's (the trace summary reads every file of a folder)."""
    n, out = 1, path
    while os.path.exists(out):
        n += 1
        out = f"{path}_{n}"
    return out


def plan_json(plan):
    if plan is None:
        return None
    skip = {"weights", "logits", "weights in flight", "prefill weights in flight", "prefill workspace",
            "recompute workspace", "dequantize workspace", "transfer buffers"}
    return {"host_bytes": plan.host_bytes, "gpu_bytes": plan.gpu_bytes, "host": plan.host, "gpu": plan.gpu,
            "gpu_kv_bytes": int(sum(v for k, v in plan.gpu.items() if k not in skip)), "describe": plan.describe()}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------


def run_list(args, num_layers: int) -> list:
    """(variant, ctx, batch, rate override) in cheap-first order (tokens in the batch, then policy cost);
    --step-extremes adds the selective runs at rates 0 and 1 after them."""
    if args.only:
        runs = []
        for item in args.only.split(","):
            v, c, b = item.split(":")
            runs.append((v, parse_tokens(c), int(b), None))
    else:
        runs = [(v, c, b, None) for c in args.contexts for b in args.batches for v in args.policies]
    for v, *_ in runs:
        if v not in VARIANTS:
            raise SystemExit(f"unknown policy variant {v!r}; choose from {', '.join(VARIANTS)}")
    runs.sort(key=lambda x: (x[1] * x[2], COST_RANK[x[0]]))
    if args.step_extremes:
        runs += [(v, c, b, rate) for rate in (0.0, 1.0) for v, c, b, _ in list(runs)
                 if VARIANTS[v][2] in ("tokenselect", "clo")]
    return runs


def fmt(x, spec="{:.2f}", scale=1.0):
    return spec.format(x * scale) if isinstance(x, (int, float)) else "-"


def layer_breakdown(b: dict, num_layers: int) -> dict:
    """A step's scope breakdown (`kvoffload.profile.scope_breakdown`) with the mean layer's parts (every program
    but the embedding and logits, over the model's layers)."""
    layer = collections.Counter()
    for prog in b["programs"].values():
        for part, sec in prog["parts"].items():
            if part != "embedding and logits":
                layer[part] += sec / num_layers
    b["per_layer"] = dict(layer.most_common())
    return b


def note_of(r) -> str:
    """The table's note: the timed flush steps (a flush's first compiles its writes) and why the attention
    microbenchmark did not run."""
    parts = []
    if r.get("flush_step_times_s"):
        parts.append("flush steps " + ", ".join(f"{1e3 * t:.1f}" for t in r["flush_step_times_s"]) + " ms")
    if r.get("attention_error"):
        parts.append(r["attention_error"][:80])
    return "; ".join(parts)


def table(doc) -> str:
    rows = [r for r in doc["runs"]]
    full = {(r["context"], r["batch"]): r for r in rows if r["variant"] == "full" and "step_s" in r}
    lines = [f"device {doc['meta']['device']} | jax {doc['meta']['jax']} | {doc['meta']['shape']} "
             f"{doc['meta']['dtype']} | HBM {fmt(doc['meta']['probes']['hbm_bytes_per_s'], '{:.0f}', 1e-9)} GB/s, "
             f"h2d {fmt(doc['meta']['probes'].get('pcie_bytes_per_s'), '{:.1f}', 1e-9)} GB/s, row gather "
             f"{fmt(doc['meta']['probes'].get('row_gather_bytes_per_s'), '{:.1f}', 1e-9)} GB/s (2 GiB pool) (measured)",
             "",
             "| policy | ctx | b | replay | step ms | / full | mean ms | as generate ms | / full | "
             "attn/layer us (replay / miss / hit) | "
             "floor us | attn/floor | hit rate | GPU KV GB (state) | / full | rows or extents MB/step | note |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        key = (r["context"], r["batch"])
        f = full.get(key)
        rate = r.get("replay_hit_rate")
        rate = "-" if rate is None else (f"{rate:.2f}" if np.ndim(rate) == 0 else "per layer")
        ctx = f"{r['context'] // 1024}K" if r["context"] % 1024 == 0 else str(r["context"])
        head = f"| {r['variant']} | {ctx} | {r['batch']} | {rate} |"
        if "step_s" not in r:
            why = r.get("refused") or r.get("error") or r.get("skipped") or "?"
            tag = "REFUSED" if "refused" in r else ("ERROR" if "error" in r else "skipped")
            lines.append(head + " - | - | - | - | - | - | - | - | - | - | - | - | " + f"{tag}: {why[:160]} |")
            continue
        a = r.get("attention") or {}
        us = " / ".join(fmt((a.get(c) or {}).get("s_per_call"), "{:.0f}", 1e6) for c in ("replayed", "all_miss", "all_hit")
                        if c in a) or "-"
        fl = (a.get("floors") or {}).get("replayed") or {}
        kv = r["state_bytes"]["gpu_kv_total"]
        kv_full = f["state_bytes"]["gpu_kv_total"] if f else None
        moved = r.get("bytes_rows_per_step") or r.get("bytes_h2d_per_step")
        gen = r.get("generate_step_s")
        lines.append(head + f" {fmt(r['step_s'], '{:.2f}', 1e3)} | {fmt(r['step_s'] / f['step_s'] if f else None)} | "
                     f"{fmt(r.get('step_s_mean'), '{:.2f}', 1e3)} | {fmt(gen, '{:.2f}', 1e3)} | "
                     f"{fmt(gen / f['generate_step_s'] if gen and f and f.get('generate_step_s') else None)} | "
                     f"{us} | {fmt(fl.get('floor_s'), '{:.0f}', 1e6)} | "
                     f"{fmt(fl.get('measured_over_floor'))} | "
                     f"{fmt(r.get('hit_rate_timed_steps'))} | {fmt(kv, '{:.2f}', 1e-9)} | "
                     f"{fmt(kv / kv_full if kv_full else None)} | {fmt(moved, '{:.1f}', 1e-6)} | "
                     f"{note_of(r)} |")
    return "\n".join(lines)


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_selection.json or ./bench_selection.json)")
    ap.add_argument("--shape", default="llama-3-8b", help="a named shape (plan/profiler.py) or an HF config.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", default="32k,128k", help="comma list of context lengths (32k = 32768)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"comma list of: {', '.join(VARIANTS)}")
    ap.add_argument("--only", default=None, help="comma list of VARIANT:CTX:BATCH runs (e.g. clo_exact:128k:1); "
                    "overrides --policies/--contexts/--batches")
    ap.add_argument("--hit-rate-tokenselect", default="0.8", help="replayed reuse probability: a number or one per "
                    "layer (comma list); default 0.8, a placeholder until measured on the real model")
    ap.add_argument("--hit-rate-clo", default="0.86", help="the same for clo; default 0.86 (T+G, exact, RULER, SmolLM2)")
    ap.add_argument("--option", action="append", default=[], metavar="VARIANT:KEY=VALUE",
                    help="an extra policy option for one variant (repeatable), e.g. clo_hata:host_dtype=int4")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps before the timed ones (compilation)")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps")
    ap.add_argument("--generate-windows", type=int, default=4, metavar="N",
                    help="after the timed steps, N windows of engine.SYNC_EVERY steps timed as engine.generate runs "
                         "them (one device read a window: the host dispatches a step while the device runs the one "
                         "before); the median window's step is 'as generate' (0: none)")
    ap.add_argument("--attn-reps", type=int, default=16, help="attention calls per microbenchmark scan")
    ap.add_argument("--timing-reps", type=int, default=3, help="timed scans per microbenchmark case")
    ap.add_argument("--attn-method", default="auto", choices=("auto", "scan", "calls"),
                    help="attention microbenchmark: one lax.scan program, or back-to-back jitted calls; auto: calls "
                    "where the layer's sources are in host memory (kv=split, clo), scan elsewhere")
    ap.add_argument("--no-extremes", action="store_true", help="skip the all-miss / all-hit attention microbenchmarks")
    ap.add_argument("--step-extremes", action="store_true", help="also time decode steps of the selective "
                    "policies with every head missing (rate 0) and hitting (rate 1), after the other runs")
    ap.add_argument("--quick", action="store_true", help="batch 1 only, 1 warm-up + 3 timed steps, 8 attention reps")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds")
    ap.add_argument("--host-limit-gb", type=float, default=None, help="host memory the planner may use (default: the machine's)")
    ap.add_argument("--trace", default=None, help="a folder: one extra decode step of each run is captured with "
                    "jax.profiler into FOLDER/VARIANT_CTX_BATCH (summarise with experiments/trace_summary.py)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="run every policy on an N-device mesh (tensor parallelism over heads)")
    ap.add_argument("--compile-cache", default=None, help="a folder for JAX's persistent compilation cache")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny 2-layer llama, 256-token context and one run "
                    "the planner refuses (1M tokens under a 0.5 GB limit), float32: the whole script on a CPU")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.time()
    if args.cpu_smoke:
        args.contexts, args.batches, args.dtype = "256,1m", "1", "float32"
        args.warmup, args.steps, args.attn_reps, args.timing_reps, args.generate_windows = 1, 1, 2, 1, 1
        args.host_limit_gb = 0.5 if args.host_limit_gb is None else args.host_limit_gb
    if args.quick:
        args.batches, args.warmup, args.steps, args.attn_reps = "1", 1, 3, 8
    args.contexts = [parse_tokens(c) for c in args.contexts.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.hit_rate_tokenselect = parse_rate(args.hit_rate_tokenselect)
    args.hit_rate_clo = parse_rate(args.hit_rate_clo)
    args.extra = parse_options(args.option)
    out_path = args.out or os.path.join(os.environ.get("OUT") or ".", "bench_selection.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)

    import jax
    import jax.numpy as jnp

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from kvoffload.config import ModelConfig
    from kvoffload.models import TINY_CONFIGS, Model, family
    from kvoffload.device import memory as M
    from kvoffload.offload.bench import make_model

    dev = M.default_device()
    if args.cpu_smoke:  # the tests' tiny llama (2 layers, 4/2 heads, d 16), its weights made in one program
        cfg = ModelConfig.from_hf_dict({**TINY_CONFIGS["llama"], "max_position_embeddings": 4096})
        model = Model(cfg, jax.jit(lambda key: family(cfg).init_params(cfg, key, jnp.dtype(args.dtype), scale=0.2))(
            jax.random.key(0)))
        shape = "tiny llama (2 layers, 4/2 heads, d 16)"
    else:
        model = make_model(args.shape, jnp.dtype(args.dtype), offload_weights=False)
        shape = args.shape
    if args.tensor_parallel > 1:  # the weights split over the mesh once (each device holds its shard only)
        from kvoffload.device import sharding as S

        S.check_divisible(model.config, args.tensor_parallel)
        model = Model(model.config, S.shard_params(model.params, S.make_mesh(args.tensor_parallel)))
        shape += f", tensor_parallel={args.tensor_parallel}"
    runs = run_list(args, model.config.num_layers)
    probes = bandwidth_probes(args.cpu_smoke)
    doc = {"meta": {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "shape": shape,
                    "dtype": args.dtype, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "argv": sys.argv[1:] if argv is None else list(argv), "probes": probes,
                    "hit_rate_tokenselect": args.hit_rate_tokenselect, "hit_rate_clo": args.hit_rate_clo,
                    "warmup": args.warmup, "steps": args.steps, "method": __doc__.split("\n\n", 3)[3].strip(),
                    "int_refill_kernel": ops.INT_REFILL_KERNEL},
           "runs": []}

    def write():
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, out_path)

    def stop(signum, frame):  # a timeout's SIGTERM: keep what was measured, print the table
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    print(f"[bench] {len(runs)} runs, probes {json.dumps(probes)}", file=sys.stderr, flush=True)
    try:
        for variant, ctx, batch, rate in runs:
            head = {"variant": variant, "context": ctx, "batch": batch}
            if time.time() - t_start > args.budget_s:
                doc["runs"].append({**head, "skipped": f"budget of {args.budget_s:.0f} s spent"})
                write()
                continue
            t = time.time()
            print(f"[bench] {variant} ctx {ctx} b {batch}" + (f" rate {rate}" if rate is not None else ""),
                  file=sys.stderr, flush=True)
            try:
                r = run_one(args, model, variant, ctx, batch, rate, probes)
            except Exception as e:  # noqa: BLE001  (keep the other runs)
                r = {**head, "error": f"{type(e).__name__}: {str(e)[:600]}", "traceback": traceback.format_exc()[-2000:]}
                gc.collect()
            r["wall_s"] = time.time() - t
            doc["runs"].append(r)
            write()
            msg = ("REFUSED" if "refused" in r else "ERROR " + r["error"][:200] if "error" in r else
                   f"{r['step_s'] * 1e3:.2f} ms/step")
            print(f"[bench]   {msg} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    except KeyboardInterrupt as e:
        doc["meta"]["interrupted"] = str(e)
    finally:
        doc["meta"]["wall_s"] = time.time() - t_start
        write()
        print(table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
