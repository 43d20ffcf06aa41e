"""Summary tables (Markdown, CSV, JSON) and the score-vs-context-length plot."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["summarize", "format_table", "format_selection_table", "write_report", "plot_scores", "load_records"]

_HIGHER_IS_BETTER = {"ruler": True, "longbench": True, "ppl": False}
AVERAGE = "average"


def load_records(path: str | os.PathLike) -> list[dict]:
    """Per-sample records of a ``*_results.jsonl`` file (error lines and cut lines skipped)."""
    out = []
    with open(path, "rb") as f:  # bytes: a line cut inside a UTF-8 character is skipped like any cut line
        for line in f:
            try:
                r = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(r, dict) and "error" not in r and "provenance" not in r:  # the first line: the run's provenance
                out.append(r)
    return out


def _ordered(values) -> list:
    return list(OrderedDict.fromkeys(values))


def summarize(records: Sequence[dict], benchmark: str) -> list[dict]:
    """Mean score per (task, length, policy), plus an ``average`` task per (length, policy)
    over the tasks (RULER, LongBench). Rows keep the order in which things first appear."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if "error" in r:
            continue
        groups[(r["task"], r["length"], r["policy"])].append(r)
    rows = []
    for (task, length, policy), rs in groups.items():
        scores = [float(r["score"]) for r in rs]
        row = {"task": task, "length": length, "policy": policy, "n": len(rs),
               "score": float(np.mean(scores)), "seconds": float(sum(r.get("seconds", 0.0) for r in rs))}
        row.update(_selection_means(rs))
        if benchmark == "ppl":
            tokens = sum(r["tokens"] for r in rs)
            nll = sum(r["nll"] * r["tokens"] for r in rs) / max(tokens, 1)
            row.update(score=math.exp(nll), nll=nll, tokens=tokens)
        rows.append(row)
    if benchmark != "ppl":
        tasks = _ordered(r["task"] for r in rows)
        if len(tasks) > 1:
            by_lp: dict[tuple, list[float]] = defaultdict(list)
            for row in rows:
                by_lp[(row["length"], row["policy"])].append(row["score"])
            for (length, policy), sc in by_lp.items():
                per_task = [r for r in rows if r["length"] == length and r["policy"] == policy and r["task"] != AVERAGE]
                avg = {"task": AVERAGE, "length": length, "policy": policy, "n": len(sc),
                       "score": float(np.mean(sc)), "seconds": float(sum(r["seconds"] for r in per_task)),
                       "tasks": len(sc)}
                for k in SELECTION_COLUMNS:  # the tasks' means, each task weighing the same (as the score)
                    vals = [r[k] for r in per_task if k in r]
                    if vals:
                        avg[k] = float(np.mean(vals))
                rows.append(avg)
    return rows


# the per-sample ``selection`` statistics (kvoffload.eval.generation.selection_stats) a summary row averages
SELECTION_COLUMNS = ("hit_rate", "guess_hit_rate", "bytes_fetched_per_step")


def _selection_means(records: Sequence[dict]) -> dict:
    """Means over the records of their ``selection`` statistics (each sample carries its batch's), for the
    ones some record has a value of; nothing for a policy that reports none."""
    out = {}
    for k in SELECTION_COLUMNS:
        vals = [r["selection"][k] for r in records if (r.get("selection") or {}).get(k) is not None]
        if vals:
            out[k] = float(np.mean(vals))
    return out


def _fmt(v: float, benchmark: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if benchmark == "ppl":
        return f"{v:.3g}" if v >= 1000 else f"{v:.2f}"
    return f"{v:.1f}"


def _pivot(summary: Sequence[dict]):
    policies = _ordered(r["policy"] for r in summary)
    tasks = _ordered(r["task"] for r in summary)
    keys = sorted(_ordered((r["task"], r["length"]) for r in summary),
                  key=lambda k: (k[0] == AVERAGE, tasks.index(k[0]), k[1]))
    cell = {(r["task"], r["length"], r["policy"]): r for r in summary}
    return policies, keys, cell


def format_table(summary: Sequence[dict], benchmark: str, baseline: str = "full") -> str:
    """Markdown table: one row per task and length, a column per policy, then each policy's
    difference from ``baseline`` (when the baseline was run)."""
    policies, keys, cell = _pivot(summary)
    others = [p for p in policies if p != baseline] if baseline in policies else []
    unit = "perplexity (lower is better)" if benchmark == "ppl" else "score, %"
    head = ["task", "length", "n"] + policies + [f"Δ {p}" for p in others]
    lines = [f"{benchmark} — {unit}", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 2)) + "|"]
    for task, length in keys:
        ns = [cell[(task, length, p)]["n"] for p in policies if (task, length, p) in cell]
        n = str(ns[0]) if ns and all(x == ns[0] for x in ns) else "/".join(map(str, ns))
        if task == AVERAGE:
            n = f"{ns[0]} tasks" if ns else "-"
        vals = [_fmt(cell[(task, length, p)]["score"], benchmark) if (task, length, p) in cell else "-"
                for p in policies]
        deltas = []
        for p in others:
            a, b = cell.get((task, length, p)), cell.get((task, length, baseline))
            d = round(a["score"] - b["score"], 2) + 0.0 if a and b else None  # + 0.0: no "-0.00"
            deltas.append("-" if d is None else f"{d:+.2f}")
        name = f"**{task}**" if task == AVERAGE else task
        lines.append("| " + " | ".join([name, str(length), n] + vals + deltas) + " |")
    hits = format_selection_table(summary)
    return "\n".join(lines) + ("\n\n" + hits if hits else "")


