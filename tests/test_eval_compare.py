"""``kvoffload eval compare``: deltas against the baseline on paired samples, the paired bootstrap interval
against hand-worked cases, and its refusals."""

import json

import numpy as np
import pytest

from kvoffload.eval import cli
from kvoffload.eval.compare import (CompareError, acceptance, compare_records, format_acceptance, format_comparison,
                                    short_labels)


def _rec(policy, task, length, index, score, sha=None, bench="ruler"):
    return dict(benchmark=bench, task=task, length=length, policy=policy, index=index, score=score,
                prompt_sha=sha or f"{task}-{length}-{index}")


def test_deltas_pair_samples_and_average_over_tasks():
    rng = np.random.default_rng(0)
    base = {("a", i): float(rng.integers(0, 101)) for i in range(20)} | {("b", i): float(rng.integers(0, 101))
                                                                         for i in range(10)}
    shift = {"a": 3.0, "b": -1.0}
    recs = [_rec("full", t, 4096, i, s) for (t, i), s in base.items()]
    recs += [_rec("clo", t, 4096, i, s + shift[t]) for (t, i), s in base.items()]
    recs += [_rec("clo", "a", 4096, 99, 50.0)]  # no baseline partner: left out, counted
    recs += [_rec("clo", "b", 4096, 3, 0.0, sha="another prompt")]  # same index, another prompt: not paired
    rows = compare_records(recs, draws=500)
    avg = next(r for r in rows if r["task"] == "average")
    # the average is the mean of the task means (the benchmark's own), not of the samples
    assert avg["delta"] == pytest.approx((3.0 - 1.0) / 2)
    assert avg["baseline_score"] == pytest.approx((np.mean([base["a", i] for i in range(20)])
                                                    + np.mean([base["b", i] for i in range(10)])) / 2)
    assert avg["samples"] == 30 and avg["tasks"] == 2 and avg["unpaired"] == 2
    # every paired delta of a task is the same: its interval has no width
    a = next(r for r in rows if r["task"] == "a")
    assert (a["lo"], a["delta"], a["hi"]) == pytest.approx((3.0, 3.0, 3.0))
    assert avg["lo"] == pytest.approx(1.0) and avg["hi"] == pytest.approx(1.0)
    table = format_comparison(rows)
    assert "| clo | ruler | - | - | 4096 | **average** (2 tasks) | 30 (2 unpaired left out) |" in table
    assert "| a |" not in table and "| a |" in format_comparison(rows, per_task=True)


def test_interval_is_the_paired_bootstrap_of_the_task_means():
    """One task, deltas of 0 and 10 half and half: the bootstrap mean of n draws is 10 * Binomial(n, 1/2) / n,
    so the 95% interval is 10 * (1/2 -+ 1.96 sqrt(1/4n)) within the draws' noise; two lengths stay apart."""
    n = 100
    recs = []
    for length in (4096, 7168):
        recs += [_rec("full", "t", length, i, 50.0) for i in range(n)]
        recs += [_rec("p", "t", length, i, 50.0 + (10.0 if i % 2 else 0.0) + (length == 7168)) for i in range(n)]
    rows = [r for r in compare_records(recs, draws=20000, seed=1) if r["task"] == "average"]
    assert [r["length"] for r in rows] == [4096, 7168]
    half = 10 * 1.96 * np.sqrt(0.25 / n)
    assert rows[0]["delta"] == pytest.approx(5.0) and rows[1]["delta"] == pytest.approx(6.0)
    assert rows[0]["lo"] == pytest.approx(5.0 - half, abs=0.25) and rows[0]["hi"] == pytest.approx(5.0 + half, abs=0.25)
    assert rows[1]["hi"] - rows[1]["lo"] == pytest.approx(2 * half, abs=0.4)


def test_refusals_name_the_problem(tmp_path, capsys):
    recs = [_rec("clo", "t", 4096, 0, 1.0)]
    with pytest.raises(CompareError, match=r"no records of the baseline policy 'full'.*\['clo'\]"):
        compare_records(recs)
    with pytest.raises(CompareError, match="no policy other than the baseline"):
        compare_records([_rec("full", "t", 4096, 0, 1.0)])
    with pytest.raises(CompareError, match="pairs with one of 'full'"):
        compare_records([_rec("full", "t", 4096, 0, 1.0), _rec("clo", "t", 8192, 0, 1.0)])
    assert cli.cli_main(["compare", str(tmp_path / "missing.jsonl")]) == 2
    assert "no results file" in capsys.readouterr().err


