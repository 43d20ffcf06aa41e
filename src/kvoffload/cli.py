"""`kvoffload generate | convert | profile | bench | eval | train-importance | train-hata`."""

from __future__ import annotations

import argparse
import importlib
import sys
import time


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def _policy_options(args) -> dict:
    opts = {}
    for item in args.policy_option or []:
        if "=" not in item:
            raise SystemExit(f"--policy-option takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        opts[k.replace("-", "_")] = _parse_value(v)
    if args.schedule is not None:
        opts["schedule"] = args.schedule
    if args.offload_weights:
        opts["offload_weights"] = True
    if args.split_point is not None:
        opts["split_point"] = args.split_point
    if args.gpu_batches is not None:
        opts["gpu_batches"] = args.gpu_batches
    if args.trace is not None:
        opts["trace"] = args.trace
    if args.profile is not None:
        opts["profile"] = args.profile
    return opts


def cmd_generate(args) -> int:
    from kvoffload.engine import generate
    from kvoffload.models import load_model

    model = load_model(args.model, args.dtype)
    tok = model.tokenizer
    if tok is None:
        raise SystemExit(f"{args.model}: no tokenizer found beside the checkpoint; generate needs one")
    text = args.prompt
    if args.chat:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        if rendered is None:
            raise SystemExit("--chat: this model has no chat template")
        text = rendered
    ids = tok.encode(text, add_special_tokens=not args.chat)
    t0 = time.time()
    streamer = None
    if args.stream:
        from kvoffload.engine import TextStreamer, eos_token_ids

        if not args.chat:
            print(args.prompt, end="", flush=True)
        streamer = TextStreamer(tok, lambda piece: print(piece, end="", flush=True), eos_token_ids(model))
    out = generate(model, [ids] * args.batch, args.max_new_tokens, policy=args.policy,
                   policy_options=_policy_options(args), temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, on_token=streamer)
    dt = time.time() - t0
    if streamer is not None:
        streamer.finish()
        print()
    else:
        print(tok.decode(out[0]) if args.chat else args.prompt + tok.decode(out[0]))
    n = sum(len(o) for o in out)
    print(f"[{n} tokens in {dt:.2f}s incl. compilation; policy {args.policy}; prompt {len(ids)} tokens]",
          file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from kvoffload.models import load_model, save_converted

    t0 = time.time()
    model = load_model(args.src, args.dtype)
    save_converted(args.dst, model.config, model.params, model.tokenizer)
    print(f"wrote {args.dst} ({model.config.model_type}, {args.dtype}) in {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


# Subcommands whose argument parsing lives with their implementation: name -> (module, function).
_DELEGATED = {
    "profile": ("kvoffload.offload.cli", "profile_main", "measure the machine and write a JSON profile"),
    "bench": ("kvoffload.offload.cli", "bench_main", "decode benchmark of the KV policies"),
    "eval": ("kvoffload.eval", "cli_main", "accuracy evaluation: ruler | longbench | ppl"),
    "train-importance": ("kvoffload.importance.cli", "train_importance_main", "train head-importance scores"),
    "train-hata": ("kvoffload.importance.cli", "train_hata_main", "train HATA hash codes"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (default model: embedded SmolLM2-135M-Instruct)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF checkpoint dir, .gguf file or converted dir (default: embedded)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch", type=int, default=1, help="run the prompt as a batch of this size")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stream", action="store_true",
                   help="print the first sequence's text as it is decoded (reads the device every step)")
    g.add_argument("--policy", default="full", help="KV policy (see `kvoffload generate --list-policies`)")
    g.add_argument("--schedule", choices=["row", "column"], default=None)
    g.add_argument("--offload-weights", action="store_true", help="offload/kvpr: stream weights layer by layer")
    g.add_argument("--gpu-batches", type=int, default=None, help="offload/kvpr column schedule: GPU batches per step")
    g.add_argument("--split-point", type=int, default=None, help="kvpr: force the recompute split point l")
    g.add_argument("--profile", default=None, help="JSON profile written by `kvoffload profile`")
    g.add_argument("--trace", default=None, help="write a per-step trace (JSON) here")
    g.add_argument("--policy-option", action="append", metavar="KEY=VALUE", help="any other policy option")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint (HF dir or GGUF) to an orbax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.set_defaults(func=cmd_convert)

    sub.add_parser("policies", help="list the available KV policies").set_defaults(func=cmd_policies)
    for name, (_, _, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def cmd_policies(args) -> int:
    from kvoffload.policies import available_policies

    print("\n".join(available_policies()))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _DELEGATED:
        module, fn, _ = _DELEGATED[argv[0]]
        return int(getattr(importlib.import_module(module), fn)(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvoffload: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
