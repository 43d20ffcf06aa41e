"""`kvoffload generate | serve | convert | profile | bench | eval | train-importance | train-hata`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from kvoffload.errors import USER_ERRORS, one_line
from kvoffload.policies.options import PolicyOptionError  # noqa: F401  (raised for the CLI's options; re-exported)


# the flag that sets each policy option in `kvoffload generate` (others come from --policy-option KEY=VALUE)
_OPTION_FLAGS = {"schedule": "--schedule", "offload_weights": "--offload-weights", "split_point": "--split-point",
                 "gpu_batches": "--gpu-batches", "profile": "--profile", "trace": "--trace",
                 "tensor_parallel": "--tensor-parallel"}


def _policy_options(args) -> tuple[list[tuple[str, object]], dict[str, str]]:
    """The policy options of `kvoffload generate` as (name, value) pairs in the order given (values as typed:
    the policy's schema parses them), and how the user spelled each. A flag and a --policy-option that set the
    same option are refused together: neither silently wins."""
    pairs, spelled = [], {}
    for item in args.policy_option or []:
        if "=" not in item:
            raise PolicyOptionError(f"--policy-option takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        pairs.append((k, v))
        spelled[k] = f"--policy-option {k}"
    for name, flag in _OPTION_FLAGS.items():
        value = getattr(args, name, None)
        if value is None or value is False:  # not given (--offload-weights is a store_true flag)
            continue
        if name in spelled:
            raise PolicyOptionError(f"{flag} and {spelled[name]} both set {name}; give one", name)
        pairs.append((name, value))
        spelled[name] = flag
    return pairs, spelled


def check_policy_options(name: str, options, flags: dict | None = None) -> dict:
    """The options (a dict or (name, value) pairs) parsed by policy `name`'s schema before any work: one
    PolicyOptionError naming an unknown, repeated or bad option. flags: how the user spelled each option."""
    from kvoffload.policies.base import check_options

    return check_options(name, options, flags)


def _check_int(value: int, flag: str, low: int, high: int | None = None):
    if value < low or (high is not None and value > high):
        rng = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{flag} must be {rng}, got {value}")


def cmd_generate(args) -> int:
    from kvoffload.engine import generate
    from kvoffload.models import default_model_dir, load_model

    _check_int(args.max_new_tokens, "--max-new-tokens", 1)
    _check_int(args.batch, "--batch", 1)
    _check_int(args.seed, "--seed", 0, 2**63 - 1)  # the PRNG key takes a 64-bit integer
    from kvoffload.policies import make_policy

    pairs, spelled = _policy_options(args)
    options = check_policy_options(args.policy, pairs, spelled)  # typed and checked before the model loads
    policy = make_policy(args.policy, **options)  # its own checks (the trace path too) before the model loads
    from kvoffload.models.tokenizer import check_text

    check_text(args.prompt, "the prompt")  # undecodable bytes in argv: one line, before the model loads
    model = load_model(args.model, args.dtype, quiet=args.quiet)
    tok = model.tokenizer
    if tok is None:
        raise FileNotFoundError(f"{args.model or default_model_dir()}: no tokenizer found beside the checkpoint "
                                "(tokenizer.json); generate needs one")
    text = args.prompt
    if args.chat:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        if rendered is None:
            raise ValueError("--chat: this model has no chat template")
        text = rendered
    ids = tok.encode(text, add_special_tokens=not args.chat)
    t0 = time.time()
    streamer = None
    if args.stream:
        from kvoffload.engine import TextStreamer, eos_token_ids

        if not args.chat:
            print(args.prompt, end="", flush=True)
        streamer = TextStreamer(tok, lambda piece: print(piece, end="", flush=True), eos_token_ids(model))
    out = generate(model, [ids] * args.batch, args.max_new_tokens, policy=policy, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, on_token=streamer)
    dt = time.time() - t0
    if streamer is not None:
        streamer.finish()
        print()
    else:
        print(tok.decode(out[0]) if args.chat else args.prompt + tok.decode(out[0]))
    n = sum(len(o) for o in out)
    if not args.quiet:
        print(f"[{n} tokens in {dt:.2f}s incl. compilation; policy {args.policy}; prompt {len(ids)} tokens]",
              file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from kvoffload.models import check_destination, load_model, save_converted

    t0 = time.time()
    check_destination(args.dst, args.overwrite)  # before minutes of loading
    model = load_model(args.src, args.dtype, quiet=args.quiet)
    save_converted(args.dst, model.config, model.params, model.tokenizer, overwrite=args.overwrite,
                   source=os.path.abspath(args.src))
    print(f"wrote {args.dst} ({model.config.model_type}, {args.dtype}) in {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from kvoffload.errors import check_range
    from kvoffload.models import DEFAULT_MODEL_NAME, load_model
    from kvoffload.serve.api import cache_blocks, serve
    from kvoffload.serve.scheduler import check_policy

    _check_int(args.port, "--port", 0, 65535)
    _check_int(args.max_batch, "--max-batch", 1)
    check_range("--kv-cache-gb", args.kv_cache_gb, 0, low_open=True)
    if args.prefix_cache_gb is not None:
        check_range("--prefix-cache-gb", args.prefix_cache_gb, 0)
    pairs, _ = _policy_options(args)
    options = check_policy(args.policy, dict(pairs))  # refused before the model loads
    model = load_model(args.model, args.dtype, quiet=args.quiet)
    if model.tokenizer is None:
        raise FileNotFoundError(f"{args.model}: no tokenizer found beside the checkpoint; serve needs one")
    cache_blocks(model, options, args.kv_cache_gb, args.prefix_cache_gb)  # a cache too small: one line
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else DEFAULT_MODEL_NAME)
    serve(model, name, host=args.host, port=args.port, kv_cache_gb=args.kv_cache_gb,
          prefix_cache_gb=args.prefix_cache_gb, policy=args.policy, policy_options=options,
          max_batch=args.max_batch, max_seq_len=args.max_seq_len)
    return 0


# Subcommands whose argument parsing lives with their implementation: name -> (module, function).
_DELEGATED = {
    "profile": ("kvoffload.offload.cli", "profile_main", "measure the machine and write a JSON profile"),
    "bench": ("kvoffload.offload.cli", "bench_main", "decode benchmark of the KV policies"),
    "eval": ("kvoffload.eval", "cli_main", "accuracy evaluation: ruler | longbench | ppl | compare"),
    "train-importance": ("kvoffload.importance.cli", "train_importance_main", "train head-importance scores"),
    "train-hata": ("kvoffload.importance.cli", "train_hata_main", "train HATA hash codes"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvoffload", description=__doc__,
                                epilog="Errors print one line (exit code 2); --debug (anywhere) shows the traceback.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (default model: embedded SmolLM2-135M-Instruct)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF checkpoint dir, .gguf file, converted dir or a model name "
                   "(SmolLM2-135M-Instruct, gemma-3-270m; default: the embedded SmolLM2-135M-Instruct)")
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
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="every policy: split heads, weights and the host pool over the first N devices")
    g.add_argument("--trace", default=None, help="write a per-step trace (JSON) here")
    g.add_argument("--policy-option", action="append", metavar="KEY=VALUE", help="any other policy option")
    g.add_argument("--quiet", action="store_true", help="no progress bars or loading messages")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint (HF dir or GGUF) to an orbax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--overwrite", action="store_true", help="replace the kvoffload checkpoint already in DST")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (policy full)")
    s.add_argument("--model", default=None, help="as for generate (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    s.add_argument("--policy", default="full", help="KV policy; the scheduler runs full and refuses the others")
    s.add_argument("--policy-option", action="append", metavar="KEY=VALUE", help="block_tokens=N (default 16)")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    s.add_argument("--kv-cache-gb", type=float, default=1.0, help="device memory for the K/V blocks (GiB)")
    s.add_argument("--prefix-cache-gb", type=float, default=None,
                   help="of that, what unreferenced prefix blocks may keep (GiB; 0: no prefix reuse; default all)")
    s.add_argument("--max-seq-len", type=int, default=None, help="tokens per request (default: the model's positions)")
    s.add_argument("--quiet", action="store_true", help="no loading messages")
    s.set_defaults(func=cmd_serve)

    sub.add_parser("policies", help="list the available KV policies").set_defaults(func=cmd_policies)
    for name, (_, _, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def cmd_policies(args) -> int:
    from kvoffload.policies import available_policies

    print("\n".join(available_policies()))
    return 0


def _split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Removes --debug from anywhere before a `--` separator (the sub-commands parse their own flags)."""
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end] or os.environ.get("KVOFFLOAD_DEBUG", "") not in ("", "0")
    return [a for i, a in enumerate(argv) if not (i < end and a == "--debug")], debug


def _one_line_warnings():
    """Library warnings (AccuracyWarning: a configuration known to lose accuracy) as one line on stderr."""
    import warnings

    from kvoffload.errors import AccuracyWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, AccuracyWarning):
            print(f"kvoffload: warning: {message}", file=file or sys.stderr, flush=True)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    argv, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    _one_line_warnings()
    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        if command in _DELEGATED:
            module, fn, _ = _DELEGATED[command]
            return int(getattr(importlib.import_module(module), fn)(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        return args.func(args)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"kvoffload {command or ''}: error: {one_line(e)}".replace("  ", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"kvoffload {command or ''}: interrupted".replace("  ", " "), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
