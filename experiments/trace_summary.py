#!/usr/bin/env python
"""Summarise a jax.profiler trace (.xplane.pb): per GPU stream, busy time and what ran; the gaps of the
host->GPU copy stream and what the compute stream and the Python thread did meanwhile.

    python experiments/trace_summary.py trace_act-only.xplane.pb [--events events.json]

Why: a step that moves B bytes over PCIe should take B / bandwidth when transfers overlap compute; the
copy stream's idle gaps say where they did not, and the other lines say why (compute not yet issued,
the host blocked, a dependency). `--events` writes every event (plane, line, name, start, duration,
bytes) as compact JSON for further analysis on a machine without the GPU.
"""

import argparse
import json
import re
import sys
from collections import defaultdict


def load_events(path: str) -> list[dict]:
    import jax

    pd = jax.profiler.ProfileData.from_file(path)
    out = []
    for plane in pd.planes:
        if plane.name == "/host:metadata":
            continue
        for line in plane.lines:
            for e in line.events:
                stats = {}
                for k, v in e.stats:
                    if k in ("bytes_transferred", "memcpy_details", "hlo_module", "hlo_op", "name", "correlation_id",
                             "kernel_details", "long_name"):
                        stats[k] = v if isinstance(v, (int, float)) else str(v)[:200]
                out.append({"plane": plane.name, "line": line.name, "name": e.name[:200], "t": e.start_ns,
                            "d": e.duration_ns, **stats})
    return out


def _memcpy_bytes(e) -> int:
    m = re.search(r"size:(\d+)", str(e.get("memcpy_details", "")))
    return int(m.group(1)) if m else int(float(e.get("bytes_transferred", 0) or 0))


def union_ns(intervals) -> float:
    total, end = 0.0, None
    for s, d in sorted(intervals):
        e = s + d
        if end is None or s > end:
            total += d
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def gaps(intervals, min_ns: float):
    """Idle periods longer than min_ns between the first start and the last end."""
    out, end = [], None
    for s, d in sorted(intervals):
        if end is not None and s - end > min_ns:
            out.append((end, s - end))
        end = max(end or s + d, s + d)
    return out


def summarize(events: list[dict], min_gap_ms: float = 0.5) -> dict:
    by_line = defaultdict(list)
    for e in events:
        by_line[(e["plane"], e["line"])].append(e)
    gpu = {k: v for k, v in by_line.items() if "GPU" in k[0] or "gpu" in k[0]}
    if not gpu:
        return {"error": "no GPU plane in the trace"}
    t0 = min(e["t"] for v in gpu.values() for e in v)
    t1 = max(e["t"] + e["d"] for v in gpu.values() for e in v)
    res = {"span_ms": (t1 - t0) / 1e6, "lines": {}}
    for (plane, line), evs in sorted(gpu.items()):
        iv = [(e["t"], e["d"]) for e in evs]
        top = defaultdict(float)
        for e in evs:
            top[e["name"][:80]] += e["d"]
        nbytes = sum(_memcpy_bytes(e) for e in evs)
        busy = union_ns(iv)
        res["lines"][f"{plane} | {line}"] = {
            "events": len(evs), "busy_ms": busy / 1e6, "busy_frac": busy / max(t1 - t0, 1),
            "bytes_gb": nbytes / 1e9, "gb_per_s_busy": nbytes / busy if busy and nbytes else None,
            "top": sorted(((k, v / 1e6) for k, v in top.items()), key=lambda kv: -kv[1])[:8]}
    # the host->GPU copies (XLA may spread them over several streams): one timeline of their union
    copy_keys = [k for k in gpu if "MemcpyH2D" in k[1]]
    copy_iv = [(e["t"], e["d"]) for k in copy_keys for e in gpu[k] if e["d"] > 0]
    h2d_bytes = sum(_memcpy_bytes(e) for k in copy_keys for e in gpu[k])
    res["h2d"] = {"streams": len(copy_keys), "busy_ms": union_ns(copy_iv) / 1e6, "gb": h2d_bytes / 1e9,
                  "gb_per_s_busy": h2d_bytes / max(union_ns(copy_iv), 1), "gb_per_s_span": h2d_bytes / max(t1 - t0, 1)}
    gs = gaps(copy_iv, min_gap_ms * 1e6)
    compute_keys = [k for k in gpu if "Compute" in k[1]]
    py = [e for (p, l), v in by_line.items() if l == "python" for e in v]
    detail = []
    for s, d in sorted(gs, key=lambda g: -g[1])[:15]:
        clipped = [(max(e["t"], s), min(e["t"] + e["d"], s + d) - max(e["t"], s))
                   for k in compute_keys for e in gpu[k] if e["t"] < s + d and e["t"] + e["d"] > s]
        busy_compute = union_ns(clipped)
        host = sorted(((e["name"][:70], min(e["t"] + e["d"], s + d) - max(e["t"], s)) for e in py
                       if e["t"] < s + d and e["t"] + e["d"] > s and e["d"] > 0.2 * d), key=lambda x: -x[1])[:4]
        detail.append({"at_ms": (s - t0) / 1e6, "gap_ms": d / 1e6, "compute_busy_ms": busy_compute / 1e6,
                       "python": [(n, v / 1e6) for n, v in host]})
    res["copy_gaps"] = {"count": len(gs), "total_ms": sum(g[1] for g in gs) / 1e6, "largest": detail}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help=".xplane.pb (or an --events JSON written earlier)")
    ap.add_argument("--events", default=None, help="write every event as JSON here")
    ap.add_argument("--min-gap-ms", type=float, default=0.5)
    args = ap.parse_args(argv)
    if args.trace.endswith(".json"):
        with open(args.trace) as f:
            events = json.load(f)
    else:
        events = load_events(args.trace)
    if args.events:
        with open(args.events, "w") as f:
            json.dump(events, f, separators=(",", ":"))
    s = summarize(events, args.min_gap_ms)
    print(json.dumps(s, indent=1, default=str))
    return 0 if "error" not in s else 1


if __name__ == "__main__":
    sys.exit(main())
