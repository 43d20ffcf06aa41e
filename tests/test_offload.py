"""The block pool and the layer pipeline: every pool policy against `full` (CPU, tiny models, fp32),
the allocator's invariants, bytes moved for ragged batches, the memory planner's refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ref_cache import reference_for

from kvoffload.engine import generate, pad_prompts
from kvoffload.models import tiny_random_model
from kvoffload.device import memory as M
from kvoffload.runtime.pool import (
    BlockAllocator,
    PoolExhausted,
    PoolLayout,
    allocate_prompts,
    allocate_prompts_aligned,
)
from kvoffload.plan import MemoryPlanError, check_memory, plan_pool, pool_memory
from kvoffload.plan.profiler import model_shape
from kvoffload.policies import make_policy

# ragged: prompt lengths 19, 40 and 3 (13x apart); 10 new tokens with 4-token blocks: two flushes of
# the GPU tail into the pool mid-way. Tiny extents (3 blocks of the tiny models' K) so a step touches
# several extents, a flush crosses an extent boundary and KVPR has interior split points.
PROMPTS = [list(range(1, 20)), list(range(5, 45)), [7, 8, 9]]
NEW = 10
BLOCK = 4
BASE = dict(block_tokens=BLOCK, extent_mb=3 * BLOCK * 2 * 16 * 4 / 2**20)


ARCHS = ["opt", "llama"]
_REFS = {}


@pytest.fixture
def ref(request):
    """(family, model, tokens, logits) of `full` on the family the test is parametrized with, made once."""
    return reference_for(_REFS, request.param, lambda model: generate(model, PROMPTS, NEW, policy="full",
                                                                      policy_options=BASE, return_logits=True))


# column cases cut the batch into 3 GPU batches of one sequence each (one set of shapes to compile).
# The third entry: the one family a case runs on by default (None: both; "slow": neither). Its run on the
# other family is behind the slow marker: the family-specific parts (recompute with RoPE / with learned
# positions and biases, the plain pipeline) run on both families in offload-0 and kvpr-4 (and kvpr-2 on OPT,
# kvpr-3 on LLaMA); the
# column schedule is the same code for both (OPT: kvpr-1, offload-6)
CASES = [
    ("offload", dict(schedule="row"), None),
    ("kvpr", dict(split_point=0, schedule="column", gpu_batches=3, offload_weights=True, sync_depth=0), "opt"),
    # mid prompt (LLaMA slow: its recompute with RoPE runs in kvpr-3, an interior split with streamed weights on OPT)
    ("kvpr", dict(split_point=16, schedule="row", offload_weights=True), "opt"),
    ("kvpr", dict(split_point=10**6), "llama"),  # every pool block, generated ones too (RoPE at generated positions)
    ("kvpr", dict(), None),  # the scheduler's choice
    # (split store: test_int4_pool, test_hybrid)
    ("kvpr", dict(kvpr_store="split", split_point=16, schedule="column", gpu_batches=3, offload_weights=True), "slow"),
    # (OPT: the programs of test_resident_layers_stay_on_the_gpu_and_move_no_weights). Slow: offload-0 stays in
    # the default run; offload's column schedule is slow only
    ("offload", dict(schedule="column", gpu_batches=3, offload_weights=True), "slow"),
]
MATCH_PARAMS = [pytest.param(arch, policy, opts, id=f"{arch}-{policy}-{i}",
                             marks=[pytest.mark.slow] if only not in (None, arch) else [])
                for arch in ARCHS for i, (policy, opts, only) in enumerate(CASES)]


@pytest.mark.parametrize("ref,policy,opts", MATCH_PARAMS, indirect=["ref"])
def test_matches_full(ref, policy, opts):
    arch, model, want, want_logits = ref
    got, logits = generate(model, PROMPTS, NEW, policy=policy, policy_options={**BASE, **opts}, return_logits=True)
    assert got == want, (arch, policy, opts)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    if policy == "offload" and opts.get("gpu_batches", 1) == 1:
        # the same programs over the same blocks in the same order: identical logits, not just close
        assert np.array_equal(logits, want_logits)


@pytest.mark.parametrize("ref", ARCHS, indirect=True)
@pytest.mark.parametrize("policy,opts", [("full", {}), pytest.param("kvpr", dict(split_point=16), marks=pytest.mark.slow)])
def test_prefill_in_row_chunks_equals_one_program(ref, policy, opts):
    """A prefill workspace of one row: each layer's prefill runs one prompt row at a time and its outputs are
    written into the group's buffers in place (never all chunks beside their concatenation): the same logits,
    bit for bit on the CPU, as one program over the whole batch (on the GPU cuBLAS picks its fp32 algorithm
    by the row count: rounding only); the planner counts one chunk's outputs on top."""
    arch, model, want, want_logits = ref
    tiny = dict(BASE, prefill_workspace_gb=1e-9, **opts)  # chunk = 1 row
    got, logits = generate(model, PROMPTS, NEW, policy=policy, policy_options=tiny, return_logits=True)
    assert got == want
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
    if policy == "full" and jax.default_backend() == "cpu":
        np.testing.assert_array_equal(logits, want_logits)
    cfg = model.config
    t_pad, b = 48, len(PROMPTS)
    from kvoffload.plan.memory import prefill_workspace_per_row

    layouts = plan_pool(cfg, jnp.float32, [np.asarray([19, 40, 3])], 60, block_tokens=BLOCK).layouts
    whole, chunked = (pool_memory(cfg, jnp.float32, layouts, b, t_pad, host_pool=False, offload_weights=False,
                                  prefill_workspace_gb=gb).gpu["prefill workspace"] for gb in (10.0, 1e-9))
    outputs = t_pad * (cfg.hidden_size + cfg.kv_bytes_per_token) * 4  # one row's h and K/V, before its write
    assert whole - chunked == (b - 1) * prefill_workspace_per_row(cfg, jnp.float32, t_pad) - outputs