def test_cli_reads_result_files_and_writes_the_table(tmp_path, capsys):
    full, clo = tmp_path / "full_results.jsonl", tmp_path / "clo_results.jsonl"
    full.write_text("\n".join(json.dumps(_rec("full", "t", 4096, i, float(i))) for i in range(8)) + "\n")
    clo.write_text("\n".join(json.dumps(_rec("clo:topk=8", "t", 4096, i, float(i) + 2)) for i in range(8))
                   + '\n{"benchmark": "ruler", "policy": "clo:topk=8", "error": "a failed run"}\n')
    assert cli.cli_main(["compare", str(full), str(clo), "--out", str(tmp_path / "cmp"), "--draws", "200"]) == 0
    out = capsys.readouterr().out
    assert ("| clo:topk=8 | ruler | - | - | 4096 | **average** (1 task) | 8 | 3.50 | 5.50 | +2.00 | [+2.00, +2.00] |"
            in out)
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert rows[0]["delta"] == pytest.approx(2.0) and (tmp_path / "cmp" / "compare.md").exists()
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000


def test_plot_labels_keep_what_tells_the_policies_apart():
    labels = short_labels(["clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=native",
                           "clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=int8", "full"])
    assert labels == {"clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=native": "clo:retrieval=quest,topk_ratio=0.1,"
                      "int4_k_quant=native", "clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=int8":
                      "clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=int8", "full": "full"}
    labels = short_labels(["clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=native",
                           "clo:retrieval=quest,topk_ratio=0.1,int4_k_quant=int8"])
    assert set(labels.values()) == {"clo:int4_k_quant=native", "clo:int4_k_quant=int8"}


def test_seeds_and_templates_pair_apart_and_the_protocol_verdict():
    """Samples pair only within their template and seed (the same index of another seed is another prompt);
    rows are per template and name the seeds pooled; the verdict fails a length whose average is more than
    1 point down and a task more than 10 down with its interval below 0, and names them; one changed answer
    in nine (-11 points, its interval reaching 0) is not a failure."""
    recs = []
    for template in ("chat", "plain"):
        for seed in (1, 2):
            for i in range(4):
                for task, base in (("a", 60.0), ("b", 40.0)):
                    sha = f"{template}-{seed}-{task}-{i}"
                    recs.append(dict(_rec("full", task, 2048, i, base, sha=sha), seed=seed, template=template))
                    drop = {"chat": 0.5, "plain": 12.0 if task == "a" else 0.0}[template]
                    recs.append(dict(_rec("p", task, 2048, i, base - drop, sha=sha), seed=seed, template=template))
    rows = compare_records(recs, draws=200)
    avg = {r["template"]: r for r in rows if r["task"] == "average"}
    assert set(avg) == {"chat", "plain"} and all(r["seeds"] == [1, 2] and r["samples"] == 16 for r in avg.values())
    assert avg["chat"]["delta"] == pytest.approx(-0.5) and avg["plain"]["delta"] == pytest.approx(-6.0)
    verdict = {v["template"]: v for v in acceptance(rows)}
    assert verdict["chat"]["accepted"] and not verdict["plain"]["accepted"]
    assert verdict["plain"]["failures"][0] == "average -6.00 at 2048"
    assert verdict["plain"]["failures"][1].startswith("a -12.00 [-12.00, -12.00] at 2048")
    table = format_acceptance(acceptance(rows))
    assert "| p | ruler | chat | 1,2 | -0.50 | yes |" in table and "| p | ruler | plain | 1,2 | -6.00 | no: " in table
    flip = []
    for i in range(9):
        for task in ("a",) + tuple(f"t{j}" for j in range(11)):  # 12 tasks: one lost answer is -0.93 on average
            flip.append(_rec("full", task, 2048, i, 100.0, sha=f"{task}-{i}"))
            flip.append(_rec("p", task, 2048, i, 0.0 if (task, i) == ("a", 0) else 100.0, sha=f"{task}-{i}"))
    rows = compare_records(flip, draws=200)
    assert [r["delta"] for r in rows if r["task"] == "a"] == [pytest.approx(-100 / 9)]
    assert acceptance(rows)[0]["accepted"]
