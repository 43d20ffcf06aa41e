"""scripts/bench_selection.py (the selection policies' GPU speed benchmark, issues 11 and 12) end to end on
the CPU: --cpu-smoke (a tiny llama, 256-token context, one context the planner refuses), a subset of the
policies that covers every path of the script (device pool, whole-extent fetches, kv=split rows, clo's
counters); clo without layer 0 kept whole and without speculation, so one layer program compiles."""

import json

import pytest
from script_loader import script_module


@pytest.mark.slow  # 15 s on 2 cores; the script itself runs on the GPU
def test_cpu_smoke_runs_every_part_and_writes_results(tmp_path, capsys):
    out = tmp_path / "sel.json"
    with script_module("bench_selection") as bs:
        assert bs.main(["--cpu-smoke", "--out", str(out), "--policies", "clo_exact,offload,tokenselect_split,full",
                        "--option", "clo_exact:layer0_full=false",
                        "--option", "clo_exact:speculative_prefetch=false"]) == 0
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


@pytest.mark.parametrize("rate, layers, want", [("0.8", 4, 0.8), ("0.5,1", 3, [0.5, 0.75, 1.0]),
                                                ("0.1,0.2,0.3", 3, [0.1, 0.2, 0.3])])
def test_hit_rates_per_layer_resampled_over_depth(rate, layers, want):
    with script_module("bench_selection") as bs:
        got, note = bs.per_layer(bs.parse_rate(rate), layers)
    assert got == pytest.approx(want)
    assert (note is None) == (rate.count(",") + 1 in (1, layers))
