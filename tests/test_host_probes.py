"""The host-cost experiment on the CPU: experiments/host_time.py (slow: the whole decode path on a tiny shape,
~10-20 s of compilation): the record it writes."""

import json

import pytest

from script_loader import script_module


@pytest.mark.slow
def test_host_time_splits_a_step_and_restores_what_it_timed(tmp_path):
    """offload on the tiny OPT shape: per step one layer program per layer, transfers issued for each (a host
    pool), host milliseconds per part below the step's; the timed functions are the originals afterwards."""
    import jax

    from kvoffload.runtime import layer as PL
    from kvoffload.runtime.pipeline import LayerPipeline

    before = (PL.layer_step, LayerPipeline.to_device, jax.block_until_ready)
    with script_module("host_time") as ht:
        rec = ht.main(["--shape", "tiny-opt", "--batch", "3", "--prompt", "40", "--policy", "offload", "--option",
                       "block_tokens=8", "--warmup", "1", "--steps", "2", "--out", str(tmp_path / "h.json")])
    assert (PL.layer_step, LayerPipeline.to_device, jax.block_until_ready) == before
    assert rec["calls_per_step"]["dispatch layer programs"] == 2  # tiny-opt: 2 layers, one GPU batch
    assert rec["calls_per_step"]["issue transfers"] >= 2
    parts = rec["host_ms_per_step"]
    assert 0 < parts["dispatch layer programs"] < rec["step_ms"] and 0 < parts["issue transfers"] < rec["step_ms"]
    assert rec["options"] == {"block_tokens": 8} and rec["used_extents"] >= 1
    # per step: the host's share (every program dispatched) within the step, the layer dispatch within that
    each = list(zip(rec["step_ms_each"], rec["issued_ms_each"], rec["dispatch_ms_each"]))
    assert len(each) == 2 and all(0 < d <= i <= s for s, i, d in each)
    assert [sorted(g) for g in rec["host_gauge"]] == [["dispatch_us", "python_loop_ns"]] * 2
    assert json.loads((tmp_path / "h.json").read_text())["step_ms"] == rec["step_ms"]
