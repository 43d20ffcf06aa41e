"""The decode benchmark's whole path on a tiny shape (CPU; slow: pytest -m slow), and the benchmarks' --option parser."""

import json

import pytest


@pytest.mark.slow
def test_bench_tiny(tmp_path, capsys):
    from kvoffload.offload.cli import bench_main

    assert bench_main(["--workloads", "tiny,tiny_row", "--dtype", "float32", "--no-hf", "--steps", "2",
                       "--out", str(tmp_path), "--trace"]) == 0
    res = json.loads((tmp_path / "bench_decode.json").read_text())
    rows = res["workloads"]["tiny"]["rows"] + res["workloads"]["tiny_row"]["rows"]
    assert not [r for r in rows if "error" in r]
    assert {r["policy"] for r in rows} == {"full", "offload", "kvpr"}
    assert "kvpr/off" in capsys.readouterr().out


def test_parse_options_takes_json_values_else_strings():
    """The benchmarks' --option KEY=VALUE (bench_tp, bench_long_context, bench_act_select): JSON values, other
    text kept as a string, a pair without '=' refused by name."""
    from script_loader import script_module

    with script_module("_common") as common:
        parse_options = common.parse_options

    assert parse_options(["extent_mb=256", "host_dtype=int4", "layer0_full=false", "split=[1, 2]"]) == {
        "extent_mb": 256, "host_dtype": "int4", "layer0_full": False, "split": [1, 2]}
    with pytest.raises(SystemExit, match="key=value, got 'extent_mb'"):
        parse_options(["extent_mb"])
