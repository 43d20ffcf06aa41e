"""``kvoffload eval compare``: a policy's score against a baseline's on the same samples, with a paired bootstrap
interval: what a run of 20 samples a task can and cannot tell apart.

Records are the per-sample lines of ``*_results.jsonl`` files (RULER, LongBench, perplexity), from one run or
several (each policy may come from its own run). A policy's sample is paired with the baseline's sample of the
same benchmark, task, length, prompt template, seed and index whose prompt hash is the same. Per (benchmark,
template, length) the score is the mean over tasks of each task's mean (the benchmarks' own average; a task's
samples of every seed pooled), and the interval resamples the paired samples within each task (with
replacement, the tasks kept), so it is the spread of that average's difference over samples like these.
`acceptance` applies the evaluation protocol (docs/EVALUATION.md) to the rows.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections import defaultdict
from typing import Sequence

import numpy as np

from kvoffload.errors import KVOffloadError

__all__ = ["CompareError", "compare_records", "acceptance", "format_acceptance", "format_comparison",
           "plot_comparison", "write_comparison"]


class CompareError(KVOffloadError, ValueError):
    """Results that cannot be compared (no baseline, nothing paired)."""


def _key(r: dict) -> tuple:
    return (r.get("benchmark"), r.get("task"), r.get("length"), r.get("template"), r.get("seed"), r.get("index"),
            r.get("prompt_sha"))


def compare_records(records: Sequence[dict], baseline: str = "full", draws: int = 5000, seed: int = 0,
                    level: float = 0.95) -> list[dict]:
    """One row per (policy, benchmark, length) and per task of it: tasks, paired samples, the baseline's and the
    policy's mean, delta = policy - baseline and its paired bootstrap interval [lo, hi] at `level`
    (the "average" row: mean over tasks; a task's row: that task alone). Samples without a partner are counted
    (unpaired) and left out."""
    by_policy: dict[str, dict] = defaultdict(dict)
    for r in records:
        if "score" in r and r.get("policy") is not None:
            by_policy[r["policy"]][_key(r)] = float(r["score"])
    if baseline not in by_policy:
        raise CompareError(f"no records of the baseline policy {baseline!r}; the results hold "
                           f"{sorted(by_policy) or 'no scored samples'}: pass --baseline with one of them")
    base = by_policy[baseline]
    rng = np.random.default_rng(seed)
    rows = []
    for policy, scores in by_policy.items():
        if policy == baseline:
            continue
        groups: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        seeds: dict[tuple, set] = defaultdict(set)
        unpaired = defaultdict(int)
        for k, s in scores.items():
            bench, task, length, template, seed = k[:5]
            if k in base:
                groups[(bench, template, length)][task].append((base[k], s))
                seeds[(bench, template, length)].add(seed)
            else:
                unpaired[(bench, template, length)] += 1
        for g, tasks in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2] or 0)):
            bench, template, length = g
            names = sorted(tasks)
            pairs = [np.asarray(tasks[t], np.float64) for t in names]  # per task [n, 2]: baseline, policy
            deltas = [p[:, 1] - p[:, 0] for p in pairs]
            boot = np.zeros((draws, len(names)))
            for j, d in enumerate(deltas):  # resample each task's paired samples
                boot[:, j] = d[rng.integers(0, len(d), (draws, len(d)))].mean(axis=1)
            lo_q, hi_q = (1 - level) / 2 * 100, (1 + level) / 2 * 100
            seed_list = sorted(x for x in seeds[g] if x is not None)

            def row(task, cols, n_tasks):
                b = np.mean([pairs[j][:, 0].mean() for j in cols])
                p = np.mean([pairs[j][:, 1].mean() for j in cols])
                lo, hi = np.percentile(boot[:, cols].mean(axis=1), [lo_q, hi_q])
                return dict(policy=policy, baseline=baseline, benchmark=bench, template=template, seeds=seed_list,
                            length=length, task=task, tasks=n_tasks,
                            samples=int(sum(len(pairs[j]) for j in cols)), baseline_score=float(b),
                            score=float(p), delta=float(p - b), lo=float(lo), hi=float(hi), level=level,
                            unpaired=int(unpaired[g]) if task == "average" else 0)

            rows.append(row("average", list(range(len(names))), len(names)))
            rows += [row(t, [j], 1) for j, t in enumerate(names)]
    if len(by_policy) == 1:
        raise CompareError(f"no policy other than the baseline {baseline!r} in the results: give the results of "
                           "the policies to compare too")
    if not rows:
        raise CompareError(f"no sample of {sorted(set(by_policy) - {baseline})} pairs with one of {baseline!r}'s "
                           "(same benchmark, task, length, index and prompt): were they run with the same seed "
                           "and lengths?")
    return rows


def acceptance(rows: Sequence[dict], tolerance: float = 1.0, task_tolerance: float = 10.0) -> list[dict]:
    """The evaluation protocol's verdict (docs/EVALUATION.md) per (policy, benchmark, template): accepted when the
    average's delta is >= -tolerance at every length and no task is both more than task_tolerance below and
    surely below (its interval's upper end < 0). The second condition keeps one changed answer in a small sample
    (9 samples: 11 points) from deciding a verdict; a task that loses several answers and gains none still fails.
    Each verdict lists what failed; the intervals are the rows' own."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["policy"], r["benchmark"], r.get("template"))
        v = out.setdefault(key, dict(policy=r["policy"], benchmark=r["benchmark"], template=r.get("template"),
                                     seeds=r.get("seeds", []), accepted=True, failures=[], worst_average=None))
        if r["task"] == "average":
            v["worst_average"] = r["delta"] if v["worst_average"] is None else min(v["worst_average"], r["delta"])
            if r["delta"] < -tolerance:
                v["failures"].append(f"average {r['delta']:+.2f} at {r['length']}")
        elif r["delta"] < -task_tolerance and r.get("hi", 0.0) < 0:
            v["failures"].append(f"{r['task']} {r['delta']:+.2f} [{r['lo']:+.2f}, {r['hi']:+.2f}] at {r['length']}")
    for v in out.values():
        v["accepted"] = not v["failures"]
    return list(out.values())


def format_acceptance(verdicts: Sequence[dict], tolerance: float = 1.0, task_tolerance: float = 10.0) -> str:
    lines = [f"| policy | benchmark | template | seeds | worst average delta | accepted (average >= -{tolerance:g} "
             f"at every length, no task below -{task_tolerance:g} with its interval below 0) |", "|---|---|---|---|--:|---|"]
    for v in verdicts:
        seeds = ",".join(map(str, v["seeds"])) or "-"
        verdict = "yes" if v["accepted"] else "no: " + "; ".join(v["failures"][:6]) + \
            (f" (+{len(v['failures']) - 6} more)" if len(v["failures"]) > 6 else "")
        worst = "-" if v["worst_average"] is None else f"{v['worst_average']:+.2f}"
        lines.append(f"| {v['policy']} | {v['benchmark']} | {v['template'] or '-'} | {seeds} | {worst} | {verdict} |")
    return "\n".join(lines)


def format_comparison(rows: Sequence[dict], per_task: bool = False) -> str:
    """A markdown table: per policy, benchmark, template and length the average's delta and interval (and with
    per_task each task's)."""
    level = rows[0]["level"] if rows else 0.95
    head = (f"| policy | benchmark | template | seeds | length | task | samples | "
            f"{rows[0]['baseline'] if rows else 'baseline'} | policy | delta | {level:.0%} interval |")
    lines = [head, "|---|---|---|---|--:|---|--:|--:|--:|--:|---|"]
    for r in rows:
        if r["task"] != "average" and not per_task:
            continue
        tasks = f"{r['tasks']} task{'s' if r['tasks'] != 1 else ''}"
        name = f"**{r['task']}** ({tasks})" if r["task"] == "average" else r["task"]
        note = f" ({r['unpaired']} unpaired left out)" if r.get("unpaired") else ""
        seeds = ",".join(map(str, r.get("seeds") or [])) or "-"
        lines.append(f"| {r['policy']} | {r['benchmark']} | {r.get('template') or '-'} | {seeds} | {r['length']} | "
                     f"{name} | {r['samples']}{note} | "
                     f"{r['baseline_score']:.2f} | {r['score']:.2f} | {r['delta']:+.2f} | "
                     f"[{r['lo']:+.2f}, {r['hi']:+.2f}] |")
    return "\n".join(lines)


def short_labels(policies: Sequence[str]) -> dict[str, str]:
    """Each policy label ("name:k=v,k=v") without the options every one of them shares: what tells them apart."""
    def opts(p):
        return p.split(":", 1)[1].split(",") if ":" in p else []

    shared = set.intersection(*(set(opts(p)) for p in policies)) if policies else set()
    out = {}
    for p in policies:
        rest = [o for o in opts(p) if o not in shared]
        out[p] = p.split(":", 1)[0] + (":" + ",".join(rest) if rest else "")
    return out


def plot_comparison(rows: Sequence[dict], path: str | os.PathLike, band: float | None = 1.0) -> str:
    """Each policy's average delta per benchmark and length with its interval (a forest plot), 0 marked, and
    +-band shaded (the protocol's "within 1 point", docs/EVALUATION.md)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    avg = [r for r in rows if r["task"] == "average"]
    short = short_labels(list(dict.fromkeys(r["policy"] for r in avg)))
    labels = [textwrap.fill(f"{short[r['policy']]}".replace(",", ", ") + f" | {r['benchmark']} "
                            f"{r.get('template') or ''} {r['length']}", 60,
                            break_on_hyphens=False) for r in avg]
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.2 * sum(1 + lb.count("\n") for lb in labels) + 0.2 * len(avg)))
    y = np.arange(len(avg))[::-1]
    ax.errorbar([r["delta"] for r in avg], y, xerr=[[r["delta"] - r["lo"] for r in avg],
                                                     [r["hi"] - r["delta"] for r in avg]], fmt="o", capsize=3)
    ax.axvline(0.0, color="black", lw=0.8)
    if band:
        ax.axvspan(-band, band, color="tab:green", alpha=0.08, label=f"within {band:g}")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    level = avg[0]["level"] if avg else 0.95
    ax.set_xlabel(f"score - {avg[0]['baseline'] if avg else 'baseline'} (points), {level:.0%} paired bootstrap")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(pad=1.5)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_comparison(out_dir: str | os.PathLike, rows: Sequence[dict], per_task: bool = False,
                     plot: bool = True) -> dict[str, str]:
    """compare.md, compare.json and (plot) compare.png in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, "compare.md"), os.path.join(out_dir, "compare.json")
    with open(md, "w", encoding="utf-8") as f:
        f.write(format_comparison(rows, per_task) + "\n\n" + format_acceptance(acceptance(rows)) + "\n")
    with open(js, "w", encoding="utf-8") as f:
        json.dump(list(rows), f, indent=1)
    files = {"markdown": md, "json": js}
    if plot:
        files["plot"] = plot_comparison(rows, os.path.join(out_dir, "compare.png"))
    return files