@pytest.mark.parametrize("ref", ARCHS, indirect=True)
def test_full_matches_the_dense_reference(ref):
    """The pool-based `full` against the dense one-jit decode of models/transformer.py (itself tested
    against HF transformers in test_models.py)."""
    from kvoffload.models.transformer import (
        dense_cache_from_prefill,
        dense_decode,
        prefill,
    )

    arch, model, want, want_logits = ref
    cfg, params = model.config, model.params
    tokens, lengths = pad_prompts(PROMPTS)
    logits, ks, vs = prefill(cfg, params, tokens, lengths)
    cache, n = dense_cache_from_prefill(ks, vs, lengths, capacity=128), 0
    for step in range(NEW):
        np.testing.assert_allclose(np.asarray(logits), want_logits[step], atol=1e-4, rtol=0)
        if step == NEW - 1:
            break
        logits, cache, n = dense_decode(cfg, params, cache, jnp.asarray([w[step] for w in want], jnp.int32), n)


def _run(model, policy, steps=6, prompts=PROMPTS, **opts):
    pol = make_policy(policy, **{**BASE, **opts})
    tokens, lengths = pad_prompts(prompts)
    logits, state = pol.prefill(model, tokens, lengths, 128)
    for _ in range(steps):
        logits, state = pol.decode_step(model, state, jnp.argmax(logits, -1).astype(jnp.int32))
    return pol, state


def test_a_long_decode_keeps_the_last_step_records_unless_traced(monkeypatch, tmp_path):
    """Without a trace the state keeps the last RECORDS_KEPT step records (a long generation's grew without
    bound, copied whole every step); with one it keeps them all, as the trace file does."""
    from kvoffload.runtime import pipeline as P

    monkeypatch.setattr(P, "RECORDS_KEPT", 2)
    model = tiny_random_model("llama", seed=3)
    _, state = _run(model, "offload", steps=5)
    assert [r["step"] for r in state.records] == [3, 4] and state.step == 5
    assert state.records[0]["time_s"] is not None  # a kept step's time is still filled in by the next step
    _, traced = _run(model, "offload", steps=5, trace=str(tmp_path / "t.json"))
    assert [r["step"] for r in traced.records] == [0, 1, 2, 3, 4]


