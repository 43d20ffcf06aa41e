"""The cost model under tensor parallelism (plan/cost.py, plan/split.py): one device's shape (its heads,
1/N of X over its link, and with X split along H the all-gather of X before recomputing, with X split by
token the exchange of partial softmaxes) on hand-worked OPT-6.7B b64 P512 numbers, the split it moves, the
all-gather fit in profiles, and the profiler's all-gather on 4 virtual devices."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvoffload.runtime.cost import extent_work
from kvoffload.runtime.pool import PoolLayout
from kvoffload.device.sharding import TensorParallelError
from kvoffload.plan.cost import (
    DEFAULT_ALL_GATHER,
    CostModel,
    LayerShape,
    LayerWork,
    Linear,
    predict_layers,
)
from kvoffload.plan.profiler import fit_profile, model_shape
from kvoffload.plan.split import choose_split

# round numbers, no latencies: 50 GB/s PCIe, 400 TFLOP/s recompute, 2.5 TB/s attention, 500 TFLOP/s dense,
# 200 GB/s all-gather (received per device)
COST = CostModel(h2d=Linear(0, 1 / 50e9), d2h=Linear(0, 1 / 50e9), recompute=Linear(0, 1 / 400e12),
                 attention=Linear(0, 1 / 2.5e12), dense=Linear(0, 1 / 500e12), hbm_bw=1e30,
                 all_gather=Linear(0, 1 / 200e9), all_gather_devices=2)
OPT = model_shape("opt-6.7b")  # h 4096, 32 heads of 128, MLP 16384, bf16
T = 64 * 512  # b64 P512: tokens of one layer
# 512 blocks of 64 tokens in 4 extents of 8192 tokens
LAYOUT = PoolLayout(block_tokens=64, extent_blocks=128, num_extents=4)


def shape(n):
    return LayerShape.of(OPT, 2, tensor_parallel=n)


def test_one_device_shape_per_mesh_size():
    """Per device of N: X stored and fetched 1/N (split along H), K/V of its heads 1/N, recompute flops 1/N
    (its heads' columns of W_K, W_V over the whole X), and (N-1)/N of each recomputed X received."""
    for n, x, kv, flops, gather, allreduce in ((1, 8192, 16384, 2 * 4096 * 8192, 0, 0),
                                               (2, 4096, 8192, 2 * 4096 * 4096, 4096, 8192),
                                               (4, 2048, 4096, 2 * 4096 * 2048, 6144, 12288)):
        sh = shape(n)
        assert (sh.x_host_tok, sh.kv_host_tok, sh.kv_tok, sh.recompute_flops_tok, sh.x_gather_tok,
                sh.allreduce_row) == (x, kv, kv, flops, gather, allreduce), n
    assert LayerShape.of(OPT, 2, host_dtype="int4", tensor_parallel=2).x_host_tok == (4096 // 2 + 8 * 4096 // 64) / 2
    with pytest.raises(TensorParallelError, match="not divisible by 3"):
        shape(3)


def test_all_recomputed_layer_with_and_without_a_mesh():
    """Every token of the layer recomputed from X: hand-worked seconds per device."""
    work = LayerWork(batch=64, recompute_tokens=T, attended_tokens=T)
    one = predict_layers(COST, shape(1), [dataclasses.replace(work, bytes_x=T * 8192)])
    two = predict_layers(COST, shape(2), [dataclasses.replace(work, bytes_x=T * 4096)])
    dense_1 = 64 * 2 * (4 * 4096 * 4096 + 2 * 4096 * 16384) / 500e12  # projections + MLP, all heads
    assert one["transfer_s"] == pytest.approx(T * 8192 / 50e9)  # 5.369 ms
    assert one["recompute_s"] == pytest.approx(T * 2 * 4096 * 8192 / 400e12)  # 5.498 ms
    assert one["gather_s"] == one["bytes_gather"] == 0
    assert one["gpu_s"] == pytest.approx(5.498e-3 + T * 16384 / 2.5e12 + dense_1, rel=1e-3)
    # 2 devices: half the PCIe bytes and half the recompute, plus 134 MB of X received over NVLink
    assert two["transfer_s"] == pytest.approx(T * 4096 / 50e9)  # 2.684 ms
    assert two["recompute_s"] == pytest.approx(T * 2 * 4096 * 4096 / 400e12)  # 2.749 ms
    assert two["bytes_gather"] == T * 4096
    assert two["gather_s"] == pytest.approx(T * 4096 / 200e9)  # 0.671 ms
    # the two all-reduces of [64, 4096] bf16: each device receives 2 (N-1)/N of 512 KB in each
    assert two["allreduce_s"] == pytest.approx(2 * 64 * 4096 * 2 / 200e9) and one["allreduce_s"] == 0
    assert two["gpu_s"] == pytest.approx(2.749e-3 + 0.671e-3 + T * 8192 / 2.5e12 + dense_1 / 2 + 5.2e-6, rel=1e-3)
    assert two["step_s"] == two["gpu_s"] and two["bound"] == "gpu"  # the all-gather tips it to GPU-bound
    assert one["step_s"] / two["step_s"] == pytest.approx(1.62, abs=0.01)  # not 2x: the gather is extra


def test_the_all_gather_moves_the_split():
    """Per extent at N=2: X 0.671 ms vs K/V 1.342 ms over PCIe; recompute 0.687 ms + all-gather 0.168 ms.
    Without the gather term all 4 extents (GPU 2.88 ms vs PCIe 2.68) beat 3 (PCIe 3.36); counting it, 4
    costs 3.55 ms of GPU time and 3 extents (PCIe 3.36, GPU 2.70) win. One device recomputes all 4."""
    work = lambda sh: lambda r: [extent_work(sh, LAYOUT, 64, 4, r, T + 64)]  # noqa: E731
    sh2 = shape(2)
    no_gather = dataclasses.replace(sh2, x_gather_tok=0.0)
    blind = choose_split(COST, no_gather, work(no_gather), range(5))
    assert blind.r == 4 and blind.predicted_s == pytest.approx(2.88e-3, rel=0.01)
    plan = choose_split(COST, sh2, work(sh2), range(5))
    assert plan.r == 3 and plan.predicted_s == pytest.approx(3.355e-3, rel=0.01)
    p4 = predict_layers(COST, sh2, work(sh2)(4))
    assert p4["step_s"] == pytest.approx(3.553e-3, rel=0.01) and p4["gather_s"] == pytest.approx(4 * 0.168e-3, rel=0.01)
    assert "all-gather of X 100.7 MB" in plan.reason and "measured on 2 devices" in plan.reason, plan.reason
    assert choose_split(COST, shape(1), work(shape(1)), range(5)).r == 4
    # 4 devices: per extent X 0.336 ms vs K/V 0.671 ms, recompute 0.344 ms + gather 0.252 ms
    sh4 = shape(4)
    plan4 = choose_split(COST, sh4, work(sh4), range(5))
    times = {r: predict_layers(COST, sh4, work(sh4)(r))["step_s"] for r in range(5)}
    assert plan4.r == min(times, key=times.get) == 3


def test_x_split_by_token_prices_the_exchange_not_the_gather():
    """X split by token (kvpr's and hybrid's layout on a mesh): the same PCIe bytes and flops per device, no X
    received; each recomputing layer exchanges 1/2 of [64, 32 heads, 128 + 1] fp32 partials (528 KB: 2.6 us)
    and, where weights stream, gathers the other half of W_K / W_V (33.6 MB). The all-recomputed layer then
    scales 1.99x on 2 devices (1.62x with the all-gather above), and the split keeps all 4 extents."""
    tok = LayerShape.of(OPT, 2, w_kv=2 * 4096 * 4096 * 2 / 2, tensor_parallel=2, x_split="token")
    hid = shape(2)
    assert (tok.x_host_tok, tok.kv_tok, tok.recompute_flops_tok, tok.allreduce_row) == (
        hid.x_host_tok, hid.kv_tok, hid.recompute_flops_tok, hid.allreduce_row)
    assert tok.x_gather_tok == 0 and tok.act_merge_row == 32 * 129 * 4 / 2 and tok.w_kv_gather == 4096 * 4096 * 2
    assert hid.act_merge_row == hid.w_kv_gather == 0 and shape(1) == LayerShape.of(OPT, 2, x_split="token")
    work = LayerWork(batch=64, recompute_tokens=T, attended_tokens=T)
    one = predict_layers(COST, shape(1), [dataclasses.replace(work, bytes_x=T * 8192)])
    two = predict_layers(COST, tok, [dataclasses.replace(work, bytes_x=T * 4096)])
    assert two["bytes_gather"] == 64 * 32 * 129 * 4 / 2 and two["gather_s"] == pytest.approx(528384 / 200e9)
    assert one["step_s"] / two["step_s"] == pytest.approx(1.99, abs=0.01)
    streamed = predict_layers(COST, tok, [dataclasses.replace(work, bytes_x=T * 4096)], offload_weights=True)
    assert streamed["bytes_gather"] == two["bytes_gather"] + 4096 * 4096 * 2
    # a layer that recomputes nothing exchanges nothing
    none = predict_layers(COST, tok, [LayerWork(batch=64, bytes_kv=T * 8192, attended_tokens=T)], offload_weights=True)
    assert none["gather_s"] == none["bytes_gather"] == 0
    work_of = lambda r: [extent_work(tok, LAYOUT, 64, 4, r, T + 64)]  # noqa: E731
    plan = choose_split(COST, tok, work_of, range(5))
    assert plan.r == 4 and "partial softmaxes" in plan.reason, plan.reason
    with pytest.raises(ValueError, match="x_split"):
        LayerShape.of(OPT, 2, tensor_parallel=2, x_split="heads")


def test_streamed_w_kv_is_gathered_once_per_layer():
    """Streamed W_K / W_V head shards are gathered whole once per layer (`sharding.gather_whole`, its own
    program: its bytes and one all-gather intercept once), not in each GPU batch's program: four batches
    that all recompute pay the 33.6 MB once; a layer where no batch recomputes gathers nothing."""
    cost = dataclasses.replace(COST, all_gather=Linear(4e-4, 1 / 200e9))
    tok = LayerShape.of(OPT, 2, w_kv=2 * 4096 * 4096 * 2 / 2, tensor_parallel=2, x_split="token")
    work = LayerWork(batch=16, recompute_tokens=T // 4, attended_tokens=T // 4, bytes_x=T // 4 * 4096)
    merge = 16 * 32 * 129 * 4 / 2
    one, four = (predict_layers(cost, tok, [work] * n, offload_weights=True) for n in (1, 4))
    w = 4096 * 4096 * 2
    assert one["bytes_gather"] == w + merge and four["bytes_gather"] == w + 4 * merge
    assert four["gather_s"] == pytest.approx(cost.all_gather(w) + 4 * merge / 200e9)
    resident = predict_layers(cost, tok, [work] * 4)
    assert four["gather_s"] - resident["gather_s"] == pytest.approx(cost.all_gather(w))
    fetch = LayerWork(batch=16, bytes_kv=T // 4 * 8192, attended_tokens=T // 4)
    assert predict_layers(cost, tok, [fetch] * 4, offload_weights=True)["bytes_gather"] == 0


def test_a_layer_program_pays_one_launch():
    """Each GPU batch's layer is one program: its parts add their slope terms and the program one intercept,
    the largest of its parts' (the profile fits each part on its own call, whose launch the program pays once)."""
    cost = dataclasses.replace(COST, recompute=Linear(2e-4, 1 / 400e12), attention=Linear(3e-4, 1 / 2.5e12),
                               dense=Linear(1e-4, 1 / 500e12), all_gather=Linear(4e-4, 1 / 200e9))
    tok = LayerShape.of(OPT, 2, tensor_parallel=2, x_split="token")
    work = LayerWork(batch=64, recompute_tokens=T, attended_tokens=T, bytes_x=T * 4096)
    flat, p = predict_layers(COST, tok, [work]), predict_layers(cost, tok, [work])
    assert flat["launch_s"] == 0 and p["launch_s"] == 4e-4 and p["gpu_s"] == pytest.approx(flat["gpu_s"] + 4e-4)
    assert p["recompute_s"] == flat["recompute_s"] and p["gather_s"] == flat["gather_s"]
    # two GPU batches: two programs, two launches; one device without recompute: attention's intercept is the largest
    assert predict_layers(cost, tok, [work, work])["launch_s"] == 8e-4
    one = predict_layers(cost, shape(1), [LayerWork(batch=64, bytes_kv=T * 8192, attended_tokens=T)])
    assert one["launch_s"] == 3e-4 and one["gpu_s"] == pytest.approx(
        3e-4 + T * 16384 / 2.5e12 + 64 * 2 * (4 * 4096 * 4096 + 2 * 4096 * 16384) / 500e12)


def test_profiles_record_the_all_gather_fit(tmp_path):
    raw = {k: [(1e6, 1e-3), (2e6, 2e-3)] for k in ("h2d", "d2h", "recompute", "attention", "dense")}
    raw["hbm_bw"] = 1e12
    one = fit_profile(raw, 1, "gpu")  # one device: the default, recorded as not measured
    assert one["all_gather"] == DEFAULT_ALL_GATHER["gpu"].to_json() and one["all_gather_devices"] == 0
    two = fit_profile({**raw, "all_gather": [(1e6, 2e-5 + 1e6 / 300e9), (4e6, 2e-5 + 4e6 / 300e9)]}, 2, "gpu")
    assert two["all_gather_devices"] == 2 and two["all_gather"][1] == pytest.approx(1 / 300e9)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"device": "x", "platform": "gpu", "fits": two}))
    cm = CostModel.load(str(path))
    assert cm.all_gather == Linear.from_json(two["all_gather"]) and cm.all_gather_devices == 2
    assert CostModel.from_fits(cm.to_json(), "x", platform="gpu") == dataclasses.replace(cm, source="profile")
    # a profile written before the all-gather fit: the platform's default
    old = {k: v for k, v in two.items() if not k.startswith("all_gather")}
    assert CostModel.from_fits(old, platform="cpu").all_gather == DEFAULT_ALL_GATHER["cpu"]
    assert "default, not measured" in CostModel.default("gpu").describe_all_gather()


PROFILE_4 = r"""
import json
from kvoffload.plan.profiler import model_shape, run_profile
prof = run_profile(model_shape("tiny-opt"), 1, "float32", quick=True, progress=None, sizes_mb=(0.05, 0.2),
                   tokens=(8,), contexts=(16,), tensor_parallel=4)
print("PROFILE " + json.dumps({k: prof[k] for k in ("tensor_parallel", "fits", "raw")}))
"""


@pytest.mark.slow  # 9 s: a subprocess with 4 virtual devices
def test_profiler_measures_the_all_gather_on_a_mesh():
    """On 4 virtual CPU devices (meaningless speeds, the path a GPU mesh takes): transfers per device with
    every device moving at once, and the all-gather of X, fitted and recorded with its mesh size."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")}
    out = subprocess.run([sys.executable, "-c", PROFILE_4], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    prof = json.loads(next(line[8:] for line in out.stdout.splitlines() if line.startswith("PROFILE ")))
    assert prof["tensor_parallel"] == 4 and prof["fits"]["all_gather_devices"] == 4
    # the points: bytes each device receives, 3/4 of the X block (tiny-opt h = 64, fp32)
    received = [p[0] for p in prof["raw"]["all_gather"]]
    assert received == [int(mb * 1e6 / 256) * 256 * 3 / 4 for mb in (0.05, 0.2)]
    assert prof["fits"]["all_gather"][1] > 0 and [p[0] for p in prof["raw"]["h2d"]] == [50000, 200000]


@pytest.mark.slow  # 40 s: bench_tp.py's whole path on 4 virtual CPU devices
def test_bench_tp_reports_the_split_and_its_prediction(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_tp.py")
    out = subprocess.run([sys.executable, script, "--tp", "1,2", "--workloads", "tiny_row", "--policies", "kvpr",
                          "--dtype", "float32", "--bw-mb", "1", "--bw-repeats", "1", "--warmup", "1", "--steps", "2",
                          "--sweep-splits", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "bench_tp.json").read_text())
    auto = [r for r in res["runs"] if "split_point" not in r]
    assert [r["tp"] for r in auto] == [1, 2] and all("error" not in r for r in res["runs"]), res["runs"]
    for r in auto:
        assert r["predicted_step_s"] > 0 and r["predicted_over_measured"] > 0 and r["profile"].endswith(f"_tp{r['tp']}.json")
        assert set(r["sweep"]) == {str(k) for k in range(r["used_extents"] + 1)} and "measured_best_split" in r
    assert res["profiles"][auto[1]["profile"]]["all_gather_devices"] == 2
    assert "chose" in out.stdout and "all-gather" in out.stdout
    assert all(r["links_cap_vs_1"] > 0 and r["transfer_floor_s"] > 0 for r in auto), auto
    assert "the host's links cap" in out.stdout and "transfer floor" in out.stdout


@pytest.mark.slow  # 40 s: bench_tp.py --processes, 2 processes of one CPU device each (gloo)
def test_bench_tp_runs_one_process_per_device(tmp_path):
    """--processes: N=2 as two processes under jax.distributed (each one device), N=1 as one; the parent joins
    process 0's rows with the speed-up against the 1-process row; it refuses to profile across processes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_tp.py")
    args = [sys.executable, script, "--processes", "--tp", "1,2", "--workloads", "tiny_row", "--policies", "kvpr",
            "--dtype", "float32", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]
    refused = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--profile DIR" in refused.stderr, refused.stderr[-2000:]
    out = subprocess.run(args + ["--profile", "none"], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "bench_tp.json").read_text())
    rows = [(r["tp"], r["processes"]) for r in res["runs"]]
    assert rows == [(1, 1), (2, 2)] and all("error" not in r for r in res["runs"]), res["runs"]
    two = res["runs"][1]
    assert two["speedup_vs_1"] == pytest.approx(two["tokens_per_s"] / res["runs"][0]["tokens_per_s"])
    assert two["used_extents"] > 0 and (tmp_path / "processes_2" / "process_1.log").exists()
    assert "2 process(es)" in out.stdout


