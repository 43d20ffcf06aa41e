#!/usr/bin/env python
"""Plot of benchmarks/bench_tp.py's JSON (one or several files, e.g. calls that ran different workloads or GPU
counts): decode speed-up against GPUs per (workload, policy), the ideal line, and the cap the measured host->GPU
bandwidth puts on a PCIe-bound policy (N x per-GPU GB/s with N links busy / one link's GB/s).

    python benchmarks/plot_tp.py results/b67/bench_tp.json results/b13/bench_tp.json --out docs/tp_scaling.png

A row's speed-up is against the 1-GPU row of the same workload and policy found in any of the files (the
scheduler's own split: forced-split sweep rows are left out); say in the caption when those came from different
machines. Where a file holds a forced-split sweep (`--sweep-splits`) at every GPU count of a (workload, policy),
a dashed curve gives the best measured split at each count against the best at 1 GPU.
"""

import argparse
import json
import os


def speedups(results: list[dict]) -> dict:
    """{(workload, policy): [(gpus, speed-up vs 1 GPU), ...]} over the files' rows (forced splits left out)."""
    rows = [r for res in results for r in res["runs"] if "split_point" not in r and r.get("tokens_per_s")]
    one = {(r["workload"], r["policy"]): r["tokens_per_s"] for r in rows if r["tp"] == 1}
    out = {}
    for r in sorted(rows, key=lambda r: r["tp"]):
        key = (r["workload"], r["policy"])
        if key in one:
            out.setdefault(key, []).append((r["tp"], r["tokens_per_s"] / one[key]))
    return out


def best_split_speedups(results: list[dict]) -> dict:
    """{(workload, policy): [(gpus, best throughput at any split / best at 1 GPU)]} where forced-split rows exist
    at every GPU count of that (workload, policy), the 1-GPU count included."""
    rows = [r for res in results for r in res["runs"] if r.get("tokens_per_s")]
    swept = {(r["workload"], r["policy"], r["tp"]) for r in rows if "split_point" in r}
    best: dict = {}
    for r in rows:
        key = (r["workload"], r["policy"], r["tp"])
        best[key] = max(best.get(key, 0.0), r["tokens_per_s"])
    out = {}
    for (wl, pol, n), tps in sorted(best.items(), key=lambda kv: kv[0][2]):
        counts = {k[2] for k in best if k[:2] == (wl, pol)}
        if 1 in counts and all((wl, pol, c) in swept for c in counts):
            out.setdefault((wl, pol), []).append((n, tps / best[(wl, pol, 1)]))
    return out


def bandwidth_cap(results: list[dict]) -> list[tuple[int, float]]:
    """[(gpus, cap)] from the first file with a 1-GPU bandwidth probe: N * (per-GPU GB/s with N busy) / (1 GPU's)."""
    for res in results:
        bw = {b["gpus"]: b["per_gpu_gb_s"] for b in res.get("bandwidth", [])}
        if 1 in bw:
            return [(n, n * bw[n] / bw[1]) for n in sorted(bw)]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = []
    for path in args.json:
        with open(path) as f:
            results.append(json.load(f))
    curves = speedups(results)
    if not curves:
        raise SystemExit(f"no (workload, policy) with a 1-GPU row in {args.json}")
    top = max(n for pts in curves.values() for n, _ in pts)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([1, top], [1, top], ":", color="tab:gray", label="linear")
    cap = bandwidth_cap(results)
    if cap:
        ax.plot([n for n, _ in cap], [c for _, c in cap], "--", color="black",
                label="host->GPU cap (measured, every link busy)")
    for (wl, pol), pts in sorted(curves.items()):
        ax.plot([n for n, _ in pts], [s for _, s in pts], "o-", label=f"{wl} {pol}")
        for n, s in pts[1:]:
            ax.annotate(f"{s:.2f}x", (n, s), textcoords="offset points", xytext=(6, -4), fontsize=7)
    for (wl, pol), pts in sorted(best_split_speedups(results).items()):
        ax.plot([n for n, _ in pts], [s for _, s in pts], "s--", label=f"{wl} {pol}, best measured split")
        for n, s in pts[1:]:
            ax.annotate(f"{s:.2f}x", (n, s), textcoords="offset points", xytext=(6, 4), fontsize=7)
    devices = sorted({res.get("device", "?") for res in results})
    ax.set_xticks(sorted({n for pts in curves.values() for n, _ in pts}))
    ax.set_xlabel("GPUs (tensor parallel)")
    ax.set_ylabel("decode throughput vs 1 GPU")
    ax.set_title(f"tensor-parallel decode scaling ({', '.join(devices)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
