#!/usr/bin/env python
"""The recorded learned-components experiment: head-importance training + the 50/50 streaming check,
then HATA training + held-out recall. Each part resumes from its output directory.

    python benchmarks/train_importance.py --out runs/learned --preset cpu     # the BENCHMARKS.md CPU run
    python benchmarks/train_importance.py --out runs/learned --preset gpu     # longer, the library defaults

Presets (anything can be overridden by passing the option through after `--imp` / `--hata`):
  cpu: 40 steps, lengths 768-1024, window 64 sink + 128 recent; check on 24 held-out samples of 1024;
       HATA 100 steps on 6 prompts of 1024 tokens (32 queries each), held-out 2 prompts.
  gpu: 500 steps, lengths 1024-8192, window 128 + 256; check on 50 samples of 8192; HATA 300 steps on
       8 prompts of 4096 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PRESETS = {
    "cpu": dict(
        imp=["--steps", "40", "--min-length", "768", "--max-length", "1024", "--pad-multiple", "1024",
             "--sink", "64", "--recent", "128", "--checkpoint-every", "10", "--evaluate",
             "--eval-samples", "24", "--eval-length", "1024"],
        hata=["--steps", "100", "--prompts", "6", "--eval-prompts", "2", "--prompt-length", "1024",
              "--queries", "32", "--checkpoint-every", "50"],
    ),
    "gpu": dict(
        imp=["--steps", "500", "--min-length", "1024", "--max-length", "8192", "--pad-multiple", "1024",
             "--evaluate", "--eval-samples", "50", "--eval-length", "8192"],
        hata=["--steps", "300", "--prompts", "8", "--eval-prompts", "2", "--prompt-length", "4096",
              "--queries", "64"],
    ),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--model", default=None)
    p.add_argument("--skip-importance", action="store_true")
    p.add_argument("--skip-hata", action="store_true")
    p.add_argument("--imp", nargs=argparse.REMAINDER, default=[], help="extra train-importance options")
    args, rest = p.parse_known_args(argv)
    from kvoffload.importance.cli import train_hata_main, train_importance_main

    model = ["--model", args.model] if args.model else []
    pre = PRESETS[args.preset]
    t0 = time.time()
    if not args.skip_importance:
        rc = train_importance_main(pre["imp"] + model + ["--out", os.path.join(args.out, "importance")]
                                   + args.imp)
        if rc:
            return rc
        print(f"importance: {time.time() - t0:.0f}s", file=sys.stderr)
    if not args.skip_hata:
        t1 = time.time()
        rc = train_hata_main(pre["hata"] + model + ["--out", os.path.join(args.out, "hata")] + rest)
        if rc:
            return rc
        print(f"hata: {time.time() - t1:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