def format_selection_table(summary: Sequence[dict]) -> str:
    """Markdown table of the selection-cache statistics of the policies that report them (clo, tokenselect):
    per task and length, each such policy's mean hit rate, clo's guess hit rate (speculative prefetch) and
    the bytes gathered from the host per decode step, where present. "" when no policy reports them."""
    policies, keys, cell = _pivot(summary)
    titles = {"hit_rate": "hit %", "guess_hit_rate": "guess hit %", "bytes_fetched_per_step": "KiB/step"}
    cols = [(p, k) for p in policies for k in SELECTION_COLUMNS
            if any(k in r for r in summary if r["policy"] == p)]
    if not cols:
        return ""

    def fmt(r, k):
        if r is None or k not in r:
            return "-"
        return f"{r[k] / 1024:.1f}" if k == "bytes_fetched_per_step" else f"{100 * r[k]:.1f}"

    head = ["task", "length"] + [f"{titles[k]} {p}" for p, k in cols]
    lines = ["selection cache — hit rate (% of layer x KV-head looks that reused the cached selection), "
             "guess hit rate of speculative prefetch, KiB gathered from the host per decode step", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["--:"] * len(cols)) + "|"]
    for task, length in keys:
        name = f"**{task}**" if task == AVERAGE else task
        lines.append("| " + " | ".join([name, str(length)] + [fmt(cell.get((task, length, p)), k) for p, k in cols])
                     + " |")
    return "\n".join(lines)


def plot_scores(summary: Sequence[dict], benchmark: str, path: str | os.PathLike) -> str:
    """Score (perplexity for ``ppl``) against context length, a line per policy, a panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies, keys, cell = _pivot(summary)
    tasks = _ordered(t for t, _ in keys)
    if AVERAGE in tasks:  # the average first: it is what people look at
        tasks = [AVERAGE] + [t for t in tasks if t != AVERAGE]
    ncols = min(4, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    ylabel = "perplexity" if benchmark == "ppl" else "score (%)"
    for ax, task in zip(axes.flat, tasks):
        for p in policies:
            pts = sorted((L, cell[(t, L, p)]["score"]) for t, L in keys if t == task and (t, L, p) in cell)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        lengths = sorted({L for t, L in keys if t == task})
        if len(lengths) > 1 and lengths[-1] / lengths[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.set_xticklabels([f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        if benchmark != "ppl":
            ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if nrows == 1 else 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_report(out_dir: str | os.PathLike, benchmark: str, records: Sequence[dict], summary: Sequence[dict],
                 meta: dict | None = None, baseline: str = "full", plot: bool = True) -> dict[str, str]:
    """Writes ``{benchmark}_summary.{md,csv,json}`` and ``{benchmark}_plot.png``, and where the baseline and
    another policy ran, ``compare.{md,json,png}`` (each policy minus the baseline with a paired bootstrap interval,
    per task too); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"results": str(out / f"{benchmark}_results.jsonl")}
    table = format_table(summary, benchmark, baseline)
    md = out / f"{benchmark}_summary.md"
    extra = ""
    if meta:
        extra = "\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items() if k not in ("policies",))
    md.write_text(table + extra + "\n", encoding="utf-8")
    files["table"] = str(md)
    cs = out / f"{benchmark}_summary.csv"
    base = {(r["task"], r["length"]): r["score"] for r in summary if r["policy"] == baseline}
    with open(cs, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["task", "length", "policy", "n", "score", f"delta_vs_{baseline}", "seconds"])
        for r in summary:
            b = base.get((r["task"], r["length"]))
            w.writerow([r["task"], r["length"], r["policy"], r["n"], f"{r['score']:.4f}",
                        "" if b is None else f"{r['score'] - b:.4f}", f"{r['seconds']:.2f}"])
    files["csv"] = str(cs)
    js = out / f"{benchmark}_summary.json"
    payload = {"benchmark": benchmark, "baseline": baseline, "summary": list(summary), "meta": meta or {}}
    if benchmark == "longbench":
        payload["by_sample_length"] = _longbench_buckets(records)
    js.write_text(json.dumps(payload, indent=1, ensure_ascii=False, default=str), encoding="utf-8")
    files["json"] = str(js)
    if plot and summary:
        files["plot"] = plot_scores(summary, benchmark, out / f"{benchmark}_plot.png")
    policies = {r.get("policy") for r in records if "score" in r}
    # the deltas with paired intervals (`kvoffload eval compare`); not for perplexity (one window set a text)
    if benchmark != "ppl" and baseline in policies and len(policies) > 1:
        from .compare import CompareError, compare_records, write_comparison

        try:
            rows = compare_records(records, baseline=baseline)
        except CompareError:  # nothing pairs (e.g. every other policy failed on the baseline's samples)
            rows = None
        if rows:
            cmp = write_comparison(out, rows, per_task=True, plot=plot)
            files.update({f"compare_{k}": v for k, v in cmp.items()})
    return files


def _longbench_buckets(records: Sequence[dict]) -> list[dict]:
    """LongBench-E style scores by the sample's own length (0-4k, 4-8k, 8k+)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if "error" in r or "sample_length" not in r:
            continue
        n = r["sample_length"]
        b = "0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"
        groups[(r["task"], r["length"], r["policy"], b)].append(r["score"])
    return [{"task": t, "length": L, "policy": p, "bucket": b, "n": len(v), "score": float(np.mean(v))}
            for (t, L, p, b), v in groups.items()]
