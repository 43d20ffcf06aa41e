#!/usr/bin/env python
"""Timeline plot of a per-step trace dumped by the `offload` / `kvpr` policies (option trace=PATH).

    python benchmarks/plot_trace.py trace.json --out trace.png

Top: per decode step, measured wall time beside the cost model's PCIe and GPU terms (the step costs
about their max). Bottom: bytes moved host->GPU per step (activations X, K/V, weights) and the split
point l (right axis).
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="trace JSON (policy option trace=PATH)")
    ap.add_argument("--out", default=None, help="PNG path (default: the trace path with .png)")
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        tr = json.load(f)
    steps = tr.get("steps") or []
    if not steps:
        print(f"{args.trace}: no steps recorded", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["step"] for r in steps]
    ms = lambda k: [(r.get(k) or 0) * 1e3 for r in steps]  # noqa: E731
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6))
    t0 = 0.0
    for r in steps:  # timeline: each step a bar from its start, as long as it took
        dur = (r.get("time_s") or r.get("predicted_s") or 0) * 1e3
        a1.broken_barh([(t0, dur)], (2, 0.8), facecolors="tab:blue" if r.get("time_s") else "lightgray", edgecolor="white")
        a1.broken_barh([(t0, r["predicted_transfer_s"] * 1e3)], (1, 0.8), facecolors="tab:orange", edgecolor="white")
        a1.broken_barh([(t0, r["predicted_gpu_s"] * 1e3)], (0, 0.8), facecolors="tab:green", edgecolor="white")
        t0 += dur
    a1.set_yticks([0.4, 1.4, 2.4], ["model: GPU", "model: PCIe", "measured step"])
    a1.set_xlabel("time (ms)")
    a1.set_title(f"{tr.get('policy', '?')} per-step timeline ({len(steps)} steps)")
    a2.bar(x, [r.get("bytes_x", 0) / 1e9 for r in steps], label="X (GB)", color="tab:purple")
    a2.bar(x, [r.get("bytes_kv", 0) / 1e9 for r in steps], bottom=[r.get("bytes_x", 0) / 1e9 for r in steps],
           label="K/V (GB)", color="tab:orange")
    a2.bar(x, [r.get("bytes_w", 0) / 1e9 for r in steps],
           bottom=[(r.get("bytes_x", 0) + r.get("bytes_kv", 0)) / 1e9 for r in steps], label="weights (GB)",
           color="tab:gray")
    a2.set_ylabel("host->GPU per step (GB)")
    a2.set_xlabel("decode step")
    b2 = a2.twinx()
    b2.plot(x, [r["split_point"] for r in steps], "k.-", label="split point l")
    b2.set_ylabel("split point l (slots)")
    a2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = args.out or args.trace.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out} (mean measured {sum(ms('time_s')) / max(1, sum(1 for r in steps if r.get('time_s'))):.1f} "
          f"ms/step)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
