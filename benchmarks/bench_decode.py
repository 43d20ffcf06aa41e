#!/usr/bin/env python
"""Decode benchmark of full / offload / kvpr vs the cost model and HF transformers (GPU, one call).

    python benchmarks/bench_decode.py            # all workloads
    python benchmarks/bench_decode.py --quick    # OPT-6.7B b64 ctx 512 + Llama-3-8B b32 ctx 1024

Prints a table last and writes bench_decode.json (and profiles) under $OUT (or --out). See
kvoffload/offload/bench.py for the method (per-step times at a few contexts, affine fit).
"""

import os
import sys

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from kvoffload.offload.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
