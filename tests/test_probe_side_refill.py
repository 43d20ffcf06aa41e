"""scripts/probe_side_refill.py --smoke: the one-launch matmul + host-row refill gives the stacked-linear kernel's
sums and the rows a NumPy gather gives, alone, in two launches and fused; every timing is reported."""

import json

import pytest
from script_loader import script_module


# the probe end to end on CPU (interpret mode, ~30 s); it is a GPU measurement: run with -m slow or on the GPU.
# Its programs take every array as an argument: the first GPU run closed over them and baked 3.9 GB of weights into
# the program as constants (minutes to compile); a captured constant over 4 KiB is an error here.
@pytest.mark.slow
@pytest.mark.filterwarnings("error:A large amount of constants")
def test_smoke_every_variant_exact_and_timed(tmp_path):
    import jax

    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 4096)
    try:
        with script_module("probe_side_refill") as mod:
            assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)
    rows = json.loads((tmp_path / "probe_side_refill.json").read_text())["rows"]
    assert [r["heads"] for r in rows] == [1, 2]
    for r in rows:
        for v in mod.VARIANTS:
            assert r[v + "_exact"] is True and r[v + "_us"] > 0
        assert r["fused_us"] == r["fused_" + r["fused_best"] + "_us"]
        assert r["saved_us"] == pytest.approx(r["serial_us"] - r["fused_us"], abs=0.011)
        assert r["overlap"] == pytest.approx(r["saved_us"] / min(r["matmul_us"], r["refill_us"]), abs=2e-3)
        assert r["matmul_programs"] > 0 and r["refill_programs"] == 2 * -(-r["rows_per_head"] // 64)  # 2 heads
        assert r["refill_MB"] == pytest.approx(r["heads"] * r["rows_per_head"] * r["row_bytes"] / 1e6)
    assert "| 2 |" in (tmp_path / "probe_side_refill.md").read_text()


def test_selection_pages_and_kept_heads():
    """The missed heads select whole pages of 32 tokens, ascending, distinct; the other heads keep (-1)."""
    import numpy as np

    with script_module("probe_side_refill") as mod:
        sel = mod.selection(np.random.default_rng(1), 4096, 2, 4, 384)
    assert sel.shape == (4, 384) and np.all(sel[2:] == -1)
    for h in range(2):
        assert np.all(np.diff(sel[h]) > 0) and np.all(sel[h].reshape(-1, 32) % 32 == np.arange(32))
