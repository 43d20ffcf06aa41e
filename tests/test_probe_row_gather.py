"""scripts/probe_row_gather.py --smoke: every probe runs on tiny pools, every gathered row matches and the int
refill kernel's buffers equal the gathers'; the layouts of the loop's host rows refill the same rows."""

import json

import pytest
from script_loader import script_module

# the probe script end to end on CPU (interpret mode, ~40 s); it is a GPU measurement: run with -m slow or on the GPU
pytestmark = pytest.mark.slow


def test_smoke_rows_match_and_every_form_reports(tmp_path):
    with script_module("probe_row_gather") as mod:
        assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
        forms = set(mod.FORMS)
    rows = json.loads((tmp_path / "probe_row_gather.json").read_text())["rows"]
    assert all(r["us"] > 0 and r["GBps"] > 0 for r in rows)
    assert all(r["exact"] is True for r in rows if r["probe"] != "refill" or "int" in r["form"])
    one = [r for r in rows if r["probe"] == "one"]
    assert {(r["dtype"], r["run"]) for r in one} == {(d, n) for d in ("bfloat16", "uint8") for n in (1, 32)}
    step = {r["form"]: r for r in rows if r["probe"] == "step"}
    assert set(step) == forms
    # split, scales and fused hold the same bytes a row, in six, four and one arrays
    assert step["split"]["row_bytes"] == step["scales"]["row_bytes"] == step["fused"]["row_bytes"] == 224
    assert step["bf16"]["row_bytes"] == 512
    assert [step[f]["arrays_per_layer"] for f in ("bf16", "split", "scales", "fused")] == [2, 6, 4, 1]
    assert "| step | fused | 224 |" in (tmp_path / "probe_row_gather.md").read_text()
    refill = {r["form"]: r for r in rows if r["probe"] == "refill"}
    assert set(refill) == {"bf16", "int8 K + int4 V, kernel", "int8 K + int4 V, gathers + where"}
    assert refill["bf16"]["row_bytes"] == 512 and refill["int8 K + int4 V, kernel"]["row_bytes"] == 224
    # the loop's host layouts: each layer's extents, one stacked extent, chunks of it; the same rows each way
    layout = {r["form"]: r for r in rows if r["probe"] == "layout"}
    assert set(layout) == {f"{k}, {n}" for k in ("K int8", "V int4")
                           for n in ("per-layer extents", "one stacked extent", "chunks")}
    assert layout["V int4, one stacked extent"]["extents"] == 1 < layout["V int4, chunks"]["extents"] <= 3