def test_plot_tp_speedups_join_files_and_cap(tmp_path):
    """benchmarks/plot_tp.py: speed-ups against the 1-GPU row of the same (workload, policy) found in any file,
    forced-split sweep rows left out, and the bandwidth cap N * (GB/s per GPU with N busy) / (1 GPU's)."""
    import json

    from script_loader import script_module

    one = {"device": "X", "bandwidth": [{"gpus": 1, "per_gpu_gb_s": 50.0}, {"gpus": 4, "per_gpu_gb_s": 40.0}],
           "runs": [{"workload": "w", "policy": "offload", "tp": 1, "tokens_per_s": 100.0},
                    {"workload": "w", "policy": "kvpr", "tp": 1, "tokens_per_s": 150.0},
                    {"workload": "w", "policy": "kvpr", "tp": 1, "split_point": 0, "tokens_per_s": 90.0}]}
    two = {"device": "X", "bandwidth": [],
           "runs": [{"workload": "w", "policy": "offload", "tp": 4, "tokens_per_s": 310.0},
                    {"workload": "w", "policy": "kvpr", "tp": 4, "tokens_per_s": 240.0},
                    {"workload": "v", "policy": "offload", "tp": 4, "tokens_per_s": 1.0}]}  # no 1-GPU row: left out
    paths = []
    for i, res in enumerate((one, two)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(res))
    with script_module("plot_tp") as plot:
        curves = plot.speedups([one, two])
        assert curves == {("w", "offload"): [(1, 1.0), (4, 3.1)], ("w", "kvpr"): [(1, 1.0), (4, 1.6)]}
        assert plot.bandwidth_cap([two, one]) == [(1, 1.0), (4, 3.2)]
        # the best measured split: only where every GPU count was swept (kvpr at 4 was not)
        assert plot.best_split_speedups([one, two]) == {}
        two["runs"].append({"workload": "w", "policy": "kvpr", "tp": 4, "split_point": 8, "tokens_per_s": 300.0})
        assert plot.best_split_speedups([one, two]) == {("w", "kvpr"): [(1, 1.0), (4, 2.0)]}
        paths[1].write_text(json.dumps(two))
        out = tmp_path / "tp.png"
        assert plot.main([str(p) for p in paths] + ["--out", str(out)]) == 0 and out.stat().st_size > 10_000


