"""benchmarks/bench_selection.py (the selection policies' GPU speed benchmark) end to end on
the CPU: --cpu-smoke (a tiny llama, 256-token context, one context the planner refuses), a subset of the
policies that covers every path of the script (device pool, whole-extent fetches, kv=split rows, clo's
counters); clo without layer 0 kept whole and without speculation, so one layer program compiles."""

import json
import os

import pytest
from script_loader import script_module


@pytest.mark.slow  # 15 s on 2 cores; the script itself runs on the GPU
def test_cpu_smoke_runs_every_part_and_writes_results(tmp_path, capsys):
    out = tmp_path / "sel.json"
    with script_module("bench_selection") as bs:
        assert bs.main(["--cpu-smoke", "--out", str(out), "--policies", "clo_exact,offload,tokenselect_split,full",
                        "--option", "clo_exact:layer0_full=false",
                        "--option", "clo_exact:speculative_prefetch=false", "--trace", str(tmp_path / "tr")]) == 0
    doc = json.loads(out.read_text())
    order = [(r["variant"], r["context"]) for r in doc["runs"]]
    # cheap first: the small context, and within it full < tokenselect < clo < offload
    assert order[:4] == [("full", 256), ("tokenselect_split", 256), ("clo_exact", 256), ("offload", 256)]
    runs = dict(zip(order, doc["runs"]))
    for v in ("full", "tokenselect_split", "clo_exact", "offload"):
        r = runs[v, 1 << 20]  # 1M tokens under the smoke's 0.5 GB: the planner's refusal, nothing run
        assert "refuses to start" in r["refused"] and "step_s" not in r and r["memory_plan"]["gpu_bytes"] > 0
        r = runs[v, 256]
        assert "error" not in r and "attention_error" not in r, r.get("error") or r.get("attention_error")
        assert r["step_s"] > 0 and len(r["step_times_s"]) == 1 and r["memory_plan"]["gpu_kv_bytes"] > 0
        assert r["flush_step_times_s"] == [] and r["step_s_without_flushes"] == r["step_s"]  # 1 step: no flush
        assert r["step_s_mean"] == r["step_s"]
        # one window of engine.SYNC_EVERY steps as engine.generate runs them (one device read)
        assert r["generate_window"] == 16 and len(r["generate_window_step_s"]) == 1 and r["generate_step_s"] > 0
        # the traced step by the runtime's named scopes: the mean layer's attention and projections
        b = r["scope_breakdown"]
        assert b["per_layer"]["attention"] > 0 and b["per_layer"]["projections and MLP"] > 0, b
        assert (b["per_layer"].get("retrieval", 0) > 0) == (v in ("clo_exact", "tokenselect_split")), b
        # the host's share of the step: dispatched before the step ended
        assert len(r["host_issued_s"]) == 1 and 0 < r["host_issued_s"][0] <= r["step_times_s"][0]
        assert r["host_slack_s"] == r["step_times_s"][0] - r["host_issued_s"][0]
        # the host's speed before and after the timed steps
        assert len(r["host_gauge"]) == 2 and all(g["dispatch_us"] > 0 and g["python_loop_ns"] > 0
                                                 for g in r["host_gauge"])
        a = r["attention"]
        assert a["replayed"]["s_per_call"] > 0 and a["floors"]["replayed"]["floor_s"] > 0
        assert a["method"] == ("calls" if v in ("tokenselect_split", "clo_exact") else "scan")
    # the replayed rates, and the two extremes of the microbenchmark (the cache is valid: nothing flushed)
    for v, rate in (("tokenselect_split", 0.8), ("clo_exact", 0.86)):
        r = runs[v, 256]
        assert r["replay_hit_rate"] == rate and r["options"]["replay_hit_rate"] == rate
        a = r["attention"]
        assert a["all_miss"]["hit_rate"] == 0.0 and a["all_miss"]["scored_fraction"] == 1.0
        assert a["all_hit"]["hit_rate"] == 1.0 and a["all_hit"]["scored_fraction"] == 0.0
        assert a["floors"]["all_miss"]["hbm_bytes"] > a["floors"]["all_hit"]["hbm_bytes"]
    assert runs["clo_exact", 256]["attention"]["all_miss"]["v_rows_fetched_per_call"] > 0
    assert runs["clo_exact", 256]["attention"]["all_hit"]["v_rows_fetched_per_call"] == 0
    # bytes: offload fetches the whole pool, kv=split reads the selected V rows, full nothing
    pool = runs["full", 256]["state_bytes"]
    assert runs["offload", 256]["bytes_h2d_per_step"] == pool["pool K (GPU)"] + pool["pool V (GPU)"]
    assert runs["tokenselect_split", 256]["bytes_rows_per_step"] > 0
    assert runs["full", 256]["bytes_h2d_per_step"] == 0
    # GPU KV memory: kv=split keeps V off the GPU
    split = runs["tokenselect_split", 256]["state_bytes"]
    assert "pool V (GPU)" not in split and split["gpu_kv_total"] < pool["gpu_kv_total"]
    table = capsys.readouterr().out
    assert "| policy | ctx |" in table and "REFUSED" in table and "| full | 256 | 1 |" in table


