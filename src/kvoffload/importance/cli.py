"""`kvoffload train-importance` and `kvoffload train-hata` (argparse front ends).

    kvoffload train-importance --model PATH --steps 500 --max-length 8192 --out runs/imp
    kvoffload train-importance --out runs/imp --evaluate --eval-samples 32   # + the 50/50 check
    kvoffload train-hata --model PATH --steps 300 --out runs/hata   # 256 bits, essay + RULER prompts

Both resume from --out when it holds a checkpoint of the same settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvoffload.errors import check_range
from kvoffload.paths import check_output_dir


def _add_common(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help="HF checkpoint dir, .gguf file or converted dir "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="parameter dtype (float32, bfloat16)")
    p.add_argument("--steps", type=int, required=False, default=None)
    p.add_argument("--out", required=True, help="output directory (checkpoints, scores)")
    p.add_argument("--text", default=None, help="haystack text file (default: RULER's essays)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--quiet", action="store_true")


def importance_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvoffload train-importance",
                                description="Learn per-head importance gates (DuoAttention-style).")
    _add_common(p)
    p.add_argument("--max-length", type=int, default=8192, help="longest sample (clipped to the context)")
    p.add_argument("--min-length", type=int, default=1024)
    p.add_argument("--pad-multiple", type=int, default=1024, help="padded lengths are multiples of this")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--granularity", choices=("kv", "query"), default="kv",
                   help="one gate per layer x KV head, or per layer x query head")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--l1", type=float, default=0.05)
    p.add_argument("--num-passkeys", type=int, default=3)
    p.add_argument("--words-per-key", type=int, default=3)
    p.add_argument("--evaluate", action="store_true",
                   help="after training: passkey accuracy with all heads full, the 50%% lowest-scoring "
                        "heads streaming, and the 50%% highest-scoring heads streaming (held-out samples)")
    p.add_argument("--eval-samples", type=int, default=24)
    p.add_argument("--eval-length", type=int, default=None, help="default: --max-length")
    p.add_argument("--eval-fraction", type=float, default=0.5)
    return p


def hata_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvoffload train-hata",
                                description="Learn HATA hash projections per layer and KV head.")
    _add_common(p)
    p.add_argument("--bits", type=int, default=None,
                   help="code bits, a multiple of 32 (default 256; clo needs the same hata_bits)")
    p.add_argument("--top-frac", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--scale", type=float, default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=2)
    p.add_argument("--prompt-length", type=int, default=2048)
    p.add_argument("--queries", type=int, default=64, help="query positions per prompt")
    p.add_argument("--data", choices=("essays", "ruler", "mixed"), default=None,
                   help="training prompts: essay windows (random query positions), RULER prompts + answers "
                        "(queries at the question / answer positions), or half of each (default: mixed)")
    p.add_argument("--ruler-tasks", default=None,
                   help="comma-separated RULER tasks for --data ruler/mixed (default: the niah tasks, vt, qa)")
    p.add_argument("--top-boost", type=float, default=None,
                   help="loss weight factor of each query's true top-1%% keys among its top-10%% positives")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out recall check")
    return p


def _load(args):
    from kvoffload.models import load_model

    return load_model(args.model, dtype=args.dtype, quiet=args.quiet)


def run_importance_check(model, alpha, *, data, samples: int, length: int, sink: int, recent: int,
                         fraction: float = 0.5, quiet: bool = False) -> dict:
    """Passkey accuracy: full / lowest `fraction` heads streaming / highest `fraction` streaming."""
    from kvoffload.plan.deploy import highest_mask, lowest_mask
    from kvoffload.importance.evaluate import passkey_accuracy

    cfg = model.config
    if alpha.shape[-1] == cfg.num_heads and cfg.num_heads != cfg.num_kv_heads:
        from kvoffload.plan.deploy import group_scores

        alpha = group_scores(alpha, cfg.group_size)
    out = {}
    for name, mask in (("full", None), ("lowest_streaming", lowest_mask(alpha, fraction)),
                       ("highest_streaming", highest_mask(alpha, fraction))):
        r = passkey_accuracy(model, data, mask, num_samples=samples, length=length, sink=sink, recent=recent)
        out[name] = {k: r[k] for k in ("accuracy", "correct", "questions", "token_accuracy",
                                        "answer_logprob", "seconds")}
        if not quiet:
            print(f"{name:18s} accuracy {r['accuracy']:.3f} ({r['correct']}/{r['questions']})  "
                  f"token accuracy {r['token_accuracy']:.3f}  answer log-prob {r['answer_logprob']:.3f}  "
                  f"{r['seconds']:.0f}s", file=sys.stderr, flush=True)
    return out


def train_importance_main(argv=None) -> int:
    args = importance_parser().parse_args(argv)
    from kvoffload.importance.data import PasskeyData, text_from_file
    from kvoffload.importance.train import TrainConfig, train_importance
    from kvoffload.plan.deploy import SCORES_JSON

    if args.steps is None or args.steps < 1:
        print("train-importance: --steps (>= 1) is required", file=sys.stderr)
        return 2
    try:  # the settings and the output folder are checked before the model loads
        tcfg = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, min_length=args.min_length, max_length=args.max_length,
            pad_multiple=args.pad_multiple, sink=args.sink, recent=args.recent, granularity=args.granularity,
            lr=args.lr, l1=args.l1, num_passkeys=args.num_passkeys, words_per_key=args.words_per_key,
            seed=args.seed, out_dir=args.out, text_path=args.text,
            checkpoint_every=args.checkpoint_every or max(1, args.steps // 10),
        )
        check_output_dir(args.out, "--out")
        if args.evaluate:
            check_range("--eval-samples", args.eval_samples, 1, integer=True)
            check_range("--eval-fraction", args.eval_fraction, 0, 1, low_open=True)
    except ValueError as e:
        print(f"train-importance: {e}", file=sys.stderr)
        return 2
    model = _load(args)
    if model.tokenizer is None:
        print("train-importance: the model has no tokenizer (needed for the passkey data)", file=sys.stderr)
        return 2
    text = text_from_file(args.text) if args.text else None
    data = PasskeyData(model.tokenizer, text, num_passkeys=args.num_passkeys,
                       words_per_key=args.words_per_key, seed=args.seed)
    try:
        res = train_importance(model, tcfg, data=data, quiet=args.quiet)
    except ValueError as e:
        print(f"train-importance: {e}", file=sys.stderr)
        return 2
    if args.evaluate:
        length = min(args.eval_length or args.max_length, model.config.max_position_embeddings)
        check = run_importance_check(model, res.alpha, data=data, samples=args.eval_samples, length=length,
                                     sink=args.sink, recent=args.recent, fraction=args.eval_fraction,
                                     quiet=args.quiet)
        path = os.path.join(args.out, SCORES_JSON)
        with open(path) as f:
            doc = json.load(f)
        doc["check"] = {"length": length, "samples": args.eval_samples, "fraction": args.eval_fraction, **check}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def train_hata_main(argv=None) -> int:
    args = hata_parser().parse_args(argv)
    from kvoffload.importance.hata import HataConfig, train_hata

    if args.steps is None or args.steps < 1:
        print("train-hata: --steps (>= 1) is required", file=sys.stderr)
        return 2
    kw = {}
    if args.lr is not None:
        kw["lr"] = args.lr
    if args.scale is not None:
        kw["scale"] = args.scale
    if args.bits is not None:
        kw["bits"] = args.bits
    if args.data is not None:
        kw["data"] = args.data
    if args.ruler_tasks:
        kw["ruler_tasks"] = tuple(t.strip() for t in args.ruler_tasks.split(",") if t.strip())
    if args.top_boost is not None:
        kw["top_boost"] = args.top_boost
    try:  # the settings and the output folder are checked before the model loads
        hcfg = HataConfig(
            top_frac=args.top_frac, steps=args.steps, momentum=args.momentum,
            num_prompts=args.prompts, eval_prompts=args.eval_prompts, prompt_length=args.prompt_length,
            queries_per_prompt=args.queries, seed=args.seed, out_dir=args.out, text_path=args.text,
            checkpoint_every=args.checkpoint_every or max(1, args.steps // 5), **kw,
        )
        check_output_dir(args.out, "--out")
    except ValueError as e:
        print(f"train-hata: {e}", file=sys.stderr)
        return 2
    model = _load(args)
    if model.tokenizer is None:
        print("train-hata: the model has no tokenizer (needed to build prompts)", file=sys.stderr)
        return 2
    try:
        train_hata(model, hcfg, evaluate=not args.no_eval, quiet=args.quiet)
    except ValueError as e:
        print(f"train-hata: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(train_importance_main())
