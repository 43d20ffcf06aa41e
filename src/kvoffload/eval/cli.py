"""``kvoffload eval ruler|longbench|ppl``: argument parsing and dispatch.

The main CLI calls :func:`cli_main` with the arguments after ``eval``, or adds
:func:`add_eval_arguments` to its own ``eval`` sub-parser and calls
:func:`run_from_args` on the parsed namespace.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["add_eval_arguments", "run_from_args", "cli_main", "load_eval_model"]


def _common(p: argparse.ArgumentParser, default_lengths: str | None, lengths_help: str):
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct); "
                        "'tiny[:ARCH[:POSITIONS]]' for a tiny random-weight test model")
    p.add_argument("--dtype", default="float32", help="parameter dtype: float32, bfloat16, float16")
    p.add_argument("--policy", "--policies", dest="policy", action="append", default=None, metavar="P1,P2,...",
                   help="policies to compare, each as name or name:key=value,key=value (repeatable; "
                        "default: full). Any registered policy works: see `kvoffload.policies.available_policies()`")
    p.add_argument("--lengths", default=default_lengths, help=lengths_help)
    p.add_argument("--out", default=None, help="output directory (default: eval-out/<benchmark>)")
    p.add_argument("--baseline", default="full", help="policy label the differences are taken from (default: full)")
    p.add_argument("--resume", action="store_true", help="keep the results already in --out and skip those samples")
    p.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    p.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _gen(p: argparse.ArgumentParser):
    p.add_argument("--template", choices=("auto", "chat", "plain"), default=None,
                   help="prompt format: chat (the model's chat template around the task), plain (the task's own "
                        "template with its answer prefix, as for base models), auto (default: chat where the "
                        "model has a chat template). Accuracy is accepted in both (docs/EVALUATION.md)")
    p.add_argument("--chat-template", choices=("auto", "on", "off"), default=None,
                   help=argparse.SUPPRESS)  # the older spelling of --template: on = chat, off = plain
    p.add_argument("--batch-size", type=int, default=1, help="prompts per engine call (default 1)")


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``ruler`` / ``longbench`` / ``ppl`` sub-commands and their options to ``parser``."""
    from .longbench import LONGBENCH_DATASETS
    from .ruler import RULER_TASKS

    sub = parser.add_subparsers(dest="eval_benchmark", metavar="{ruler,longbench,ppl,compare}")
    sub.required = True

    r = sub.add_parser("ruler", help="RULER synthetic tasks (NVIDIA's generators) at given context lengths",
                       description="RULER: " + ", ".join(RULER_TASKS))
    _common(r, "4k", "context lengths in model tokens, prompt + answer (e.g. 4k,8k,16k; default 4k)")
    _gen(r)
    r.add_argument("--tasks", default="all", help="comma-separated RULER tasks, or 'all' (default)")
    r.add_argument("--num-samples", type=int, default=20, help="samples per task and length (default 20)")
    r.add_argument("--seeds", "--seed", dest="seeds", default="42", metavar="S1,S2,...",
                   help="RULER generator seeds, --num-samples per task, length and seed (default 42, RULER's own: "
                        "the development set; accept a configuration on seeds never used while tuning it, e.g. "
                        "--seeds 1,2,3: docs/EVALUATION.md)")
    r.add_argument("--save-inputs", action="store_true", help="also write the prompts to ruler_samples.jsonl")

    lb = sub.add_parser("longbench", help="LongBench from the official jsonl files in a local directory")
    _common(lb, None, "prompt token budgets, the prompt middle-truncated to each (default: the model's "
                      "positions minus the largest answer budget)")
    _gen(lb)
    lb.add_argument("--data-dir", required=True, help="directory holding {dataset}.jsonl (official LongBench data)")
    lb.add_argument("--datasets", default=None,
                    help="comma-separated datasets (default: every known one in --data-dir); known: "
                         + ",".join(LONGBENCH_DATASETS))
    lb.add_argument("--limit", type=int, default=None, help="first N samples per dataset")
    lb.add_argument("--e", "--longbench-e", dest="longbench_e", action="store_true",
                    help="LongBench-E: read {dataset}_e.jsonl")

    pp = sub.add_parser("ppl", help="sliding-window perplexity of a long text, per policy")
    _common(pp, "2048", "numbers of text tokens to score (default 2048)")
    pp.add_argument("--texts", default="essays",
                    help="comma-separated: essays (RULER's Paul Graham essays), random (uniform random "
                         "tokens, the baseline), file (--text-file). Default: essays")
    pp.add_argument("--text-file", default=None, help="a UTF-8 text file to score (with --texts file)")
    pp.add_argument("--window", type=int, default=None, help="tokens per window (default: min(length, positions))")
    pp.add_argument("--stride", type=int, default=None, help="step between windows (default: window/2)")
    pp.add_argument("--decode-tokens", type=int, default=None,
                    help="score only the last N tokens of each window (the rest is prefilled context)")
    pp.add_argument("--seed", type=int, default=0, help="seed of the random-token baseline")

    cp = sub.add_parser("compare", help="each policy's score minus the baseline's on the same samples, with a "
                                        "paired bootstrap interval, from results files of earlier runs")
    cp.add_argument("results", nargs="+", help="*_results.jsonl files (RULER, LongBench, ppl; one run or several)")
    cp.add_argument("--baseline", default="full", help="policy label the differences are taken from (default: full)")
    cp.add_argument("--per-task", action="store_true", help="a row per task too, not only the average")
    cp.add_argument("--draws", type=int, default=5000, help="bootstrap draws (default 5000)")
    cp.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    cp.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    cp.add_argument("--out", default=None, help="also write compare.md, compare.json and compare.png here")
    cp.add_argument("--no-plot", action="store_true", help="skip the plot (compare.png)")
    return parser


