"""`kvoffload profile` and `kvoffload bench` (the lead wires them into kvoffload.cli)."""

from __future__ import annotations

import argparse
import os
import sys

from kvoffload.errors import ArgumentRangeError, KVOffloadError, check_range
from kvoffload.paths import check_output_dir, check_output_file


def profile_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvoffload profile", description=(
        "Measure host<->GPU bandwidth over transfer sizes, recompute matmul rate, attention and MLP time per "
        "layer at the planned batch; fit the cost model; write a JSON profile for --profile."))
    ap.add_argument("--model-shape", default=None,
                    help="opt-6.7b, opt-13b, llama-3-8b, tiny-opt, or an HF config.json / checkpoint directory "
                         "(default: opt-6.7b on GPU, tiny-opt on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="planned batch per GPU batch (default 64 on GPU, 4 on CPU)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", default="kvoffload_profile.json", help="where the JSON profile goes")
    ap.add_argument("--sizes-mb", default=None, help="transfer sizes in MB, comma separated")
    ap.add_argument("--tokens", default=None, help="recompute token counts T, comma separated")
    ap.add_argument("--contexts", default=None, help="attention context lengths, comma separated")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="profile one device of an N-device mesh: transfers with every link busy, its heads' "
                         "compute, and the collectives between devices (default 1)")
    args = ap.parse_args(argv)
    if args.batch is not None:
        check_range("--batch", args.batch, 1, integer=True)  # 0 must not fall back to the default batch
    check_range("--tensor-parallel", args.tensor_parallel, 1, integer=True)
    check_output_file(args.out)  # before minutes of measuring

    def nums(s, cast):
        try:
            vals = tuple(cast(v) for v in s.split(",")) if s else None
        except ValueError:
            raise ArgumentRangeError(f"a list of numbers, comma separated, is needed; got {s!r}") from None
        for v in vals or ():
            check_range("each size / count", v, 0, low_open=True)
        return vals

    from kvoffload.device import memory as M
    from kvoffload.plan.profiler import model_shape, run_profile, write_profile

    cpu = M.default_device().platform == "cpu"
    try:
        cfg = model_shape(args.model_shape or ("tiny-opt" if cpu else "opt-6.7b"))
    except (FileNotFoundError, ValueError) as e:
        print(f"kvoffload profile: {e}", file=sys.stderr)
        return 2
    batch = args.batch or (4 if cpu else 64)
    dtype = "float32" if cpu and args.dtype == "bfloat16" else args.dtype  # CPUs have no fast bf16 matmul
    prof = run_profile(cfg, batch, dtype, quick=args.quick, sizes_mb=nums(args.sizes_mb, float),
                       tokens=nums(args.tokens, int), contexts=nums(args.contexts, int),
                       tensor_parallel=args.tensor_parallel)
    import dataclasses

    from kvoffload.provenance import make_provenance

    prof["provenance"] = make_provenance(
        same={"model_shape": dataclasses.asdict(cfg), "batch": batch, "dtype": dtype,
              "tensor_parallel": args.tensor_parallel},
        info={"quick": args.quick, "sizes_mb": args.sizes_mb, "tokens": args.tokens, "contexts": args.contexts})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # checked writable at the start
    write_profile(prof, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


class BenchWorkloadError(KVOffloadError, ValueError):
    """A benchmark workload that is unknown or cannot run on this machine."""


def check_bench_workloads(argv, platform: str):
    """Refuses, before anything is built, workloads unknown or sized for a GPU when the machine has none
    (OPT-6.7B at batch 64 would take hours of CPU time and more host memory than most machines hold)."""
    from kvoffload.offload.bench import QUICK_WORKLOADS, _workloads, build_parser

    args, _ = build_parser().parse_known_args(argv)
    # before anything runs: --steps -1 would time no step and print a table of NaN
    for flag, low in (("--steps", 1), ("--warmup", 0), ("--hf-steps", 1), ("--sync-depth", 0), ("--back-to-back", 0)):
        check_range(flag, getattr(args, flag[2:].replace("-", "_")), low, integer=True)
    if args.out is not None:
        check_output_dir(args.out)
    known = _workloads(args.quick)
    names = args.workloads.split(",") if args.workloads else (
        QUICK_WORKLOADS if args.quick else [n for n in known if not n.startswith("tiny")])
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchWorkloadError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(known)}")
    big = [n for n in names if not known[n]["shape"].startswith("tiny")]
    if platform == "cpu" and big:
        sizes = ", ".join(f"{n} ({known[n]['shape']} batch {known[n]['batch']})" for n in big)
        raise BenchWorkloadError(f"no GPU found, and the workloads {sizes} are sized for one; run "
                                 "`kvoffload bench --workloads tiny` for a CPU run of the same path, or run on a GPU")


def bench_main(argv=None) -> int:
    from kvoffload.device import memory as M
    from kvoffload.offload.bench import main

    check_bench_workloads(argv, M.default_device().platform)
    return main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(profile_main(sys.argv[1:]))
