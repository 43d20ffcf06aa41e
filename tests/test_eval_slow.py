"""The harness on the embedded SmolLM2-135M-Instruct (CPU is fine; minutes to tens of minutes).

Run with ``python -m pytest -m slow tests/test_eval_slow.py``. Numbers measured on the dev box
are recorded in BENCHMARKS.md, section "Accuracy: development set".
"""

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    from kvoffload.models import load_model

    return load_model(None, quiet=True)


def test_niah_single_1_4k_full(smollm, tmp_path):
    from kvoffload.eval import run_ruler

    res = run_ruler(smollm, tasks=["niah_single_1"], lengths=[4096], num_samples=20, policies="full",
                    out_dir=tmp_path, plot=False)
    (row,) = [r for r in res.summary if r["task"] == "niah_single_1"]
    assert row["n"] == 20 and row["score"] >= 90.0, res.table


def test_ruler_suite_4k_table(smollm, tmp_path):
    from kvoffload.eval import run_ruler
    from kvoffload.eval.ruler import RULER_TASKS

    res = run_ruler(smollm, lengths=[4096], num_samples=1, policies="full", out_dir=tmp_path)
    assert not res.errors
    for task in RULER_TASKS + ("average",):
        assert f"| {task} | 4096 |" in res.table or f"| **{task}** | 4096 |" in res.table
    assert (tmp_path / "ruler_plot.png").exists()


def test_perplexity_essays_far_below_random(smollm, tmp_path):
    from kvoffload.eval import run_perplexity

    res = run_perplexity(smollm, lengths=[2048], texts=["essays", "random"], policies="full", out_dir=tmp_path)
    ppl = {r["task"]: r["score"] for r in res.summary}
    assert ppl["essays"] < 100, ppl
    assert ppl["random"] > 50 * ppl["essays"], ppl
