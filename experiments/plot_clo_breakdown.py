#!/usr/bin/env python
"""Plot of clo's per-layer latency breakdown (the CLO paper's Fig. 11) from
``bench_select_parts.py --clo-breakdown``'s JSON: one panel per miss pattern, one stacked horizontal bar per
configuration (retrieval, context, batch): retrieval / transfer / cache management / attention in
microseconds per layer. Marks on each bar: `full`'s attention of the same pool (red, its own shape's) and the
sum of the parts' floors (black: bytes over the bandwidths measured in the same run). With every head hitting
retrieval and transfer are 0 by construction (the library's lax.cond skips them), said in that panel's title.

    python experiments/plot_clo_breakdown.py $OUT/clo_breakdown.json --out $OUT/clo_breakdown.png
"""

import argparse
import json
import sys

PARTS = ("retrieval", "transfer", "cache_management", "attention")
COLORS = {"retrieval": "#4c72b0", "transfer": "#dd8452", "cache_management": "#55a868", "attention": "#8172b2"}
TITLES = {"all_miss": "every head misses", "one_head_misses": "one KV head per request misses",
          "all_hit": "every head hits (retrieval, transfer: 0 by construction)"}


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def label(run: dict) -> str:
    return (f"{run['retrieval']} {tokens(run['ctx'])} b{run['batch']} k={run['budget']}, "
            f"{run['missed_heads']}/{run['heads']} miss")


def panels(doc: dict) -> dict:
    """{pattern: [runs in the order measured]} of a --clo-breakdown JSON (its patterns in their order)."""
    if doc.get("mode") != "clo_breakdown":
        raise SystemExit("not a --clo-breakdown result of bench_select_parts.py (no mode 'clo_breakdown')")
    out = {}
    for run in doc["runs"]:
        out.setdefault(run["pattern"], []).append(run)
    return out


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_pattern = panels(doc)
    n = max(len(v) for v in by_pattern.values())
    fig, axes = plt.subplots(len(by_pattern), 1, figsize=(10, 1.2 + 0.45 * n * len(by_pattern)), squeeze=False)
    for ax, (pattern, runs) in zip(axes[:, 0], by_pattern.items()):
        ys = range(len(runs))
        left = [0.0] * len(runs)
        for part in PARTS:
            widths = [r["us"][part] for r in runs]
            ax.barh(ys, widths, left=left, color=COLORS[part], label=part.replace("_", " "), height=0.6)
            left = [a + b for a, b in zip(left, widths)]
        for y, r, total in zip(ys, runs, left):
            ax.text(total, y, f" {total:.0f}", va="center", fontsize=7)
            ax.plot([r["full_attention_us"]] * 2, [y - 0.4, y + 0.4], color="red", lw=2,
                    label="full's attention" if y == 0 else None)
            ax.plot([sum(r["floor_us"].values())] * 2, [y - 0.4, y + 0.4], color="black", lw=1, ls="--",
                    label="floor (sum of parts)" if y == 0 else None)
        ax.set_yticks(list(ys), [label(r) for r in runs], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(TITLES.get(pattern, pattern), fontsize=9)
        ax.set_xlabel("microseconds per layer", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlim(0, 1.12 * max(max(left), max(max(r["full_attention_us"], sum(r["floor_us"].values()))
                                                  for r in runs)))
    axes[0, 0].legend(fontsize=7, loc="lower right", ncol=3)
    fig.suptitle(f"clo attention per layer, by part ({doc.get('device', '?')}, jax {doc.get('jax', '?')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="bench_select_parts.py --clo-breakdown --out JSON")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        doc = json.load(f)
    plot(doc, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
