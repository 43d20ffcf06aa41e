"""Tensor parallelism over heads (device/sharding.py): tokens and logits on 2- and 4-way meshes equal
the single-device run (fp32; logits to all-reduce rounding), the pool and tails live split by head, and
settings that cannot run are refused. The mesh cases need several devices, which XLA_FLAGS must give
before jax starts: they run in a subprocess (tests/tp_cases.py) with 4 virtual CPU devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kvoffload.models import tiny_random_model
from kvoffload.device import sharding as S
from kvoffload.plan.memory import weight_bytes_per_device
from kvoffload.policies import make_policy
from kvoffload.policies.options import PolicyOptionError

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS = "P(None, 'model')"
ALONG_H = "P(None, None, 'model')"
BY_TOKEN = HEADS  # [E, blk, H] split on axis 1: each block's tokens (kvpr, hybrid: sharding.X_TOKEN_SPEC)


def run_cases(cases, devices=4, timeout=600):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "tp_cases.py"), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("CASE ")]


def check_equal(res):
    case = res["case"]
    assert "error" not in res, res
    assert res["tokens_equal"], case
    # Megatron's row-parallel products are summed across devices: logits differ only by that rounding
    assert res["max_abs"] < 1e-4, (case, res["max_abs"])
    assert res["pool_k"] == [f"{HEADS}@{'device' if case['policy'] == 'full' else 'pinned_host'}"], res
    assert res["tail_k"] == [f"{HEADS}@device"] and res["logits"] == ["P()@device"], res
    if res["pool_x"]:  # extents by token (each device recomputes every head of its tokens), tails along H
        assert res["pool_x"] == [f"{BY_TOKEN}@pinned_host"] and res["tail_x"] == [f"{ALONG_H}@device"], res
        assert res["describe"]["tensor_parallel"]["x_split"] == "token", res
    # the step programs compile once: the state keeps its shardings from step to step; with activations split
    # by token a layer program has no conditional, so it compiles once per set of recomputed extents (at most
    # once more per extent that comes into use)
    later = res["later_compiles"]
    assert not {"jit(_choose_tokens)", "jit(_embed)"} & set(later), res
    extents = res["describe"]["last_step"]["used_extents"] if res["pool_x"] else 0
    assert later.count("jit(layer_body)") <= extents, res


@pytest.fixture(scope="module")
def default_runs():
    """The default suite's mesh cases in one subprocess (one start of Python and JAX, the tiny models' set-up
    shared): the policy runs of test_mesh_runs_equal_one_device_and_bad_splits_are_refused, then the kernel
    case of test_selection_kernels_run_per_device and the extents of test_default_extents_are_64_mib_per_device."""
    res = run_cases([KVPR_STREAMED, dict(arch="llama", policy="offload", tp=3), HYBRID_4_WAY,
                     dict(arch="opt", policy="kvpr", tp=2, opts=dict(block_tokens=1)), dict(kernels=True, tp=4),
                     dict(extents=True, policy="offload")])
    assert len(res) == 6, res
    return res[:4], res[4:]


def test_mesh_runs_equal_one_device_and_bad_splits_are_refused(default_runs):
    """kvpr on a 4-way mesh (GQA LLaMA: X extents below the split recomputed from activations split by
    token, K/V above it fetched by head; weights streamed, three GPU batches a layer in the column schedule)
    equals `full` on one device, gathers W_K / W_V once per layer (not per GPU batch's program), right
    before the layer's first program, and recomputes, attends and exchanges a program's recomputed extents
    once (laid end to end); tensor_parallel=3 with 8 query heads is refused naming the numbers, and so is
    kvpr with blocks of 1 token on 2 devices. (Every policy, both families, 2- and 4-way: the slow tests
    below; a 2-way OPT offload run: the two-process test.)"""
    res, _ = default_runs
    check_equal(res[0])
    assert res[0]["pool_x"], "kvpr with split_point=24 stores activations"
    last = res[0]["describe"]["last_step"]
    assert 1 < last["recompute_extents"] < last["used_extents"], last  # some extents recomputed, some fetched
    assert res[0]["w_kv_gathers_last_step"] == 2 and res[0]["collectives"]["all-to-all"] == 1, res[0]
    # each gather right before its layer's first program (3 GPU batches): issued with the copies ahead, it
    # would hold the compute stream until the next layer's weights land
    assert res[0]["dispatch_order"] == "gLLLgLLL", res[0]
    # the recomputed extents laid end to end: one recompute and one paged attention whatever their number
    calls = res[0]["act_calls"]
    assert max(c["extents"] for c in calls) > 1 and all(c["paged"] == c["recompute"] == 1 for c in calls), calls
    assert res[1]["error"] == "TensorParallelError"
    assert "query heads 8" in res[1]["message"] and "not divisible by 3" in res[1]["message"], res[1]
    check_hybrid_4_way(res[2])
    # activations split by token need whole slices of every block
    assert res[3]["error"] == "TensorParallelError" and "block_tokens must be a multiple of tensor_parallel=2" in \
        res[3]["message"], res[3]


@pytest.mark.slow  # 12 s: a subprocess with 2 virtual devices
def test_kvpr_own_split_on_a_2_way_mesh_prices_the_exchange():
    """kvpr with its own split on a 2-way mesh (OPT) equals `full` on one device, and describe() prices the
    exchange of partial softmaxes that recomputing by token costs (no X crosses between devices)."""
    res = [None, None] + run_cases([dict(arch="opt", policy="kvpr", tp=2)])
    # each device receives, per batch row (3) and layer (2), half of the other device's partial out and lse
    # over its tokens for every head (tiny OPT: 4 heads of 16, fp32): whatever the number of recomputed tokens
    check_equal(res[2])
    tp, last = res[2]["describe"]["tensor_parallel"], res[2]["describe"]["last_step"]
    assert tp["devices"] == 2 and tp["recompute_extents"] > 0 and "partial softmaxes" in last["split_reason"], res[2]
    assert tp["exchange_bytes_per_step"] == 3 * 4 * (16 + 1) * 4 / 2 * 2, res[2]
    assert tp["exchange_s_per_step"] > 0 and "default, not measured" in tp["collective_fit"], res[2]


SLOW_CASES = [dict(arch=a, policy=p, tp=n, opts=o) for a in ("opt", "llama") for n in (2, 4) for p, o in (
    ("full", {}), ("offload", {}), ("kvpr", dict(split_point=16)), ("kvpr", {}),
    ("kvpr", dict(split_point=10**6, schedule="column", gpu_batches=3, offload_weights=True)),
    ("offload", dict(schedule="column", gpu_batches=3, offload_weights=True)),
    # K in per-token groups (not kvpr's per-channel default: for tiny Llama that is the rounding tie below)
    ("kvpr", dict(split_point=16, host_dtype="int4", int4_group_size=8, int4_k_quant="token")),
)] + [
    # K scaled per channel ([E, n_kv, 1, d] scales split by head): OPT only. Tiny Llama's channel run
    # (tp 2 and 4) has every K code equal to one device's, but one V value (token mode) rounds to the
    # neighbouring code at the second flush (the mesh's V differs in its last bits at a rounding tie):
    # logits then differ by 3e-3, past check_equal's 1e-4
    dict(arch="opt", policy="kvpr", tp=n, opts=dict(split_point=16, host_dtype="int4", int4_group_size=8,
                                                    int4_k_quant="channel")) for n in (2, 4)]


@pytest.mark.slow
def test_every_supported_policy_on_2_and_4_way_meshes():
    for res in run_cases(SLOW_CASES, timeout=3000):
        check_equal(res)


def test_refusals_without_devices():
    opt = tiny_random_model("opt")
    with pytest.raises(S.TensorParallelError, match=r"query heads 4, KV heads 4, MLP width 128 .*not divisible by 3"):
        S.check_divisible(opt.config, 3)
    llama = tiny_random_model("llama")  # 4 query heads, 2 KV heads
    with pytest.raises(S.TensorParallelError, match=r"KV heads 2.*\(KV heads not divisible by 4\).*\[1, 2\]"):
        S.check_divisible(llama.config, 4)
    with pytest.raises(S.TensorParallelError, match="extrapolate=True .* does not run tensor-parallel"):
        make_policy("tokenselect", extrapolate=True, tensor_parallel=2)
    with pytest.raises(S.TensorParallelError, match="needs 64 devices"):
        make_policy("full", tensor_parallel=64)
    with pytest.raises(PolicyOptionError, match="option tensor_parallel must be an integer >= 1, got 0"):
        make_policy("offload", tensor_parallel=0)  # the options' schema refuses it before any mesh is built


def test_weight_specs_are_megatron_style():
    for arch in ("opt", "llama"):
        lp = S.layer_specs(tiny_random_model(arch).params.layers[0])
        col, row, rep = S.P(None, S.MODEL), S.P(S.MODEL, None), S.P()
        assert lp.wq == lp.wk == lp.wv == col and lp.wo == row
        if arch == "opt":
            assert lp.fc1 == col and lp.fc2 == row and lp.b1 == S.P(S.MODEL) and lp.b2 == rep and lp.bo == rep
        else:
            assert lp.w_gate == lp.w_up == col and lp.w_down == row and lp.attn_norm == lp.mlp_norm == rep


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 25-60 s: two processes each compile the step (run with -m slow)
@pytest.mark.parametrize("cases", [
    [dict(arch="opt", policy="offload", tp=2)],
    pytest.param([dict(arch="llama", policy="kvpr", tp=2, opts=dict(split_point=16)),
                  dict(arch="opt", policy="full", tp=2)], marks=pytest.mark.slow),
])
def test_two_processes_equal_one(cases):
    """The same code under jax.distributed, one CPU device per process (gloo collectives), gives the
    single-process tokens in both processes."""
    outs = run_processes(cases)
    assert len(outs[0]) == len(outs[1]) == len(cases)
    for a, b in zip(*outs):
        check_equal(a)
        check_equal(b)
        assert a["tokens"] == b["tokens"]


def test_two_processes_transfer_by_shard():
    """Under jax.distributed the runtime's transfers (memory.transfer) move an array of the mesh shard by shard
    (single-device copies): JAX's device_put sends it down the cross-host path, which made every step of
    kvpr on 2 H100s in 2 processes 161 ms instead of 89. Values, memory kinds and layouts as asked."""
    for out in run_processes([dict(transfer=True)]):
        t = out[0]["transfer"]
        assert not t.pop("fully_addressable") and t.pop("copies") >= 2 * 3, t
        assert all(t.values()), t


def run_processes(cases, n=2):
    """tp_cases.py `cases` in n processes under jax.distributed (one CPU device each): each process's results."""
    coord = f"localhost:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "tp_cases.py"), json.dumps(cases), "--coordinator",
                               coord, "--num-processes", str(n), "--process-id", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, se[-4000:]
        outs.append([json.loads(line[5:]) for line in so.splitlines() if line.startswith("CASE ")])
    return outs


# -- hybrid (HybridServe) on a mesh ----------------------------------------------------------------


def check_hybrid(res, resident=""):
    """check_equal for hybrid: its GPU-resident extents (resident: "k" K/V, "x" activations) live in
    device memory split like the host ones (K/V by KV head, X by token); the host blocks it moves and
    recomputes are as `check_equal` wants them."""
    for key, spec, kind in (("pool_k", HEADS, "k"), ("pool_x", BY_TOKEN, "x")):
        on_gpu = f"{spec}@device"
        assert (on_gpu in res[key]) == (kind in resident), (key, res)
        res = {**res, key: [s for s in res[key] if s != on_gpu]}
    check_equal(res)
    d = res["describe"]
    assert d["tensor_parallel"]["devices"] == res["case"]["tp"], res
    return d["last_step"]


# kvpr with weights streamed in the column schedule (three GPU batches' programs per layer, the same weights):
# the layer's W_K / W_V head shards are gathered whole once per layer and step (2 layers), not per program;
# split at 24 tokens: 2 of 4 extents recomputed, the others' K/V fetched
KVPR_STREAMED = dict(arch="llama", policy="kvpr", tp=4, hlo=True, opts=dict(split_point=24, schedule="column",
                                                                            gpu_batches=3, offload_weights=True))

# in the default test's subprocess above (its llama reference shared): ~7 s
HYBRID_4_WAY = dict(arch="llama", policy="hybrid", tp=4, opts=dict(act_share=0.5, gpu_blocks=6))


def check_hybrid_4_way(res):
    """hybrid on a 4-way mesh (GQA LLaMA, weights streamed from pinned host sharded Megatron-style): host KV
    blocks fetched by head, host ACT blocks split by token (each device regenerates every head of its
    tokens), GPU-resident ACT blocks; tokens equal `full` on one device, and the exchange is priced."""
    last = check_hybrid(res, resident="x")
    assert res["w_kv_gathers_last_step"] == 2, res  # once per layer
    (mb,) = last["gpu_batches"]
    assert mb["kv_host"] > 0 and mb["act_host"] > 0 and mb["act_gpu"] > 0, res
    # per layer (2): 3/4 of the partial softmaxes of 3 rows x 8 heads x (8 + 1) fp32, and the streamed W_K /
    # W_V shards' all-gather (3/4 of 2 x [64, 4 KV heads x 8] fp32: 12 KB)
    merge, w_gather = 3 * 8 * 9 * 4 * 3 / 4, 2 * 64 * 32 * 4 * 3 / 4
    assert last["recompute_tokens"] > 0 and last["bytes_gather"] == (merge + w_gather) * 2, res


HYBRID_CASES = [dict(arch=a, policy="hybrid", tp=n, opts=o) for a in ("opt", "llama") for n in (2, 4) for o in (
    {},  # its own plan: balanced split, GPU-resident blocks in the (CPU: absent) GPU budget
    dict(act_share=0.4, gpu_blocks=6),  # host KV, host ACT and GPU-resident ACT extents
    dict(act_share=0.0, gpu_blocks=6),  # host KV and GPU-resident KV extents
    dict(act_share=0.7, gpu_blocks=0, mini_batch_gb=1e-6),  # one request per mini-batch (zig-zag over 3)
    dict(act_share=0.5, gpu_blocks=0, host_dtype="int4", int4_group_size=8),  # int4 host blocks
)]


@pytest.mark.slow
def test_hybrid_on_2_and_4_way_meshes():
    for res in run_cases(HYBRID_CASES, timeout=3000):
        o = res["case"]["opts"]
        resident = "" if not o.get("gpu_blocks") else "x" if o["act_share"] > 0 else "k"
        last = check_hybrid(res, resident=resident)
        mbs = last["gpu_batches"]
        if o.get("mini_batch_gb"):
            assert len(mbs) == 3, res
        if 0 < o.get("act_share", 0) < 1:  # a mixed split really mixes, and the exchange is priced
            assert sum(m["act_host"] for m in mbs) > 0 and sum(m["kv_host"] for m in mbs) > 0, res
            assert last["bytes_gather"] > 0 and res["describe"]["tensor_parallel"]["exchange_s_per_step"] > 0, res
        if o.get("gpu_blocks"):
            assert sum(m["act_gpu" if o["act_share"] > 0 else "kv_gpu"] for m in mbs) > 0, res


def test_hybrid_block_rates_price_one_device_of_the_mesh():
    """hybrid's cost model at N=2 prices one device: half of each block's K/V and X over its own link (the
    per-transfer intercept whole), half the recompute flops plus the all-gather of the block's X before it
    (absent on one device), its weight shard streamed, the dense time with the two all-reduces; memory
    budgets split over the devices that share the host."""
    import jax.numpy as jnp

    from kvoffload.plan.cost import CostModel, LayerShape, Linear
    from kvoffload.plan.hybrid import BlockRates, algorithm1

    model = tiny_random_model("opt")  # MHA: h 64 = 4 heads x 16, fp32
    cfg, cost, blk, batch = model.config, CostModel.default("gpu"), 16, 4
    rates = {}
    for n in (1, 2):
        wb = weight_bytes_per_device(cfg, jnp.float32, model.params, n)
        shape = LayerShape.of(cfg, 4, wb.per_layer, wb.kv_per_layer, tensor_parallel=n)
        rates[n] = BlockRates.of(cost, shape, blk, offload_weights=True, batch=batch)
    one, two = rates[1], rates[2]
    h = cfg.hidden_size
    assert two.kv_bytes == one.kv_bytes / 2 == blk * 2 * h * 4 / 2 and two.act_bytes == one.act_bytes / 2
    assert two.kv_gpu_bytes == one.kv_gpu_bytes / 2 and two.act_gpu_bytes == one.act_gpu_bytes / 2
    assert two.load_kv == Linear(one.load_kv.intercept, one.load_kv.slope / 2)
    assert two.load_act == Linear(one.load_act.intercept, one.load_act.slope / 2)
    assert two.attention == Linear(one.attention.intercept, one.attention.slope / 2)
    # regenerating an ACT block: the all-gather of the other half of its X, then half the flops
    assert one.x_gather == Linear(0.0, 0.0) and one.kv_gen == Linear(cost.recompute.intercept, one.kv_gen.slope)
    assert two.x_gather == Linear(cost.all_gather.intercept, cost.all_gather.slope * blk * h * 4 / 2)
    assert two.kv_gen.intercept == cost.recompute.intercept + cost.all_gather.intercept
    assert abs(two.kv_gen.slope - (one.kv_gen.slope / 2 + two.x_gather.slope)) <= 1e-12 * one.kv_gen.slope
    assert two.to_json()["x_gather"] == two.x_gather.to_json() and two.to_json()["tensor_parallel"] == 2
    # the weights: each device streams its shard (the split matrices halved, norms and output biases whole)
    w1 = weight_bytes_per_device(cfg, jnp.float32, model.params, 1).per_layer
    w2 = weight_bytes_per_device(cfg, jnp.float32, model.params, 2).per_layer
    assert w1 / 2 < w2 < w1 * 0.55 and two.load_w == cost.h2d(w2) < one.load_w
    allreduce = 2 * cost.all_gather(batch * 2 * h * 4 / 2)
    dense_flops = LayerShape.of(cfg, 4, tensor_parallel=2).dense_flops_tok
    assert two.dense_s == max(cost.dense(batch * dense_flops), w2 / cost.hbm_bw) + allreduce
    assert one.dense_s == max(cost.dense(batch * 2 * dense_flops), w1 / cost.hbm_bw)
    # X split by token (the pipeline's layout for hybrid): an ACT block regenerates at half the flops with no
    # gather; the layer's dense time adds the exchange of partial softmaxes and the streamed W_K / W_V's gather
    wb2 = weight_bytes_per_device(cfg, jnp.float32, model.params, 2)
    tok = BlockRates.of(cost, LayerShape.of(cfg, 4, wb2.per_layer, wb2.kv_per_layer, tensor_parallel=2, x_split="token"),
                        blk, offload_weights=True, batch=batch)
    assert tok.x_gather == Linear(0.0, 0.0) and tok.kv_gen == Linear(cost.recompute.intercept, one.kv_gen.slope / 2)
    exchange = cost.all_gather(batch * 4 * 17 * 4 / 2) + cost.all_gather(wb2.kv_per_layer)
    assert tok.dense_s == pytest.approx(two.dense_s + exchange) and tok.load_act == two.load_act
    # OPT-13B's shape (bf16, 16-token blocks): an ACT block's GPU time per device is more than half of one
    # device's (the all-gather) and less than it (half the flops), its load exactly half: the balance moves
    from kvoffload.plan.profiler import model_shape

    big = model_shape("opt-13b")
    per_n = {n: BlockRates.of(cost, LayerShape.of(big, 2, tensor_parallel=n), blk, offload_weights=False)
             for n in (1, 2)}
    g1, g2 = per_n[1].kv_gen.slope, per_n[2].kv_gen.slope
    assert g1 / 2 < g2 < g1 and per_n[2].x_gather.slope == cost.all_gather.slope * blk * big.hidden_size * 2 / 2
    assert per_n[2].load_act.slope == per_n[1].load_act.slope / 2
    # Algorithm 1 with one device's share of a host budget holds the same blocks (each half the bytes)
    host = 2e6
    a1, a2 = algorithm1(one, host, cfg.num_layers, act_share=0.5), algorithm1(two, host / 2, cfg.num_layers, act_share=0.5)
    assert (a1.kv_host, a1.act_host) == (a2.kv_host, a2.act_host)
    # budgets: host memory split over the local devices; GPU memory per device (on a CPU backend the
    # "devices" share host memory, so that too)
    assert S.device_budgets(8e9, 4e9, None, "gpu") == (8e9, 4e9)
    import types

    import jax
    import numpy as np

    two_local = types.SimpleNamespace(devices=np.array([jax.devices()[0]] * 2))  # a 2-device mesh's devices
    assert S.local_size(two_local) == 2
    assert S.device_budgets(8e9, 4e9, two_local, "gpu") == (4e9, 4e9)
    assert S.device_budgets(8e9, 4e9, two_local, "cpu") == (4e9, 2e9)


# clo and tokenselect (approximate: compared with themselves on one device, tests/tp_cases.py): small budgets so
# the selection matters, reuse rules that hit and miss; persistent heads on one device of the mesh only
# ((1, last KV head): per-device counts unequal, the buffers whole-capacity either way); HATA with replayed
# (per-head Bernoulli) reuse; clo's speculative prefetch; tokenselect on the device pool and kv=split store=act
# (activation rows gathered along H and recomputed)
SEL = dict(num_sink=1, num_recent=2)
SELECTION_CASES = [dict(arch=a, policy=p, tp=n, opts=o) for a, kv in (("opt", 4), ("llama", 4)) for n in (2, 4)
                   for p, o in (
    ("clo", dict(topk=8, fixed_threshold=0.0, persistent_heads=[(1, kv - 1)], **SEL)),
    ("clo", dict(retrieval="hata", hata_bits=32, topk=8, replay_hit_rate=0.5, persistent_heads=[(1, 0)], **SEL)),
    ("tokenselect", dict(token_budget=8, cache_threshold=0.0, **SEL)),
)] + [dict(arch="llama", policy="clo", tp=2, opts=dict(topk=8, fixed_threshold=0.0, speculative_prefetch=True, **SEL)),
      dict(arch="llama", policy="clo", tp=2, opts=dict(retrieval="quest", quest_dtype="int8", quest_page_tokens=4,
                                                       topk=8, fixed_threshold=0.0, **SEL)),
      dict(arch="llama", policy="tokenselect", tp=2, opts=dict(token_budget=8, kv="split", store="act",
                                                               cache_threshold=0.0, **SEL))]


def check_selection(res):
    """A clo / tokenselect case: tokens and logits equal the policy on one device; its pool, tails and slots
    split by head (clo: the per-head rule too); its cache both hit and missed; the step compiled once."""
    case, opts = res["case"], res["case"]["opts"]
    assert "error" not in res, res
    assert res["tokens_equal"], case
    assert res["max_abs"] < 1e-4, (case, res["max_abs"])
    keys_dev = case["policy"] == "tokenselect" or opts.get("retrieval", "exact") == "exact"
    values_dev = case["policy"] == "tokenselect" and opts.get("kv", "gpu") == "gpu"
    # clo's layer 0 (layer0_full, the default): a device layer, its K and V extents on the GPU by head
    layer0 = {f"{HEADS}@device"} if case["policy"] == "clo" and opts.get("layer0_full", True) else set()
    assert res["pool_k"] == sorted({f"{HEADS}@{'device' if keys_dev else 'pinned_host'}"} | layer0), res
    if opts.get("store") == "act":
        assert res["pool_v"] == [] and res["pool_x"] == [f"{ALONG_H}@pinned_host"], res
    else:
        assert res["pool_v"] == sorted({f"{HEADS}@{'device' if values_dev else 'pinned_host'}"} | layer0), res
    assert res["tail_k"] == [f"{HEADS}@device"] and res["logits"] == ["P()@device"], res
    assert f"{HEADS}@device" in res["slots"] and set(res["slots"]) <= {f"{HEADS}@device", "P()@device",
                                                                       "P('model',)@device"}, res
    if case["policy"] == "clo":
        assert "P('model',)@device" in res["slots"], res  # tau, weights, persistent by head
    assert 0 < res["hit_rate"] < 1, res
    assert not {"jit(layer_body)", "jit(_choose_tokens)", "jit(_embed)", "jit(speculate_layer)"} & set(res["later_compiles"]), res


def check_kernels(res):
    assert all(v < 1e-6 for v in res["max_abs"].values()), res
    assert res["shardings"] == {"gather_kv": HEADS, "gather_x": ALONG_H, "sparse_attention": HEADS,
                                "scores": HEADS, "select": HEADS, "quest_bounds": HEADS,
                                "quest_bounds_active": HEADS, "rows_attention": HEADS}, res


def test_selection_kernels_run_per_device(default_runs):
    """The kernels in clo's and tokenselect's layer programs (row gathers from pinned-host K/V and activation
    extents, sparse and row-buffer attention, exact scores with per-head lengths, the top-k, Quest's bounds with
    and without inactive heads) under a 4-way mesh, each device on its heads
    (interpret mode), equal their references and come back split by head (X rows along H). (A 2-way mesh, each
    device on two KV heads: the slow test below.)"""
    _, (res, _) = default_runs
    assert res["case"]["tp"] == 4
    check_kernels(res)


def test_default_extents_are_64_mib_per_device(default_runs):
    """By default an extent holds 64 MiB of K per device of the mesh (each device's copies the size of one
    GPU's: fewer of them for the host to issue), so a 4-way mesh plans 256 MiB extents; a given extent_mb
    is kept on any mesh (a mesh's pool planned like one device's)."""
    _, (_, res) = default_runs
    ext = res["extents"]
    assert [ext[f"default_{n}"] for n in (1, 2, 4)] == [64.0, 128.0, 256.0], ext
    assert [ext[f"given_{n}"] for n in (1, 2, 4)] == [8.0, 8.0, 8.0], ext
    blocks = ext["plan_blocks"]
    assert blocks["64"] < blocks["256"] and ext["extent_blocks_4"] == blocks["256"], ext


@pytest.mark.slow  # 4 s: the kernels compiled again for the 2-way mesh's shards
def test_selection_kernels_run_per_device_on_a_2_way_mesh():
    (res,) = run_cases([dict(kernels=True, tp=2)])
    assert res["case"]["tp"] == 2
    check_kernels(res)


@pytest.mark.slow  # ~5 min: 15 cases, each generated on one device and on the mesh
def test_clo_and_tokenselect_on_2_and_4_way_meshes():
    for res in run_cases(SELECTION_CASES, timeout=3000):
        check_selection(res)