def test_scheduler_recomputes_for_mha_and_traces(tmp_path):
    """MHA OPT (an activation is half its K/V): the scheduler recomputes some extents; the trace records
    the split and is drawable."""
    model = tiny_random_model("opt", seed=2)
    path = tmp_path / "trace.json"
    pol, state = _run(model, "kvpr", trace=str(path))
    rec = state.records[-1]
    assert 0 < rec["recompute_extents"] <= rec["used_extents"]
    assert rec["recompute_tokens"] > 0 and rec["bytes_x"] > 0 and "recompute" in rec["split_reason"]
    tr = json.loads(path.read_text())
    assert len(tr["steps"]) == 6 and tr["steps"][0]["time_s"] is not None
    for k in ("split_point", "bytes_h2d", "bytes_x", "bytes_kv", "recompute_tokens", "predicted_s", "context"):
        assert k in tr["steps"][-1]
    d = pol.describe(state)
    assert d["policy"] == "kvpr" and "memory_plan" in d and d["layout"]["act_extents"][1] > 0
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "plot_trace", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "plot_trace.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "trace.png"
    assert mod.main([str(path), "--out", str(out)]) == 0
    assert out.exists() and out.stat().st_size > 1000


def test_gqa_scheduler_says_no_recompute():
    # llama tiny: h = 64, n_kv * d = 2 * 16 -> an activation is as large as its K/V
    model = tiny_random_model("llama", seed=3)
    pol, state = _run(model, "kvpr", steps=2)
    assert state.records[-1]["recompute_extents"] == 0
    assert "GQA" in state.records[-1]["split_reason"]
    assert state.groups[0].layout.act_extents == (0, 0)  # no activations stored at all
    assert all(x is None for x in state.groups[0].pool_x[0])


def test_pool_is_in_host_memory_and_full_on_device():
    model = tiny_random_model("opt", seed=4)
    _, state = _run(model, "kvpr", steps=0)
    kind, _ = M.host_memory_kind()
    assert kind == "pinned_host"
    gr = state.groups[0]
    for a in (gr.pool_k[0][0], gr.pool_v[0][0], gr.pool_x[0][0]):
        assert M.memory_kind_of(a) == "pinned_host"
    assert M.memory_kind_of(gr.tail_k[0]) == "device"
    _, state = _run(model, "full", steps=0)
    assert M.memory_kind_of(state.groups[0].pool_k[0][0]) == "device"


def test_ragged_batch_stores_and_moves_no_padding():
    """PROMPTS (19, 40 and 3 tokens: 13x apart, tails of 3, 0 and 3 tokens; the shapes of
    test_matches_full's offload runs, whose programs this reuses): the pool holds exactly the prompts' full
    blocks (partial blocks stay in the GPU tail), and a step moves at most one partly filled extent beyond them."""
    model = tiny_random_model("opt", seed=5)
    prompts = PROMPTS
    pol, state = _run(model, "offload", steps=1, prompts=prompts)
    gr = state.groups[0]
    full_blocks = sum(len(p) // BLOCK for p in prompts)
    assert sum(len(t) for t in gr.alloc.tables) == full_blocks
    assert gr.tail_base == tuple(len(p) % BLOCK for p in prompts)
    cfg = model.config
    block_bytes = BLOCK * cfg.kv_bytes_per_token * 4
    moved_per_layer = state.records[-1]["bytes_kv"] / cfg.num_layers
    assert full_blocks * block_bytes <= moved_per_layer < (full_blocks + gr.layout.extent_blocks) * block_bytes
    real = sum(len(p) for p in prompts) * cfg.kv_bytes_per_token * 4
    assert moved_per_layer <= 1.05 * real + gr.layout.extent_blocks * block_bytes


def test_release_frees_blocks_and_keeps_others_exact():
    model = tiny_random_model("llama", seed=6)
    pol = make_policy("offload", **BASE)
    tokens, lengths = pad_prompts(PROMPTS)
    logits, state = pol.prefill(model, tokens, lengths, 128)
    free0 = state.groups[0].alloc.num_free
    released = pol.release(state, [1])
    assert released.groups[0].alloc.num_free == free0 + len(PROMPTS[1]) // BLOCK
    released.groups[0].alloc.check()
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    b, _ = pol.decode_step(model, released, nxt)  # the step donates the tails: a fresh prefill for the other run
    _, state = pol.prefill(model, tokens, lengths, 128)
    a, _ = pol.decode_step(model, state, nxt)
    np.testing.assert_array_equal(np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]])