def test_bench_tp_rows_carry_the_links_cap_and_transfer_floor():
    """bench_tp.link_terms: a row on N GPUs gets N x rate(N) / rate(1) (the speed-up a step bound by its bytes can
    reach on this host) and its step's transfer floor (bytes per GPU at the N-link rate); nothing without probes
    (the --processes children) or without a plan."""
    from script_loader import script_module

    probes = [{"gpus": 1, "per_gpu_gb_s": 52.3}, {"gpus": 4, "per_gpu_gb_s": 38.2}]
    with script_module("bench_tp") as bt:
        four = bt.link_terms({"tp": 4, "plan": {"bytes_h2d": 52.2e9}}, probes)
        assert four["links_cap_vs_1"] == pytest.approx(4 * 38.2 / 52.3)
        assert four["transfer_floor_s"] == pytest.approx(52.2e9 / 4 / 38.2e9)
        assert bt.link_terms({"tp": 1, "plan": {"bytes_h2d": 8.6e9}}, probes) == {
            "links_cap_vs_1": 1.0, "transfer_floor_s": pytest.approx(8.6e9 / 52.3e9)}
        assert bt.link_terms({"tp": 2, "plan": {"bytes_h2d": 1e9}}, probes) == {}
        assert bt.link_terms({"tp": 4}, []) == {}
