#!/usr/bin/env python
"""Plot of a real decode step's per-layer latency by part (the CLO paper's Fig. 11, from the runtime's
own step rather than parts timed alone): ``bench_selection.py --trace DIR`` traces one step per run and splits
its device time by the runtime's named scopes (`kvoffload.profile`): retrieval, transfer, cache management,
attention, projections and MLP, other (copies, bookkeeping). One stacked horizontal bar per run: the mean
layer (every layer program's time over the model's layers). Also prints the table.

    python benchmarks/bench_selection.py ... --trace $OUT/tr --out $OUT/sel.json
    python benchmarks/plot_scope_breakdown.py $OUT/sel.json --out docs/step_breakdown.png
"""

import argparse
import json
import sys

PARTS = ("retrieval", "transfer", "cache management", "attention", "projections and MLP", "other", "unattributed")
COLORS = {"retrieval": "#4c72b0", "transfer": "#dd8452", "cache management": "#55a868", "attention": "#8172b2",
          "projections and MLP": "#937860", "other": "#bbbbbb", "unattributed": "#ff0000"}


def bars(doc: dict) -> list:
    """[(label, {part: us})] of the runs of a bench_selection JSON that carry a scope breakdown."""
    out = []
    for r in doc["runs"]:
        b = r.get("scope_breakdown")
        if not b:
            continue
        ctx = f"{r['context'] // 1024}K" if r["context"] % 1024 == 0 else str(r["context"])
        head = f"{r['variant']} {ctx} b{r['batch']}"
        out.append((f"{head}: mean layer", {p: 1e6 * s for p, s in b["per_layer"].items()}))
    return out


def table(rows) -> str:
    lines = ["| run | " + " | ".join(PARTS) + " | total us |", "|---|" + "--:|" * (len(PARTS) + 1)]
    for label, parts in rows:
        lines.append(f"| {label} | " + " | ".join(f"{parts.get(p, 0):.1f}" for p in PARTS)
                     + f" | {sum(parts.values()):.1f} |")
    return "\n".join(lines)


def plot(rows, path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.6))
    for y, (_, parts) in enumerate(rows):
        left = 0.0
        for p in PARTS:
            w = parts.get(p, 0.0)
            if w > 0:
                ax.barh(y, w, left=left, color=COLORS[p], label=p)  # the legend keeps one entry a part
                left += w
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("device time per layer (us), one traced decode step (mean layer: every layer program's time / "
                  "the model's layers)")
    ax.set_title(title)
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))  # one entry a part, in PARTS' order
    parts = [p for p in PARTS if p in handles]
    ax.legend([handles[p] for p in parts], parts, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="bench_selection.py's JSON of a run with --trace")
    ap.add_argument("--out", default="step_breakdown.png")
    args = ap.parse_args(argv)
    doc = json.load(open(args.result))
    rows = bars(doc)
    if not rows:
        print(f"{args.result}: no run with a scope breakdown (run bench_selection.py with --trace)", file=sys.stderr)
        return 1
    print(table(rows))
    meta = doc.get("meta", {})
    plot(rows, args.out, f"per-layer device time by part: {meta.get('device', '?')}, {meta.get('shape', '?')}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
