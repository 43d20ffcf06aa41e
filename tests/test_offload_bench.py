"""The decode benchmark's whole path on a tiny shape (CPU; slow: pytest -m slow)."""

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