# ------------------------------------------------------------------------------------------------
# the allocator
# ------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 4)), max_size=80),
       st.integers(1, 4), st.integers(1, 6))
def test_allocator_never_leaks_or_shares(ops_, extent_blocks, n_ext):
    layout = PoolLayout(block_tokens=4, extent_blocks=extent_blocks, num_extents=n_ext)
    alloc = BlockAllocator(layout.num_blocks, 5, 4)
    for op, r in ops_:
        if op == "alloc":
            if alloc.num_free == 0:
                with pytest.raises(PoolExhausted):
                    alloc.allocate(r)
            else:
                b = alloc.allocate(r)
                assert b == min(set(range(layout.num_blocks)) - {x for t in alloc.tables for x in t} | {b})
        else:
            alloc.release(r)
        alloc.check()
    t = alloc.device_tables(layout)
    for r, blocks in enumerate(alloc.tables):  # each extent's table lists the request's blocks there, in order
        for e in range(n_ext):
            got = [e * extent_blocks + int(np.asarray(t.table[e])[r, j]) for j in range(int(np.asarray(t.count[e])[r]))]
            assert got == [b for b in blocks if b // extent_blocks == e]
    assert alloc.used_extents(layout) == (max((b for t_ in alloc.tables for b in t_), default=-1) // extent_blocks + 1)


def test_prompts_are_laid_out_position_major_and_flushes_aligned():
    alloc = BlockAllocator(16, 3, 4)
    allocate_prompts(alloc, [12, 4, 9])  # 3, 1, 2 full blocks
    assert alloc.tables == [[0, 3, 5], [1], [2, 4]]
    layout = PoolLayout(block_tokens=4, extent_blocks=4, num_extents=5, prompt_extents=2, gen_extent_blocks=3)
    alloc = BlockAllocator(layout.num_blocks, 3, 4)
    allocate_prompts_aligned(alloc, layout, [12, 4, 9])
    assert [alloc.allocate(r) for r in range(3)] == [8, 9, 10]  # the first generated extent, from its start
    alloc.check()


# ------------------------------------------------------------------------------------------------
# planner
# ------------------------------------------------------------------------------------------------


def test_planner_refuses_before_allocating(monkeypatch):
    """A pool bigger than host memory is refused with one message, before any host allocation."""
    from kvoffload.runtime import prefill as pipeline

    model = tiny_random_model("opt", seed=5)
    calls = []
    monkeypatch.setattr(pipeline.M, "to_host", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(MemoryPlanError) as e:
        generate(model, PROMPTS, NEW, policy="kvpr", policy_options={**BASE, "host_memory_limit_gb": 1e-6})
    msg = str(e.value)
    assert "needs" in msg and "available" in msg and "lower the batch" in msg
    assert not calls


def test_planner_knows_the_pinned_pool_cap(monkeypatch):
    import jax.numpy as jnp

    cfg = model_shape("opt-13b")
    plan = plan_pool(cfg, jnp.bfloat16, [np.full(32, 512)] * 4, 576)
    mem = pool_memory(cfg, jnp.bfloat16, plan.layouts, 128, 512, host_pool=True, offload_weights=True)
    assert 75e9 < mem.host_bytes < 95e9  # ~81 GB: K/V + weights (the decode benchmark's OPT-13B column workload)
    monkeypatch.delenv(M.HOST_LIMIT_ENV, raising=False)
    cap = M.host_pool_cap_bytes("gpu")
    assert cap == 64e9
    with pytest.raises(MemoryPlanError, match=M.HOST_LIMIT_ENV):
        check_memory(mem, host_available=120e9, gpu_available=80e9, host_cap=cap)
    monkeypatch.setenv(M.HOST_LIMIT_ENV, "100")
    check_memory(mem, host_available=120e9, gpu_available=80e9, host_cap=M.host_pool_cap_bytes("gpu"))
    assert M.host_pool_cap_bytes("cpu") is None


def test_planner_sizes_the_pool_from_real_blocks():
    cfg = model_shape("opt-6.7b")
    lens = np.asarray([512, 2048, 1000, 1500])
    plan = plan_pool(cfg, jnp.bfloat16, [lens], 2048 + 128, block_tokens=64, extent_mb=64)
    lay = plan.layouts[0]
    prompt_blocks = int((lens // 64).sum())
    assert plan.flushes == 2 and lay.num_blocks >= prompt_blocks + 4 * 2
    # slack: the prompt extents' spare slots (fewer than one per extent) and one partly used generated extent
    assert lay.num_blocks - (prompt_blocks + 8) < lay.prompt_extents + lay.gen_extent_blocks
    # prompt blocks split evenly over whole extents: the last prompt extent is nearly full
    assert (-prompt_blocks) % lay.extent_blocks < -(-prompt_blocks // lay.extent_blocks)


def test_planner_keeps_every_extents_codes_under_2_gib():
    """A large extent_mb is capped where an extent's largest 1-byte array (int8 K codes, int4 X codes) would pass
    2 GiB (the Triton lowering's 32-bit offsets, `check_triton_offsets`); the defaults are not changed."""
    from kvoffload.plan.memory import MAX_CODES_BYTES

    for shape, per_token_codes in (("llama-3-8b", 4096 // 2), ("opt-30b", 7168)):
        cfg = model_shape(shape)
        n = 2**21
        wide = plan_pool(cfg, jnp.bfloat16, [np.asarray([n])], n + 256, extent_mb=16384).layouts[0]
        for e in (wide.extent_blocks, wide.gen_extent_blocks):
            assert e * 64 * per_token_codes <= MAX_CODES_BYTES
        assert wide.extent_blocks * 64 * per_token_codes > MAX_CODES_BYTES // 2  # capped, not shrunk further
        assert wide.num_extents * wide.extent_blocks >= n // 64
    cfg = model_shape("llama-3-8b")  # 1024 MiB of K (the pools read in place): 8192 blocks, as before
    assert plan_pool(cfg, jnp.bfloat16, [np.asarray([2**21])], 2**21 + 256,
                     extent_mb=1024).layouts[0].extent_blocks == 8192


def test_planner_checks_the_device_side_on_cpu():
    """On a CPU backend the "GPU" side is host memory too: both must fit it together."""
    cfg = model_shape("opt-6.7b")
    plan = plan_pool(cfg, jnp.bfloat16, [np.full(8, 1024)], 1152)
    mem = pool_memory(cfg, jnp.bfloat16, plan.layouts, 8, 1024, host_pool=True, offload_weights=False)
    check_memory(mem, host_available=mem.host_bytes + mem.gpu_bytes + 1, device_is_host=True)
    with pytest.raises(MemoryPlanError, match="host memory"):
        check_memory(mem, host_available=mem.host_bytes + 1, device_is_host=True)


def test_planner_adds_the_resident_weights_back_to_free_gpu_memory(monkeypatch):
    """Free GPU memory has the model's loaded weights in use and the plan counts them too: check_pool adds the
    weights' device bytes back (else they count twice: a 1M-token Llama-3-8B run refused 66.9 GB against 62.2
    GB free of a 78.6 GB limit with 16 GB of weights loaded). Only device-memory shards count."""
    from kvoffload.plan.memory import check_pool

    dev = jax.devices()[0]
    weights = {"w": jnp.ones((256, 256), jnp.float32), "b": np.ones(7, np.float32),
               "h": jax.device_put(jnp.ones((64, 64)), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))}
    resident = M.resident_device_bytes(weights, dev)
    assert resident == 256 * 256 * 4
    cfg = model_shape("opt-6.7b")
    plan = plan_pool(cfg, jnp.bfloat16, [np.full(8, 1024)], 1152)
    mem = pool_memory(cfg, jnp.bfloat16, plan.layouts, 8, 1024, host_pool=True, offload_weights=False)
    monkeypatch.setattr(M, "available_device_bytes", lambda d=None: mem.gpu_bytes - resident // 2)
    monkeypatch.setattr(M, "host_memory_kind", lambda d=None: ("pinned_host", ""))
    monkeypatch.setattr(M, "host_pool_cap_bytes", lambda platform=None: None)
    kw = dict(host_limit_gb=1e6, gpu_limit_gb=None, host_pool=True, dev=dev)
    with pytest.raises(MemoryPlanError, match="GPU side needs"):
        check_pool(mem, **kw)
    check_pool(mem, **kw, resident=resident)


def test_options_are_validated():
    with pytest.raises(ValueError, match="schedule"):
        make_policy("kvpr", schedule="diagonal")
    with pytest.raises(ValueError, match="split point"):
        make_policy("offload", split_point=5)
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("kvpr", shedule="row")
    with pytest.raises(ValueError, match="power of two"):
        make_policy("offload", block_tokens=48)
    with pytest.raises(ValueError, match="full"):
        make_policy("full", offload_weights=True)
    p = make_policy("kvpr", schedule="column", offload_weights=True, split_point=None, gpu_batches=2,
                    profile=None, trace=None, sync_depth=None)
    assert p.describe()["schedule"] == "column"


def test_layer_split_join():
    from kvoffload.runtime.weights import join_layer, split_layer

    model = tiny_random_model("llama", seed=0)
    lp = model.params.layers[0]
    kv, rest = split_layer(lp)
    assert kv.wq is None and rest.wk is None and kv.wk is lp.wk
    back = join_layer(kv, rest)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(lp)))


# ------------------------------------------------------------------------------------------------
# a policy's own state: per-layer slots carried from step to step
# ------------------------------------------------------------------------------------------------


def _counting_attend(cfg, lp, q, acc, src, tables, slots, recompute_impl, attention_impl):
    """The default attention, plus per-layer, per-request counters in the slots: steps attended and
    pool blocks seen in the last step (what a selection policy would keep: its own state per layer)."""
    from kvoffload.runtime.attention import attend_pool

    acc, _ = attend_pool(cfg, lp, q, acc, src, tables, None, recompute_impl, attention_impl)
    blocks = sum(c for c in tables.count)
    return acc, {"steps": slots["steps"] + 1, "blocks": blocks}


def test_policy_slots_are_carried_and_updated():
    from kvoffload.runtime.hooks import LayerHooks
    from kvoffload.policies.layered import LayeredPolicy

    class CountingHooks(LayerHooks):
        attend = staticmethod(_counting_attend)

        def init_slots(self, pipe, model, layout, batch):
            zero = jnp.zeros((batch,), jnp.int32)
            return tuple({"steps": zero, "blocks": zero} for _ in range(model.config.num_layers))

    class Counting(LayeredPolicy):
        name = "counting"

        def make_hooks(self):
            return CountingHooks()

    model = tiny_random_model("llama", seed=7)
    pol = Counting(**BASE)
    tokens, lengths = pad_prompts(PROMPTS)
    logits, state = pol.prefill(model, tokens, np.asarray([len(p) for p in PROMPTS]), 128)
    want = generate(model, PROMPTS, NEW, policy="full", policy_options=BASE)
    got = [[] for _ in PROMPTS]
    for step in range(NEW - 1):
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        for r, t in enumerate(np.asarray(nxt)):
            got[r].append(int(t))
        logits, state = pol.decode_step(model, state, nxt)
        gr = state.groups[0]
        for layer in gr.slots:
            np.testing.assert_array_equal(np.asarray(layer["steps"]), step + 1)
        # blocks seen by the step just run: the pool blocks before this step's flush (if any)
    got = [g + [int(t)] for g, t in zip(got, np.asarray(jnp.argmax(logits, -1)))]
    assert got == want  # the counting attention attends exactly as the default
    seen = np.asarray(gr.slots[0]["blocks"])
    np.testing.assert_array_equal(seen, [len(t) for t in gr.alloc.tables])  # no flush on the last step


def test_resident_layers_stay_on_the_gpu_and_move_no_weights():
    """offload_weights with resident_layers=1: layer 0's weights never move (the step records one
    layer's weight bytes fewer), the planner holds it on the GPU, and the logits are the streamed run's."""
    model = tiny_random_model("opt", seed=8)
    opts = dict(offload_weights=True, schedule="column", gpu_batches=3)
    pol_all, st_all = _run(model, "offload", steps=3, **opts)
    pol_one, st_one = _run(model, "offload", steps=3, resident_layers=1, **opts)
    per_layer = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(model.params.layers[0]))
    assert st_all.records[-1]["bytes_w"] - st_one.records[-1]["bytes_w"] == per_layer
    plan_all, plan_one = pol_all.pipeline.memory_plan, pol_one.pipeline.memory_plan
    assert plan_all.host["weights"] - plan_one.host["weights"] == per_layer  # (2 layers: the GPU holds both anyway)
    assert st_one.records[-1]["predicted_transfer_s"] < st_all.records[-1]["predicted_transfer_s"]
    tokens, lengths = pad_prompts(PROMPTS)
    a = generate(model, PROMPTS, 4, policy="offload", policy_options={**BASE, **opts}, return_logits=True)[1]
    b = generate(model, PROMPTS, 4, policy="offload", policy_options={**BASE, **opts, "resident_layers": 1},
                 return_logits=True)[1]
    assert np.array_equal(a, b)
    assert M.memory_kind_of(pol_one.pipeline.layers(model)[0].wq) == "device"
    assert M.memory_kind_of(pol_one.pipeline.layers(model)[1].wq) != "device"


def test_planner_moves_resident_layers_to_the_gpu_side():
    cfg = model_shape("opt-6.7b")
    plan = plan_pool(cfg, jnp.bfloat16, [np.full(8, 512)], 576)
    streamed, kept = (pool_memory(cfg, jnp.bfloat16, plan.layouts, 8, 512, host_pool=True, offload_weights=True,
                                  resident_layers=r) for r in (0, 4))
    per_layer = (streamed.host["weights"]) / cfg.num_layers
    assert kept.gpu["weights"] - streamed.gpu["weights"] == pytest.approx(4 * per_layer)
    assert streamed.host["weights"] - kept.host["weights"] == pytest.approx(4 * per_layer)


def test_transfers_are_issued_ahead_of_the_programs_and_the_planner_counts_them():
    """Item n+D-1's transfers are issued before item n's program (D = sync_depth) and at most D+1
    items' buffers and layers' weights are alive, as the memory plan counts; the logits do not depend
    on how far ahead the loop runs."""
    from kvoffload.plan.memory import weight_bytes

    model = tiny_random_model("opt", seed=8)
    opts = dict(offload_weights=True, schedule="column", gpu_batches=3)
    logits = {}
    for depth in (1, 3):
        pol, run = _run(model, "offload", steps=3, sync_depth=depth, **opts)
        assert all(r["lookahead_items"] == max(1, depth - 1) for r in run.records)
        mem = pol.pipeline.memory_plan
        per_layer = weight_bytes(model.config, model.params.layers[0].wk.dtype, model.params).per_layer
        want = min(depth + 1, model.config.num_layers) * per_layer
        assert mem.gpu["weights in flight"] == want and mem.gpu_phase["weights in flight"] == "decode"
        # prefill and decode workspaces are not alive together: the peak is the larger phase
        assert mem.gpu_bytes == mem.phase_bytes(None) + max(mem.phase_bytes("prefill"), mem.phase_bytes("decode"))
        assert mem.phase_bytes("prefill") > 0 and mem.phase_bytes("decode") > 0
        logits[depth] = generate(model, PROMPTS, 4, policy="offload", policy_options={**BASE, **opts, "sync_depth": depth},
                                 return_logits=True)[1]
    assert np.array_equal(logits[1], logits[3])


QUEST = dict(topk=12, num_recent=4, eta=0.5, retrieval="quest", quest_page_tokens=4)  # clo Quest on a tiny llama


def test_recompute_workspace_by_token_holds_every_extent_at_once():
    """The memory plan's recompute workspace, per device of a 4-way mesh: activations split by token are
    recomputed all at once (`attend_act_by_token`: the extents' X slices joined, every head's K/V of the
    device's tokens), so the workspace is the sum over a layout's activation extents of their K/V and X; split
    along H it is the largest single extent's K/V plus that extent's X gathered whole."""
    import dataclasses

    from kvoffload.device.sharding import device_config

    cfg = model_shape("opt-6.7b")
    dev = device_config(cfg, 4)
    plan = plan_pool(dev, jnp.bfloat16, [np.full(16, 1024)], 1152, extent_mb=8)
    lay = dataclasses.replace(plan.layouts[0], kv_extents=(0, plan.layouts[0].num_extents),
                              act_extents=(0, plan.layouts[0].num_extents))
    assert len(lay.extents_of("act")) > 2
    kw = dict(host_pool=True, offload_weights=False, activation_split=4)
    token, hidden = (pool_memory(dev, jnp.bfloat16, [lay], 16, 1024, x_by_token=t, **kw).gpu["recompute workspace"]
                     for t in (True, False))
    kv_blk = 64 * dev.kv_bytes_per_token * 2  # all heads of 16 tokens = this device's heads of 64
    x_blk = 64 * cfg.hidden_size * 2 // 4
    sizes = [lay.size(e) for e in lay.extents_of("act")]
    assert token == 2 * sum(sizes) * (kv_blk + x_blk)
    assert hidden == 2 * max(sizes) * (kv_blk + x_blk * 4)


def test_many_writes_equal_separate_writes_in_one_program_per_memory_space(monkeypatch):
    """A per-layer flush writes every layer's K, V (and X) blocks of an extent through `write_stored_blocks_many`:
    host and device extents, native and int4 / int8, at one contiguous run of slots or scattered (a slot past the
    extent dropped): each extent equals its own `write_stored_blocks`, in one program per memory space."""
    from kvoffload.runtime import pool as P

    rng = np.random.default_rng(1)
    calls = []
    real = P._write_program
    monkeypatch.setattr(P, "_write_program", lambda sh, n, path: calls.append((n, path)) or real(sh, n, path))

    def extent(kind):
        base = jnp.asarray(rng.standard_normal((6, 2, 4, 16)), jnp.float32)
        base = {"int4": P.quantize_blocks(base, 16), "int8": P.quantize_blocks(base, 16, "token", 8)}.get(kind, base)
        return jax.tree.map(np.asarray, base)  # host copies: each device_put makes new (donatable) arrays

    kinds = [("native", M.host_sharding()), ("int4", M.host_sharding()), ("int8", M.host_sharding()),
             ("native", M.device_sharding()), ("native", M.device_sharding())]
    for slots in (np.array([2, 3]), np.array([4, 1]), np.array([5, 6])):
        bases = [extent(k) for k, _ in kinds]
        blocks = [jnp.asarray(rng.standard_normal((2, 2, 4, 16)), jnp.float32) for _ in kinds]
        want = [P.write_stored_blocks(jax.device_put(b, sh), x, slots) for b, x, (_, sh) in zip(bases, blocks, kinds)]
        calls.clear()  # (each write above: a program of one array)
        got = P.write_stored_blocks_many([jax.device_put(b, sh) for b, (_, sh) in zip(bases, kinds)], blocks, slots)
        for g, w, b, (_, sh) in zip(got, want, bases, kinds):
            assert isinstance(g, P.QuantizedInt) == isinstance(b, P.QuantizedInt)
            for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
                assert x.sharding.memory_kind == sh.memory_kind
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # host: 1 + 3 + 3 arrays in one program; device: 2 in one
        assert sorted(n for n, _ in calls) == [2, 7], calls
        assert {path for _, path in calls} == {"run" if slots[1] == slots[0] + 1 and slots[1] < 6 else "scatter"}


def test_a_per_layer_flush_writes_every_layer_at_once(monkeypatch):
    """The per-layer (calls) flush pops, quantizes and writes all layers together: no single-array write and a
    handful of write programs whatever the layer count (it was ~15 programs a layer), clo's Quest bounds
    included."""
    from kvoffload.runtime import pool as P
    from test_tokenselect import _decode

    single, many = [], []
    real_one, real_many = P.write_blocks, P._write_program
    model = tiny_random_model("llama", seed=1, num_hidden_layers=4)
    pol, _, state = _decode(model, "clo", 2, **dict(QUEST, host_dtype="int4", int4_group_size=16,
                                                     int4_k_quant="int8", quest_dtype="int8"))
    monkeypatch.setattr(P, "write_blocks", lambda *a: single.append(1) or real_one(*a))
    monkeypatch.setattr(P, "_write_program", lambda sh, n, path: many.append(n) or real_many(sh, n, path))
    tok = jnp.zeros((state.batch,), jnp.int32)
    flushed = 0
    while not flushed:
        _, state = pol.decode_step(model, state, tok)
        flushed = state.records[-1]["flushed"]
    assert not single
    # layers 1..3 on the host: their K (int8: 3 arrays) and V (int4: 3) in one program, layer 0's (device) in
    # another, the Quest bounds (3 arrays a host layer) in a third, per extent touched
    assert len(many) <= 3 * len(state.groups[0].pool_k[0]) and max(many) >= 3 * 6, many