@pytest.mark.slow  # ~15 s on 2 cores
def test_cpu_smoke_quest_reads_pages_and_keeps_keys_on_the_host(tmp_path):
    out = tmp_path / "sel.json"
    opts = [o for v in ("clo_exact", "clo_quest") for o in ("--option", f"{v}:layer0_full=false",
                                                           "--option", f"{v}:speculative_prefetch=false")]
    with script_module("bench_selection") as bs:
        assert bs.main(["--cpu-smoke", "--out", str(out), "--policies", "clo_exact,clo_quest",
                        "--option", "clo_quest:quest_page_tokens=16", *opts]) == 0
    runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"] if r["context"] == 256}
    exact, quest = runs["clo_exact"], runs["clo_quest"]
    for r in (exact, quest):
        assert "error" not in r and "attention_error" not in r, r.get("error") or r.get("attention_error")
    # quest scores a min and a max key per 16-token page (1/8 of the keys' bytes), exact every key
    fl_e, fl_q = exact["attention"]["floors"]["all_miss"], quest["attention"]["floors"]["all_miss"]
    assert fl_q["hbm_bytes"] < fl_e["hbm_bytes"]
    # quest's keys live on the host (exact keeps them on the GPU), and a miss brings K rows with the V rows
    assert "pool K (GPU)" in exact["state_bytes"] and "pool K (GPU)" not in quest["state_bytes"]
    assert quest["state_bytes"]["gpu_kv_total"] < exact["state_bytes"]["gpu_kv_total"]
    row = 16 * 4  # the smoke model's head_dim x fp32
    assert fl_e["pcie_bytes"] == exact["attention"]["all_miss"]["v_rows_fetched_per_call"] * row > 0
    assert fl_q["pcie_bytes"] == 2 * quest["attention"]["all_miss"]["v_rows_fetched_per_call"] * row > 0


@pytest.mark.slow  # ~15 s on 2 cores
def test_cpu_smoke_int4_rows_count_their_stored_bytes(tmp_path):
    """host_dtype=int4: a gathered V row crosses PCIe as its codes and its groups' float32 step and min, and
    the benchmark's bytes say so (they counted the model's dtype before)."""
    out = tmp_path / "sel.json"
    with script_module("bench_selection") as bs:
        assert bs.main(["--cpu-smoke", "--out", str(out), "--policies", "clo_exact_int4",
                        "--option", "clo_exact_int4:layer0_full=false",
                        "--option", "clo_exact_int4:speculative_prefetch=false",
                        "--option", "clo_exact_int4:int4_group_size=8"]) == 0
    r = {x["variant"]: x for x in json.loads(out.read_text())["runs"] if x["context"] == 256}["clo_exact_int4"]
    assert "error" not in r and "attention_error" not in r, r.get("error") or r.get("attention_error")
    row = 16 // 2 + 8 * (16 // 8)  # head_dim 16: 8 bytes of codes, two groups' step and min
    a = r["attention"]
    assert a["floors"]["all_miss"]["pcie_bytes"] == a["all_miss"]["v_rows_fetched_per_call"] * row > 0


@pytest.mark.parametrize("rate, layers, want", [("0.8", 4, 0.8), ("0.5,1", 3, [0.5, 0.75, 1.0]),
                                                ("0.1,0.2,0.3", 3, [0.1, 0.2, 0.3])])
