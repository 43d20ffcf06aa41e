#!/usr/bin/env python
"""Plot of benchmarks/bench_hybrid.py's JSON: decode throughput against the host ACT share (0 = KV-only,
1 = ACT-only), measured and predicted by the cost model, the `hybrid` policy's chosen point and
FlexGen's best decode throughput.

    python benchmarks/plot_hybrid.py results/bench_hybrid_opt-13b.json [--out plot.png]
"""

import argparse
import json
import os
import sys


def act_share(row) -> float | None:
    used = ((row.get("describe") or {}).get("hybrid") or {}).get("used_blocks") or {}
    n = used.get("act_host", 0) + used.get("kv_host", 0)
    return used.get("act_host", 0) / n if n else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as f:
        res = json.load(f)
    rows = [r for r in res["rows"] if "tok_s" in r and r.get("policy") == "hybrid"]
    sweep = sorted((act_share(r), r) for r in rows if r["name"] != "hybrid" and act_share(r) is not None)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [x for x, _ in sweep]
    ax.plot(xs, [r["predicted_tok_s"] for _, r in sweep], "--", color="tab:gray", label="cost model (predicted)")
    ax.plot(xs, [r["tok_s"] for _, r in sweep], "o-", color="tab:blue", label="measured (forced ACT share)")
    for x, r in sweep:
        ax.annotate(f"b={r['batch']}", (x, r["tok_s"]), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    hyb = next((r for r in rows if r["name"] == "hybrid"), None)
    if hyb is not None and act_share(hyb) is not None:
        ax.plot([act_share(hyb)], [hyb["tok_s"]], "*", ms=16, color="tab:red",
                label=f"hybrid's choice (b={hyb['batch']}, {hyb['tok_s']:.0f} tok/s)")
    fg = [r for r in (res.get("flexgen") or {}).get("results", []) if r.get("status") == "ok"]
    if fg:
        best = max(fg, key=lambda r: r["decode_throughput_tok_s"])
        ax.axhline(best["decode_throughput_tok_s"], color="tab:green", ls=":",
                   label=f"FlexGen best ({best['decode_throughput_tok_s']:.0f} tok/s)")
    kvpr = next((r for r in res["rows"] if r.get("name") == "kvpr" and "tok_s" in r), None)
    if kvpr:
        ax.axhline(kvpr["tok_s"], color="tab:purple", ls="-.", label=f"kvpr split ({kvpr['tok_s']:.0f} tok/s)")
    ax.set_xlabel("host ACT share of a request's host blocks (0 = KV-only, 1 = ACT-only)")
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_title(f"{res['model']}, P{res['prompt']} G{res['gen']}, GPU budget {res['gpu_budget_gb']:.0f} GB, "
                 f"{res['device']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=130)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
