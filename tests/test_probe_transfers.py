"""scripts/probe_transfers.py --smoke: every probe runs, reports numbers and moves data correctly."""

import json
import math

import pytest
from script_loader import script_module



# the probe script end to end on CPU (12 s); it is a GPU measurement: run with -m slow or on the GPU
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def probe_module():
    with script_module("probe_transfers") as mod:
        yield mod


@pytest.fixture(scope="module")
def smoke_report(probe_module, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe_transfers")
    assert probe_module.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads((out / "probe_transfers.json").read_text())
    report["_table"] = (out / "probe_transfers.md").read_text()
    return report


def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_every_probe_ran_with_numbers(probe_module, smoke_report):
    probes = smoke_report["probes"]
    assert set(probes) == set(probe_module.PROBES)
    for name, res in probes.items():
        assert "error" not in res and "skipped" not in res, (name, res.get("error") or res.get("skipped"))
        timed = [r for r in res["rows"] if "error" not in r]
        assert timed, name
        for r in timed:
            assert _finite(r.get("gbps")) and r["gbps"] > 0, (name, r)
            assert _finite(r.get("us_per_item")) and r["us_per_item"] > 0, (name, r)
            # every moved / written block arrived intact
            assert r.get("correct") is True, (name, r)
        assert f"| {name} |" in smoke_report["_table"]


def test_overlap_fields_are_numbers(smoke_report):
    for name in ("put_overlap", "pallas_gather", "write_jit_dus", "write_roundtrip", "bidirectional"):
        for r in smoke_report["probes"][name]["rows"]:
            if "error" in r:
                continue
            assert _finite(r["overlap_tc"]) and _finite(r["overlap_ct"]), (name, r)


def test_put_list_covers_every_block_size(probe_module, smoke_report):
    res = smoke_report["probes"]["put_list"]
    sizes = probe_module.SMOKE.list_block_bytes
    for kind in ("h2d_list", "h2d_dict", "d2h_list"):
        assert sorted(r["block_bytes"] for r in res["rows"] if r["case"].startswith(kind)) == sorted(sizes)
        assert _finite(res["fit"][kind]["us_per_array"])


def test_in_place_write_is_correct(smoke_report):
    (row,) = smoke_report["probes"]["write_jit_dus"]["rows"]
    assert row["compiles"] is True and row["correct"] is True
    assert row["out_memory_kind"] == "pinned_host"
    # the donated pool is consumed and (on CPU) its buffer is reused for the result
    assert row["input_deleted"] is True
    assert row["same_buffer"] is True and row["same_buffer_after_all"] is True


def test_refusals_are_recorded_as_text(smoke_report):
    take = [r for r in smoke_report["probes"]["xla_gather"]["rows"] if r["case"].startswith("jnp.take")]
    assert len(take) == 1
    # jnp.take of a pinned_host operand inside jit: refused, or it ran and was checked
    assert ("error" in take[0] and "memory" in take[0]["error"]) or take[0].get("correct") is True