def compare_from_args(args: argparse.Namespace) -> int:
    """``kvoffload eval compare``: reads the results files and prints the comparison table."""
    from kvoffload.errors import USER_ERRORS, one_line

    from .compare import compare_records, format_comparison, write_comparison
    from .report import load_records

    try:
        if not 0 < args.level < 1 or args.draws < 1:
            raise ValueError(f"--level must be in (0, 1) and --draws >= 1, got {args.level}, {args.draws}")
        records = []
        for path in args.results:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no results file {path}")
            records += load_records(path)
        rows = compare_records(records, baseline=args.baseline, draws=args.draws, seed=args.seed, level=args.level)
    except USER_ERRORS as e:
        print(f"kvoffload eval compare: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(format_comparison(rows, args.per_task))
    if args.out:
        for k, v in write_comparison(args.out, rows, args.per_task, plot=not args.no_plot).items():
            print(f"{k}: {v}")
    return 0


def load_eval_model(spec: str | None, dtype: str = "float32"):
    """``None`` -> embedded default model; ``tiny[:arch[:positions]]`` -> tiny random model; else a path."""
    from kvoffload.models import load_model, tiny_random_model

    if spec is not None and (spec == "tiny" or spec.startswith("tiny:")):
        parts = spec.split(":")
        arch = parts[1] if len(parts) > 1 and parts[1] else "llama"
        over = {"max_position_embeddings": int(parts[2])} if len(parts) > 2 else {}
        return tiny_random_model(arch, seed=0, dtype=dtype, **over)
    return load_model(spec, dtype=dtype)


def run_from_args(args: argparse.Namespace) -> int:
    """Runs the benchmark a parsed namespace asks for; prints the summary table. Returns an exit code."""
    from kvoffload.errors import USER_ERRORS, one_line

    from . import parse, runner

    bench = args.eval_benchmark
    if bench == "compare":
        return compare_from_args(args)
    progress = None if args.quiet else sys.stderr
    if args.resume and args.overwrite:
        print(f"kvoffload eval {bench}: error: --resume keeps earlier results, --overwrite replaces them: "
              "choose one", file=sys.stderr)
        return 2
    try:
        specs = parse.parse_policies(args.policy or ["full"])
        lengths = parse.parse_lengths(args.lengths) if args.lengths else None
        if bench == "ruler":
            from .ruler import check_installed

            check_installed()  # NVIDIA's generators are installed (else: how to install them), before the model loads
        from kvoffload.paths import check_output_dir

        check_output_dir(args.out or f"eval-out/{bench}", "--out")  # before the model loads and the run
    except USER_ERRORS as e:
        print(f"kvoffload eval {bench}: error: {one_line(e)}", file=sys.stderr)
        return 2
    template = "auto"
    if bench in ("ruler", "longbench"):
        if args.template is not None and args.chat_template is not None:
            print(f"kvoffload eval {bench}: error: --template and --chat-template (its older spelling) set the same "
                  "thing: give --template alone", file=sys.stderr)
            return 2
        template = args.template or {"on": "chat", "off": "plain"}.get(args.chat_template, "auto")
    if bench == "ruler":
        try:
            seeds = parse.parse_seeds(args.seeds)
        except ValueError as e:
            print(f"kvoffload eval {bench}: error: --seeds: {e}", file=sys.stderr)
            return 2
    out = args.out or f"eval-out/{bench}"
    model = load_eval_model(args.model, args.dtype)
    try:
        model.name = args.model or "embedded SmolLM2-135M-Instruct"
    except AttributeError:  # pragma: no cover - a frozen model object
        pass
    common = dict(policies=specs, out_dir=out, resume=args.resume, overwrite=args.overwrite, progress=progress,
                  baseline=args.baseline, plot=not args.no_plot)
    try:
        if bench == "ruler":
            tasks = None if args.tasks in ("all", "", None) else [t.strip() for t in args.tasks.split(",") if t.strip()]
            res = runner.run_ruler(model, tasks=tasks, lengths=lengths or [4096], num_samples=args.num_samples,
                                   seed=seeds, template=template, batch_size=args.batch_size,
                                   save_inputs=args.save_inputs, **common)
        elif bench == "longbench":
            datasets = [d.strip() for d in args.datasets.split(",")] if args.datasets else None
            res = runner.run_longbench(model, data_dir=args.data_dir, datasets=datasets, lengths=lengths,
                                       limit=args.limit, longbench_e=args.longbench_e,
                                       template=template, batch_size=args.batch_size, **common)
        else:
            texts = [t.strip() for t in args.texts.split(",") if t.strip()]
            res = runner.run_perplexity(model, lengths=lengths or [2048], texts=texts, text_file=args.text_file,
                                        window=args.window, stride=args.stride, decode_tokens=args.decode_tokens,
                                        seed=args.seed, **common)
    except (*USER_ERRORS, KeyError) as e:
        print(f"kvoffload eval {bench}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(res.table)
    print()
    for k, v in res.files.items():
        print(f"{k}: {v}")
    if res.errors:
        print(f"\n{len(res.errors)} error(s):", *res.errors, sep="\n  ", file=sys.stderr)
        return 1
    return 0


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``kvoffload eval ...`` entry point: ``argv`` are the arguments after ``eval``."""
    parser = argparse.ArgumentParser(prog="kvoffload eval",
                                     description="Accuracy of KV policies: RULER, LongBench, perplexity; "
                                                 "compare: differences with intervals from results files")
    add_eval_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_from_args(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli_main())
