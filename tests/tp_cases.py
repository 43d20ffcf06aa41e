"""Tensor-parallel cases run in a fresh process with several (virtual CPU) devices: each case generates
with a policy on an N-way mesh and with `full` on one device (an int4 case: the same policy on one device), and prints one JSON line per case (tokens
equal, largest logit difference, where the pool and tails live, compilations after the warm-up).

Not a test module: tests/test_tensor_parallel.py launches it with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (set before jax starts), or under jax.distributed
(--process-id/--num-processes/--coordinator: one CPU device per process)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

PROMPTS = [list(range(1, 30)), list(range(40, 51)), list(range(60, 100))]
NEW = 10
BASE = dict(block_tokens=4, extent_mb=3 * 4 * 2 * 16 * 4 / 2**20)  # 3-block extents of the tiny models
# GQA llama for the 4-way mesh: 8 query heads, 4 KV heads (the default tiny llama has 2 KV heads)
MODELS = {"opt": dict(), "llama": dict(num_attention_heads=8, num_key_value_heads=4)}
APPROXIMATE = ("clo", "tokenselect")  # policies whose reference is their own single-device run


def model_of(arch):
    from kvoffload.models import tiny_random_model

    return tiny_random_model(arch, seed=1, **MODELS[arch])


def run_case(case, refs):
    import numpy as np

    from kvoffload.compile_count import count_compilations
    from kvoffload.engine import generate
    from kvoffload.errors import KVOffloadError
    from kvoffload.policies import make_policy

    arch, policy, n, opts = case["arch"], case["policy"], case["tp"], case.get("opts", {})
    model = model_of(arch)
    # the reference: `full` on one device; a lossy store (int4) or an approximate policy (a top-k selection:
    # clo, tokenselect) is compared with itself on one device
    lossy = opts.get("host_dtype", "native") != "native" or policy in APPROXIMATE
    key = (arch, policy, json.dumps(opts, sort_keys=True)) if lossy else arch
    out = dict(case=case)
    from kvoffload.device import sharding as S

    seen, real_gather = {}, S.gather_whole

    def gather_whole(tree, mesh):  # streamed W_K / W_V gathered whole: counted per step
        seen["gathers"] = seen.get("gathers", 0) + 1
        seen["order"] = seen.get("order", "") + "g"
        return real_gather(tree, mesh)

    S.gather_whole = gather_whole
    from kvoffload.runtime import attention as PA, layer as PL

    real_step = PL.layer_step

    def layer_step(*a, **k):  # case "hlo": one layer program's collectives, from a step after the first
        if case.get("hlo") and seen.get("steps", 0) >= 2 and "collectives" not in seen:
            import re

            # the lowered program (StableHLO, before XLA's passes: what the layer program asks for; compiling
            # it again would cost the default suite seconds)
            text = real_step.lower(*a, **k).as_text()
            seen["collectives"] = {op.replace("_", "-"): len(re.findall(rf"stablehlo\.{op}\b", text))
                                   for op in ("all_to_all", "all_gather", "all_reduce")}
            # paged attention calls (the reference on the CPU: a private function per call site)
        seen["order"] = seen.get("order", "") + "L"
        return real_step(*a, **k)

    PL.layer_step = layer_step
    from kvoffload import ops

    real_act, real_paged, real_rec = PA.attend_act_by_token, ops.paged_decode_attention, ops.recompute_kv

    def count_in_act(name, fn):
        def wrapped(*a, **k):
            if seen.get("act") is not None:
                seen["act"][-1][name] += 1
            return fn(*a, **k)
        return wrapped

    def attend_act_by_token(*a, **k):  # per traced call: its paged attentions and recomputes, and its extents
        seen["act"] = seen.get("act_calls", [])
        seen["act"].append(dict(extents=len(a[4]), paged=0, recompute=0))
        try:
            return real_act(*a, **k)
        finally:
            seen["act_calls"], seen["act"] = seen["act"], None

    PA.attend_act_by_token = attend_act_by_token
    ops.paged_decode_attention = count_in_act("paged", real_paged)
    ops.recompute_kv = count_in_act("recompute", real_rec)
    try:
        pol = make_policy(policy, **{**BASE, **opts, "tensor_parallel": n})

        class Spy:  # records where the state lives after the first step and counts later compilations
            name = policy

            def prefill(self, *a):
                return pol.prefill(*a)

            def decode_step(self, model, state, tokens):
                seen["gathers"], seen["order"] = 0, ""
                logits, state = pol.decode_step(model, state, tokens)
                # the last step's dispatch order: g a W_K / W_V gather, L a layer program
                seen["w_kv_gathers_last_step"], seen["dispatch_order"] = seen["gathers"], seen["order"]
                seen["steps"] = seen.get("steps", 0) + 1
                if seen["steps"] == 2:
                    gr = state.groups[0]
                    specs = lambda t: sorted({str(getattr(a.sharding, "spec", None)) + "@" + str(a.sharding.memory_kind)  # noqa: E731
                                              for a in jax.tree.leaves(t)})
                    seen.update(pool_k=specs(gr.pool_k), pool_x=specs(gr.pool_x), tail_k=specs(gr.tail_k),
                                tail_x=specs(gr.tail_x), logits=specs(logits))
                    seen.update(pool_v=specs(gr.pool_v), slots=specs(gr.slots))
                    seen["compiles_at_2"] = counter.count
                # what the policy says of the last step (kvpr on a mesh: the all-gather of X it predicts)
                seen["describe"] = {k: v for k, v in pol.describe(state).items() if k in ("tensor_parallel", "last_step")}
                if policy in APPROXIMATE:  # selection-cache hits so far (per request and KV head)
                    d = pol.describe(state)
                    seen["hit_rate"] = (d.get("clo") or d["selection"])["hit_rate"]
                return logits, state

        import jax

        from kvoffload.policies.base import Policy

        spy = type("SpyPolicy", (Policy,), dict(Spy.__dict__))()
        with count_compilations() as counter:
            got, logits = generate(model, PROMPTS, NEW, policy=spy, return_logits=True)
        out.update(later_compiles=counter.names[seen["compiles_at_2"]:], tokens=got,
                   **{k: v for k, v in seen.items() if k not in ("steps", "compiles_at_2", "gathers", "order", "act")})
    except KVOffloadError as e:
        return dict(out, error=type(e).__name__, message=str(e))
    finally:
        S.gather_whole, PL.layer_step = real_gather, real_step
        PA.attend_act_by_token, ops.paged_decode_attention, ops.recompute_kv = real_act, real_paged, real_rec
    if key not in refs:  # made after the mesh run (the spies removed): a case the mesh refuses needs none
        refs[key] = generate(model, PROMPTS, NEW, policy=policy if lossy else "full",
                             policy_options={**BASE, **opts} if lossy else BASE, return_logits=True)
    want, want_logits = refs[key]
    out.update(tokens_equal=got == want, max_abs=float(np.abs(logits - want_logits).max()))
    return out


def kernel_case(case):
    """The Pallas kernels clo and tokenselect call inside their layer programs (row gather from a K/V or an
    activation extent in pinned host memory, sparse attention, exact scores with per-head lengths, the top-k), run in
    interpret mode under an N-way mesh with head-split inputs (each device its heads: `sharding.per_shard`),
    against their references on one device: the largest difference per kernel and the outputs' shardings."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from kvoffload import ops
    from kvoffload.device import sharding as S

    mesh = S.make_mesh(case["tp"])
    r = np.random.default_rng(0)
    E, n_kv, blk, d, B, H, K, T = 3, 4, 8, 16, 2, 8, 5, 12
    arr = lambda shape, lo=None, hi=None: jnp.asarray(r.normal(size=shape), jnp.float32) if lo is None else \
        jnp.asarray(r.integers(lo, hi, size=shape), jnp.int32)  # noqa: E731
    heads = S.kv_sharding(mesh)
    split = lambda *a: [jax.device_put(x, heads) for x in a]  # noqa: E731
    kernel = dict(impl="kernel", interpret=True)
    x, block, off = arr((E, n_kv, blk, d)), arr((B, n_kv, K), -1, E), arr((B, n_kv, K), 0, blk)
    acts, tok = arr((E, blk, 64)), arr((B, K), 0, E * blk)
    q, k, v, idx, nv, lens = arr((B, H, d)), arr((B, n_kv, T, d)), arr((B, n_kv, T, d)), arr((B, n_kv, K), 0, T), \
        arr((B, n_kv), 0, K + 1), arr((B, n_kv), 0, T + 1)
    finite = lambda a, b: float(np.abs(np.where(np.isfinite(b), a - b, 0)).max())  # noqa: E731
    out, shardings = {}, {}
    with S.context(mesh):
        got = jax.jit(lambda a, b, o: ops.gather_block_rows(a, b, o, **kernel))(
            jax.device_put(x, S.kv_sharding(mesh, "pinned_host")), *split(block, off))
        out["gather_kv"] = finite(got, ops.gather_block_rows(x, block, off, impl="reference"))
        shardings["gather_kv"] = str(got.sharding.spec)
        got = jax.jit(lambda a, b, o: ops.gather_block_rows(a, b, o, **kernel))(
            jax.device_put(acts, NamedSharding(mesh, S.X_SPEC, memory_kind="pinned_host")), tok // blk, tok % blk)
        out["gather_x"] = finite(got, ops.gather_block_rows(acts, tok // blk, tok % blk, impl="reference"))
        shardings["gather_x"] = str(got.sharding.spec)
        o, lse = jax.jit(lambda *a: ops.sparse_attention(*a[:4], num_valid=a[4], **kernel))(*split(q, k, v, idx, nv))
        wo, wl = ops.sparse_attention(q, k, v, idx, num_valid=nv, impl="reference")
        out["sparse_attention"] = max(finite(o, wo), finite(lse, wl))
        shardings["sparse_attention"] = str(o.sharding.spec)
        s = jax.jit(lambda *a: ops.topk_scores_exact(*a, group_reduce="max", **kernel))(*split(q, k, lens))
        want = ops.topk_scores_exact(q, k, lens, group_reduce="max", impl="reference")
        out["scores"] = finite(s, want) if (np.isfinite(s) == np.isfinite(want)).all() else float("inf")
        shardings["scores"] = str(s.sharding.spec)
        sc, cnt = arr((B, n_kv, 40)), arr((B, n_kv), 0, 9)  # the top-k kernels ("auto" on the GPU from 128K)
        gi, gn = jax.jit(lambda a, c: ops.select_topk(a, 8, counts=c, num_sink=2, method="kernel"))(*split(sc, cnt))
        wi, wn = ops.select_topk(sc, 8, counts=cnt, num_sink=2, method="sort")
        out["select"] = float(max(np.abs(np.asarray(gi) - np.asarray(wi)).max(), np.abs(np.asarray(gn) - np.asarray(wn)).max()))
        shardings["select"] = str(gi.sharding.spec)
        # Quest's page bounds of pool blocks against their owners' queries (int8 pages with a scale per page)
        from kvoffload.policies.clo import quest_int8

        lo = arr((E, n_kv, 2, d))
        pages = quest_int8(lo, lo + jnp.abs(arr((E, n_kv, 2, d))))
        owner = arr((E,), -1, B)
        got = jax.jit(lambda q_, lo_, hi_, sc_: ops.quest_block_bounds(q_, owner, lo_, hi_, sc_, **kernel))(
            *split(q, *pages))
        want = ops.quest_block_bounds(q, owner, *pages, impl="reference")
        out["quest_bounds"] = finite(got, want) / float(np.abs(want).max())  # relative: f32 sums in another order
        shardings["quest_bounds"] = str(got.sharding.spec)
        # the same with the reusing heads inactive (-inf, their pages unread)
        act = jnp.asarray(r.random((B, n_kv)) < 0.5).at[0, 0].set(True)
        got = jax.jit(lambda q_, lo_, hi_, sc_, a_: ops.quest_block_bounds(q_, owner, lo_, hi_, sc_, active=a_,
                                                                           **kernel))(*split(q, *pages, act))
        want = ops.quest_block_bounds(q, owner, *pages, active=act, impl="reference")
        same_inf = bool((np.isneginf(np.asarray(got)) == np.isneginf(np.asarray(want))).all())
        out["quest_bounds_active"] = finite(got, want) / float(np.abs(np.where(np.isfinite(want), want, 0)).max()) \
            if same_inf else float("inf")
        shardings["quest_bounds_active"] = str(got.sharding.spec)
        # a selection's row buffers (clo): each head's first num_valid rows of the middle layer of three stacked
        rk, rv = arr((B, n_kv, 3 * K, d)), arr((B, n_kv, 3 * K, d))
        o, lse = jax.jit(lambda *a: ops.rows_attention(*a, K, row_offset=jnp.int32(K), **kernel))(*split(q, rk, rv, nv))
        wo, wl = ops.rows_attention(q, rk, rv, nv, K, row_offset=jnp.int32(K), impl="reference")
        out["rows_attention"] = max(finite(o, wo), finite(lse, wl))
        shardings["rows_attention"] = str(o.sharding.spec)
    return dict(case=case, max_abs=out, shardings=shardings)


def transfer_case(case):
    """memory.transfer of arrays spanning this run's processes (host -> device -> host, split and replicated):
    the values, the target shardings, and that every copy it issued was a single-device one (no array of
    the mesh handed to JAX's cross-host transfer path)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kvoffload.device import memory as M
    from kvoffload.device import sharding as S

    mesh = S.make_mesh(jax.device_count())
    n = mesh.size
    full = {"split": np.arange(n * 6 * 4, dtype=np.float32).reshape(n * 6, 4) * 0.5 + 1,
            "kv": np.random.default_rng(3).standard_normal((2, 2 * n, 8, 4)).astype(np.float32),
            "rep": np.linspace(-1, 1, 12, dtype=np.float32)}
    specs = {"split": P(S.MODEL), "kv": P(None, S.MODEL), "rep": P()}
    host = {k: jax.make_array_from_callback(a.shape, NamedSharding(mesh, specs[k], memory_kind="pinned_host"),
                                            lambda idx, a=a: a[idx]) for k, a in full.items()}
    targets, real = [], jax.device_put

    def spy(x, device=None, *a, **k):
        targets.extend(jax.tree.leaves(device, is_leaf=lambda d: isinstance(d, jax.sharding.Sharding)))
        return real(x, device, *a, **k)

    jax.device_put = spy
    try:
        dev = M.transfer(host, jax.tree.map(lambda a: a.sharding.with_memory_kind("device"), host))
        back = M.transfer(dev, jax.tree.map(lambda a: a.sharding, host))
    finally:
        jax.device_put = real
    out = {"single_device_copies": all(isinstance(t, jax.sharding.SingleDeviceSharding) for t in targets),
           "copies": len(targets), "fully_addressable": all(a.is_fully_addressable for a in host.values())}
    for name, tree, kind in (("dev", dev, "device"), ("back", back, "pinned_host")):
        for k, a in tree.items():
            ok = a.sharding.memory_kind == kind and a.sharding.spec == specs[k] and a.shape == full[k].shape
            ok = ok and all(np.array_equal(np.asarray(s.data), full[k][s.index]) for s in a.addressable_shards)
            out[f"{name}_{k}"] = bool(ok)
    return dict(case=case, transfer=out)


def extents_case(case):
    """The pool's default extent size on meshes of 1, 2 and 4 devices (64 MiB of K per device), an explicit
    extent_mb kept as given, and the layout a 4-way default plans (Llama-3-8B shapes, 4 x 32K prompts: 256 MiB of K a layer)."""
    import types

    import jax.numpy as jnp
    import numpy as np

    from kvoffload.plan.memory import plan_pool
    from kvoffload.plan.profiler import model_shape
    from kvoffload.policies import make_policy

    out = {}
    for n in (1, 2, 4):
        out[f"default_{n}"] = make_policy(case["policy"], tensor_parallel=n).pipeline.extent_mb
        out[f"given_{n}"] = make_policy(case["policy"], tensor_parallel=n, extent_mb=8).pipeline.extent_mb
    cfg, lens = model_shape("llama-3-8b"), np.full(4, 32768)
    pipe = make_policy(case["policy"], tensor_parallel=4).pipeline
    (lay,) = pipe.hooks.pool_layouts(pipe, types.SimpleNamespace(config=cfg), jnp.bfloat16, [(0, 4)], lens, 32768 + 64)
    out["extent_blocks_4"] = lay.extent_blocks
    out["plan_blocks"] = {mb: plan_pool(cfg, jnp.bfloat16, [lens], 32768 + 64, extent_mb=mb).layouts[0].extent_blocks
                          for mb in (64, 256)}
    return dict(case=case, extents=out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", help="JSON list of {arch, policy, tp, opts}")
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--coordinator")
    args = ap.parse_args()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    refs = {}
    for case in json.loads(args.cases):
        res = (kernel_case(case) if case.get("kernels") else transfer_case(case) if case.get("transfer")
               else extents_case(case) if case.get("extents") else run_case(case, refs))
        # device values in a step record (clo's speculative guess rates) as numbers
        print("CASE " + json.dumps(res, default=lambda a: __import__("numpy").asarray(a).tolist()), flush=True)


if __name__ == "__main__":
    main()
