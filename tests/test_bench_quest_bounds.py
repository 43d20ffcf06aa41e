"""experiments/bench_quest_bounds.py on a small shape: every form timed for bf16 and int8 pages, and every form's
bounds equal the f32 form's to the bf16 query's rounding."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))


def test_quest_bound_forms_agree_and_are_timed(tmp_path):
    import bench_quest_bounds

    res = bench_quest_bounds.main(["--layers", "2", "--blocks", "8", "--kv-heads", "2", "--heads", "4",
                                   "--head-dim", "16", "--repeats", "1", "--out", str(tmp_path / "q.json")])
    from kvoffload.pallas.common import on_gpu

    kernel_forms = 3 if on_gpu() else 1  # the kernel's row tiles timed: three on a GPU, one interpreted here
    assert len(res["ms"]) == 2 * (4 + kernel_forms) and all(v > 0 for v in res["ms"].values()), res
    assert all(v < 1e-2 for v in res["max_rel_diff"].values()), res["max_rel_diff"]
    assert res["max_rel_diff"]["XLA per block, f32 HIGHEST | int8"] == 0.0
    assert (tmp_path / "q.json").exists()
