"""RULER niah_single_1/2 past the model's trained positions with tokenselect extrapolate=True.
The eval runner refuses lengths over max_position_embeddings (rightly, for every other policy),
so this script builds the samples with kvoffload.eval.ruler and generates through the engine itself.

  python benchmarks/ruler_extrapolation.py --lengths 16384,32768 --num-samples 20 --out ruler_extrapolation.json
(embedded SmolLM2, 8K positions; a GPU run). --model picks another checkpoint.
"""

from __future__ import annotations

import argparse
import json
import time

from kvoffload.engine import generate
from kvoffload.eval import ruler
from kvoffload.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--tasks", default="niah_single_1,niah_single_2")
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--num-samples", type=int, default=20)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--num-sink", type=int, default=128)  # the paper's n_init
    p.add_argument("--num-recent", type=int, default=512)  # the paper's n_local
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="ruler_extrapolation.json")
    a = p.parse_args(argv)
    model = load_model(a.model, dtype=a.dtype, quiet=True)
    opts = dict(extrapolate=True, token_budget=a.token_budget, num_sink=a.num_sink, num_recent=a.num_recent,
                prefill_chunk=a.prefill_chunk)
    rows, t0 = [], time.time()

    def write(rows):
        result = {"model": a.model or "embedded SmolLM2", "max_position_embeddings": model.config.max_position_embeddings,
                  "policy": "tokenselect", "options": opts, "results": rows, "seconds": round(time.time() - t0, 1)}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        return result

    result = write(rows)
    for L in [int(x) for x in a.lengths.split(",")]:
        for task in a.tasks.split(","):
            scores = []
            for s in ruler.generate_samples(model.tokenizer, task, L, a.num_samples):
                out = generate(model, [s.prompt_ids], s.max_new_tokens, policy="tokenselect", policy_options=opts)[0]
                scores.append(ruler.score_sample(s.metric, model.tokenizer.decode(out), s.outputs))
            rows.append({"task": task, "length": L, "samples": len(scores),
                         "score": sum(scores) / max(1, len(scores))})
            print(json.dumps(rows[-1]), flush=True)
            result = write(rows)  # after every row: a run cut short keeps what it scored
    return result


if __name__ == "__main__":
    main()