def test_hit_rates_per_layer_resampled_over_depth(rate, layers, want):
    with script_module("bench_selection") as bs:
        got, note = bs.per_layer(bs.parse_rate(rate), layers)
    assert got == pytest.approx(want)
    assert (note is None) == (rate.count(",") + 1 in (1, layers))


@pytest.mark.slow  # ~25 s on 2 cores (compilation of ~8 programs per shape); the script itself runs on the GPU
def test_clo_breakdown_smoke_writes_every_part_and_the_plot(tmp_path):
    out, png = tmp_path / "clo_breakdown.json", tmp_path / "clo_breakdown.png"
    with script_module("bench_select_parts") as bp:
        assert bp.main(["--clo-breakdown", "--smoke", "--out", str(out)]) == 0
        shapes, n_kv = bp.parse_runs(bp.SMOKE["runs"]), bp.SMOKE["n_kv"]
        patterns, parts = bp.PATTERNS, bp.PARTS
    doc = json.loads(out.read_text())
    assert doc["mode"] == "clo_breakdown" and doc["probes"]["hbm_bytes_per_s"] > 0
    runs = {(r["ctx"], r["batch"], r["retrieval"], r["pattern"]): r for r in doc["runs"]}
    assert len(runs) == len(doc["runs"]) == len(shapes) * 2 * len(patterns)
    for ctx, batch, budget in shapes:
        for retrieval in ("exact", "hata"):
            rows = {p: runs[ctx, batch, retrieval, p] for p in patterns}
            assert [rows[p]["missed_heads"] for p in patterns] == [batch * n_kv, batch, 0]
            for p, r in rows.items():
                assert r["budget"] == budget and r["full_attention_us"] > 0 and r["full_attention_floor_us"] > 0
                assert r["us"]["attention"] > 0 and r["us"]["cache_management"] > 0
                skipped = ["retrieval", "transfer"] if p == "all_hit" else []
                assert r["not_run"] == skipped
                for part in parts:  # measured where run, 0 (and no floor) where the lax.cond skips the part
                    assert (r["us"][part] > 0) == (part not in skipped) == (r["floor_us"][part] > 0), (p, part)
            # the hit heads' rows do not move: one head of n_kv moves 1/n_kv of every head's rows
            moved = [rows[p]["pcie_bytes"]["transfer"] for p in patterns]
            assert moved[0] == n_kv * moved[1] > 0 and moved[2] == 0
            # exact: the hit heads' keys are not scored
            if retrieval == "exact":
                scored = [rows[p]["hbm_bytes"]["retrieval"] for p in patterns]
                assert scored[0] == n_kv * scored[1] > 0 and scored[2] == 0
        # hata moves K rows from the host beside V
        assert runs[ctx, batch, "hata", "all_miss"]["pcie_bytes"]["transfer"] == \
            2 * runs[ctx, batch, "exact", "all_miss"]["pcie_bytes"]["transfer"]
    with script_module("plot_clo_breakdown") as plot:
        assert plot.main([str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_clo_breakdown_plot_refuses_other_results(tmp_path):
    other = tmp_path / "select_parts.json"
    other.write_text(json.dumps({"device": "cpu", "runs": [{"ctx": 512, "us": {"exact": 1.0}}]}))
    with script_module("plot_clo_breakdown") as plot, pytest.raises(SystemExit, match="clo-breakdown"):
        plot.main([str(other), "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_random_kv_prefill_takes_the_pipelines_layer_prefill_arguments():
    """The benchmark swaps the pipeline's `_layer_prefill` for random K/V; the stand-in must take the same
    arguments (a GPU run once failed when the pipeline grew `attention_impl`). Checked by calling it through
    the pipeline's own call shape on a tiny layer."""
    import inspect

    from kvoffload.runtime import prefill as pipeline
    from _common import random_kv_prefill

    want = list(inspect.signature(pipeline._layer_prefill).parameters)
    with random_kv_prefill():
        got = list(inspect.signature(pipeline._layer_prefill).parameters)
        assert pipeline._layer_prefill.__name__ == "committed"  # swapped in
    assert pipeline._layer_prefill.__name__ == "_layer_prefill"  # restored
    assert got == want


@pytest.mark.slow  # 15 s: every kernel of the sweep in interpret mode
def test_selection_kernel_sweep_smoke_times_and_checks_every_kernel(tmp_path):
    """experiments/sweep_selection_kernels.py --smoke: the select, scores and refill sweeps run on tiny shapes
    (interpret mode), every variant's result is checked (the select against the sort, the scores against the
    reference) and the JSON holds one row per variant."""
    with script_module("sweep_selection_kernels") as sweep:
        rows = sweep.main(["--smoke", "--calls", "2", "--reps", "1", "--out", str(tmp_path / "s.json")])
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["results"] == rows and data["meta"]["calls_per_jit"] == 2
    kinds = [r["kind"] for r in rows]
    assert kinds.count("select") == 8 and kinds.count("scores") == 4 and kinds.count("refill") == 2
    assert all(r["equals_sort"] for r in rows if "equals_sort" in r)
    assert all(r["matches_reference"] for r in rows if r["kind"] == "scores")
    assert all(r["us_per_call"] > 0 for r in rows)


def test_trace_folders_are_fresh_per_run(tmp_path):
    """Two runs of one variant traced into one --trace folder get two folders (not one with both traces)."""
    with script_module("bench_selection") as bs:
        first = bs.fresh_dir(str(tmp_path / "clo_quest_131072_1"))
        os.makedirs(first)
        second = bs.fresh_dir(str(tmp_path / "clo_quest_131072_1"))
        os.makedirs(second)
        third = bs.fresh_dir(str(tmp_path / "clo_quest_131072_1"))
    assert [os.path.basename(p) for p in (first, second, third)] == [
        "clo_quest_131072_1", "clo_quest_131072_1_2", "clo_quest_131072_1_3"]


@pytest.mark.parametrize("host_dtype, k_quant, v_row, k_row", [
    ("native", "token", 128 * 2, 128 * 2),
    ("int4", "token", 64 + 2 * 8, 64 + 2 * 8),  # codes + a float32 step and min per group of 64
    ("int4", "native", 64 + 2 * 8, 128 * 2),  # K rows in the model's dtype
    ("int4", "int8", 64 + 2 * 8, 128 + 2 * 8),  # K rows of int8 codes
])
def test_host_row_bytes_count_k_and_v_as_stored(host_dtype, k_quant, v_row, k_row):
    """The bytes of a gathered V row and K row (d 128, bf16) as the host pool stores them
    (`LayerPipeline.host_row_bytes`: the benchmark's PCIe bytes and clo's bytes fetched)."""
    from kvoffload.policies import make_policy

    pol = make_policy("clo", retrieval="quest", host_dtype=host_dtype, int4_k_quant=k_quant)
    assert pol.pipeline.host_row_bytes(128, 2) == v_row
    assert pol.pipeline.host_row_bytes(128, 2, key=True) == k_row


def test_table_rows_have_the_header_columns_and_the_flush_notes():
    """The printed table: one cell per header column in measured and refused rows; a run's mean (steady
    flushes in) beside its median; its timed flush steps in the note."""
    base = {"context": 131072, "batch": 1, "replay_hit_rate": None, "state_bytes": {"gpu_kv_total": 2e9}}
    runs = [dict(base, variant="full", step_s=0.014, step_s_mean=0.0145, flush_step_times_s=[0.0536]),
            dict(base, variant="clo_quest", step_s=0.0164, step_s_mean=0.0181, replay_hit_rate=0.86,
                 flush_step_times_s=[0.933, 0.204], hit_rate_timed_steps=0.85),
            dict(base, variant="offload", refused="the planner refuses to start")]
    doc = {"meta": {"device": "gpu", "jax": "x", "shape": "llama-3-8b", "dtype": "bfloat16",
                    "probes": {"hbm_bytes_per_s": 2e12}}, "runs": runs}
    with script_module("bench_selection") as bs:
        lines = bs.table(doc).splitlines()
    rows = [line for line in lines if line.startswith("|")]
    assert len({line.count("|") for line in rows}) == 1, rows
    assert "| clo_quest | 128K | 1 | 0.86 | 16.40 | 1.17 | 18.10 |" in rows[3]
    assert "flush steps 933.0, 204.0 ms" in rows[3] and "REFUSED" in rows[4]
