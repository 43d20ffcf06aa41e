#!/usr/bin/env python
"""Run the peer FlexGen (FMInference/FlexLLMGen) offline on the GPU machine, for a side-by-side benchmark.

FlexGen's code is NOT part of this project: it is exported, git-ignored, into peers/FlexLLMGen/
(snapshot commit in peers/FlexLLMGen/SNAPSHOT_COMMIT) and imported from there. This script only
drives it:

    PYTHONPATH=src python benchmarks/bench_flexgen.py --dry-run                 # default configs, commands
    PYTHONPATH=src python benchmarks/bench_flexgen.py --gpu-mem-budget-gb 24 --out $OUT/flexgen.json
    python benchmarks/bench_flexgen.py --config "opt-13b:68,32,0,100,0,100:32x5:cpu" \
        --config "opt-30b:31,69,0,100,0,100:4x15:cpu:fewer_batch" --prompt-len 512 --gen-len 32
    python benchmarks/bench_flexgen.py --model opt-30b --percent 20 80 0 100 0 100 \
        --gpu-batch-size 48 --num-gpu-batches 3 --cpu-cache-compute --pin-weight 1

Each config runs in a fresh subprocess (GPU and pinned host memory freed between configs) with a
time limit; one that fails (CUDA OOM, host OOM kill, time-out) is recorded in the JSON with its
error and the output tail, and the others still run. The JSON (--out) is rewritten after every
config, so a run cut short keeps what finished. Exit status 1 if any config failed.

What is measured: FlexGen's own `flexllmgen.flex_opt.run_flexllmgen(args)`, unchanged, with its own
argument parser (`add_parser_arguments`) and `--path _DUMMY_` (dummy weights). It runs a warm-up
generate (prompt 32, 1 token), then the timed generate; its `timers("generate")` records one cost
per generated token (cost[0] = prefill, including the first token). It derives prefill latency,
decode latency = sum(costs[1:]), decode throughput = batch*(gen_len-1)/decode latency, total
throughput = batch*gen_len/(prefill+decode), and writes them with `write_benchmark_log`; this script
reads that log back with FlexGen's `read_benchmark_log` and also stores the raw per-token costs.
Peak GPU memory is torch.cuda.max_memory_allocated() (the same call FlexGen's log uses; it includes
the warm-up). With `:fewer_batch` a config runs FlexGen's debug mode that times 20 layer-batches of
decode and extrapolates (how FlexGen's own bench_suite.py measured the paper's numbers);
`projected` is true in the result then.

What is patched (nothing in FlexGen's files; two things at run time, in the worker process):
  1. `flexllmgen.flex_opt.AutoTokenizer` is replaced by `OfflineAutoTokenizer`. run_flexllmgen
     calls `AutoTokenizer.from_pretrained("facebook/opt-30b")`, which needs the Hugging Face hub
     (no network on the GPU machine). It only uses the tokenizer to turn one fixed prompt into
     `prompt_len` ids (padded with `padding="max_length"`) and, for real weights only, to decode.
     With dummy weights the text is meaningless, and the work done per token does not depend on
     the ids (dense attention over the whole padded length), so the stand-in returns
     `prompt_len` random ids in [4, 50265) (no pad/special ids; seeded), for every prompt.
  2. The environment gets HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1, so anything else that tried
     the hub would fail at once instead of hanging.
And two FlexGen arguments point to files this run owns: `--offload-dir` (FlexGen's default is
~/flexllmgen_offload_dir; it makes the dir and starts its disk copy threads even with no disk share)
and `--log-file` go to a fresh temporary directory, removed afterwards.
Not needed: weight downloads (`_DUMMY_` in the path skips them; dummy weights are np.ones, see
flex_opt.init_weight_list), config downloads (OPT shapes are in flexllmgen/opt_config.py), `pulp`
(only FlexGen's policy search in experimental/cost_model.py uses it). Runtime imports: torch,
numpy, tqdm, attrs (flexllmgen/utils.py), transformers (the import only): all on the GPU image.
FlexGen itself needs CUDA (TorchDevice("cuda:0"), CUDA streams, copy threads): without a GPU the
worker stops with a clear error, recorded in the JSON.

--percent (six integers, FlexGen's flex_opt.py): weight GPU%, weight CPU%, KV cache GPU%, KV cache
CPU%, activation GPU%, activation CPU%; what is left of 100 in each pair goes to disk. Weights are
split per layer by tensor (a tensor goes where the middle of its byte range falls). Activations
must be all on one device. `cpu` (--cpu-cache-compute) computes decode attention on the CPU next to
the host KV cache instead of moving the KV to the GPU.

Default configs ("GPU memory budget 24 GB, weights and KV offloaded to host", prompt 512, gen 32):
  opt-13b:68,32,0,100,0,100:32x5:cpu   } FlexGen's own policy search, experimental/cost_model.py,
  opt-30b:31,69,0,100,0,100:4x15:cpu   } run as `--model facebook/opt-{13b,30b} --prompt-len 512
      --gen-len 32 --gpu-mem 24 --cpu-mem 100 --nvme-mem 0 --cg 0 --cc 100 --hg 0 --hc 100`
      (KV and activations fixed on the host as in the brief; weights and batch left to the search).
      Its answers: 13B wg=0.683 gbs=32 nb=5; 30B wg=0.311 gbs=4 nb=15; each with an estimated
      GPU peak of 19.2 of 24 GB and host peak 74 / 80 of 100 GB; rounded to integer percents here.
      The search uses its built-in T4-fitted hardware constants (only the memory budgets are
      ours), so on an H100 it is FlexGen's choice for the budget, not a tuned optimum. 100 GB of
      the 128 GiB host leaves room for FlexGen's 4 x 2 GiB pinned copy buffers and for torch
      rounding pinned blocks up to powers of two.
  FlexGen's published single-GPU OPT-30B policy for prompt 512 / gen 32 (T4 16 GB, 208 GB DRAM),
  benchmark/flexllmgen/bench_suite.py `suite_30b_1x1` (also README's HELM example), as a config:
      opt-30b:20,80,0,100,0,100:48x3:cpu            (their run adds :fewer_batch)
  That batch of 144 needs ~100 GiB of host KV + 45 GiB of weights: it does not fit a 128 GiB host
  (use a kind with more host memory, e.g. nvidia-h100-x2, 256 GiB), so it is not a default.
  OPT-13B has no published FlexGen setting. OPT-6.7B: bench_suite.py `suite_6b7_1x1`, prompt 512:
      opt-6.7b:100,0,100,0,100,0:2x1:nooverlap      (all on the GPU)
  A seconds-long smoke test of the whole path: --config opt-125m:100,0,100,0,100,0:2x1
FlexGen's log keeps 3 decimals (the numbers above come from it); `generate_costs_s` keeps its raw
per-token costs at full precision.

Config string: MODEL:WG,WC,CG,CC,AG,AC:GBSxNGB[:FLAG...], FLAG one of cpu (--cpu-cache-compute),
pin0 / pin1 (--pin-weight, FlexGen's default 1), compw (--compress-weight), compc
(--compress-cache), nooverlap (--overlap False), fewer_batch (--debug-mode fewer_batch).
--gpu-mem-budget-gb N caps the torch allocator at N GiB (torch.cuda.set_per_process_memory_fraction)
so a config that needs more fails with a CUDA OOM instead of silently using the whole GPU.
"""

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = REPO_ROOT / "peers" / "FlexLLMGen"
GIB = 1 << 30  # FlexGen's GB

# OPT sizes flexllmgen/opt_config.py knows (opt-350m has a different architecture there).
MODELS = ("opt-125m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "opt-175b")
FLAGS = ("cpu", "pin0", "pin1", "compw", "compc", "nooverlap", "fewer_batch")
DEFAULT_CONFIGS = (
    "opt-13b:68,32,0,100,0,100:32x5:cpu",
    "opt-30b:31,69,0,100,0,100:4x15:cpu",
)
# FlexGen's TorchDisk starts 4 copy threads, each with a 1 Gi-element fp16 pinned buffer.
COPY_BUFFER_BYTES = 4 * 2 * GIB
TAIL_LINES = 60


@dataclasses.dataclass(frozen=True)
class FlexGenConfig:
    """One FlexGen run: what its CLI takes, minus paths and lengths."""

    model: str
    percent: tuple
    gpu_batch_size: int
    num_gpu_batches: int
    cpu_cache_compute: bool = False
    pin_weight: bool = True
    compress_weight: bool = False
    compress_cache: bool = False
    overlap: bool = True
    fewer_batch: bool = False

    @property
    def batch_size(self):
        return self.gpu_batch_size * self.num_gpu_batches

    def spec(self):
        """The config string that parse_config reads back."""
        flags = [name for name, on in (
            ("cpu", self.cpu_cache_compute), ("pin0", not self.pin_weight),
            ("compw", self.compress_weight), ("compc", self.compress_cache),
            ("nooverlap", not self.overlap), ("fewer_batch", self.fewer_batch)) if on]
        head = f"{self.model}:{','.join(map(str, self.percent))}:{self.gpu_batch_size}x{self.num_gpu_batches}"
        return ":".join([head] + flags)

    def flexgen_argv(self, prompt_len, gen_len, offload_dir, log_file):
        """Arguments for FlexGen's own parser (flex_opt.add_parser_arguments)."""
        argv = ["--model", f"facebook/{self.model}", "--path", "_DUMMY_",
                "--offload-dir", str(offload_dir), "--log-file", str(log_file),
                "--prompt-len", str(prompt_len), "--gen-len", str(gen_len),
                "--gpu-batch-size", str(self.gpu_batch_size),
                "--num-gpu-batches", str(self.num_gpu_batches),
                "--percent", *map(str, self.percent),
                "--pin-weight", str(int(self.pin_weight)),
                "--overlap", str(self.overlap), "--verbose", "1"]
        if self.cpu_cache_compute:
            argv.append("--cpu-cache-compute")
        if self.compress_weight:
            argv.append("--compress-weight")
        if self.compress_cache:
            argv.append("--compress-cache")
        if self.fewer_batch:
            argv += ["--debug-mode", "fewer_batch"]
        return argv


def _check_percent(percent):
    if len(percent) != 6 or any(not 0 <= p <= 100 for p in percent):
        raise ValueError(f"--percent needs six integers in [0, 100], got {list(percent)}")
    for name, (gpu, cpu) in zip(("weight", "cache", "activation"), zip(percent[::2], percent[1::2])):
        if gpu + cpu > 100:
            raise ValueError(f"{name} GPU% + CPU% = {gpu + cpu} > 100 in --percent {list(percent)}")
    if (percent[4], percent[5]) not in ((100, 0), (0, 100), (0, 0)):
        # FlexGen's OptLM raises NotImplementedError for a split activation home.
        raise ValueError(f"activations must be all on one device (100,0 / 0,100 / 0,0), "
                         f"got {percent[4]},{percent[5]}")


def make_config(model, percent, gpu_batch_size, num_gpu_batches, **flags):
    model = model.split("/")[-1].lower()
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; FlexGen knows {', '.join(MODELS)}")
    percent = tuple(int(p) for p in percent)
    _check_percent(percent)
    if gpu_batch_size < 1 or num_gpu_batches < 1:
        raise ValueError(f"batch sizes must be >= 1, got {gpu_batch_size}x{num_gpu_batches}")
    return FlexGenConfig(model, percent, gpu_batch_size, num_gpu_batches, **flags)


def parse_config(spec):
    """MODEL:WG,WC,CG,CC,AG,AC:GBSxNGB[:FLAG...] -> FlexGenConfig (ValueError says what is wrong)."""
    parts = spec.strip().split(":")
    if len(parts) < 3:
        raise ValueError(f"config {spec!r} is not MODEL:WG,WC,CG,CC,AG,AC:GBSxNGB[:FLAG...]")
    model, percent_text, batch_text, flag_words = parts[0], parts[1], parts[2], parts[3:]
    try:
        percent = [int(p) for p in percent_text.split(",")]
        gbs, ngb = (int(x) for x in batch_text.lower().split("x"))
    except ValueError:
        raise ValueError(f"config {spec!r}: percents must be six integers and the batch GBSxNGB "
                         f"(e.g. 32x4)") from None
    unknown = [w for w in flag_words if w not in FLAGS]
    if unknown:
        raise ValueError(f"config {spec!r}: unknown flag(s) {unknown}; flags are {', '.join(FLAGS)}")
    if "pin0" in flag_words and "pin1" in flag_words:
        raise ValueError(f"config {spec!r}: pin0 and pin1 together")
    return make_config(model, percent, gbs, ngb,
                       cpu_cache_compute="cpu" in flag_words, pin_weight="pin0" not in flag_words,
                       compress_weight="compw" in flag_words, compress_cache="compc" in flag_words,
                       overlap="nooverlap" not in flag_words, fewer_batch="fewer_batch" in flag_words)


def peer_commit():
    path = PEER_DIR / "SNAPSHOT_COMMIT"
    return path.read_text().strip() if path.exists() else None


def require_peer():
    if not (PEER_DIR / "flexllmgen" / "flex_opt.py").exists():
        raise SystemExit(
            f"FlexGen not found at {PEER_DIR}: export it there (git-ignored) from a FMInference/FlexLLMGen "
            f"snapshot, e.g. `git --git-dir=MIRROR archive HEAD flexllmgen LICENSE | tar -x -C {PEER_DIR}`, "
            f"and carry `peers` to the GPU machine")
    if str(PEER_DIR) not in sys.path:
        sys.path.insert(0, str(PEER_DIR))


def memory_estimate(config, prompt_len, gen_len):
    """Bytes per device from FlexGen's own size formulas (flexllmgen/opt_config.py), for planning."""
    require_peer()
    from flexllmgen.opt_config import get_opt_config

    opt = get_opt_config(config.model)
    weights = opt.model_bytes()
    cache = opt.cache_bytes(config.batch_size, prompt_len + gen_len)
    wg, wc, cg, cc = (p / 100 for p in config.percent[:4])
    return {"weights_bytes": weights, "cache_bytes": cache,
            "gpu_weights_and_cache_bytes": int(weights * wg + cache * cg),
            "host_weights_and_cache_bytes": int(weights * wc + cache * cc),
            "host_with_copy_buffers_bytes": int(weights * wc + cache * cc) + COPY_BUFFER_BYTES}


# ------------------------------------------------------------------------------------------------
# worker: one config, in its own process


class RandomIdTokenizer:
    """Offline stand-in for the OPT tokenizer, as run_flexllmgen uses it (see the module docstring)."""

    def __init__(self, seed=0):
        self.seed = seed

    def __call__(self, prompts, padding="max_length", max_length=None, **_):
        import numpy as np
        from types import SimpleNamespace

        if padding != "max_length" or max_length is None:
            raise ValueError("the offline tokenizer stand-in only serves padding='max_length' with a "
                             "max_length (all run_flexllmgen asks for)")
        rng = np.random.default_rng(self.seed + max_length)
        # 4..50264: the OPT tokenizer's ordinary ids (0-3 are <s>, <pad>, </s>, <unk>).
        return SimpleNamespace(input_ids=[rng.integers(4, 50265, size=max_length).tolist()
                                          for _ in prompts])

    def batch_decode(self, *_, **__):
        raise RuntimeError("the offline tokenizer stand-in cannot decode (only dummy weights run here)")


class OfflineAutoTokenizer:
    """Replaces flexllmgen.flex_opt.AutoTokenizer: from_pretrained needs no hub."""

    @staticmethod
    def from_pretrained(name, **_):
        return RandomIdTokenizer()


def import_flexgen_offline():
    """Import FlexGen's flex_opt from peers/ with the offline patch (module docstring, 'patched')."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    require_peer()
    from flexllmgen import flex_opt

    flex_opt.AutoTokenizer = OfflineAutoTokenizer
    return flex_opt


def host_mem_total_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_worker(config, prompt_len, gen_len, gpu_mem_budget_gb):
    """Run FlexGen's run_flexllmgen for one config; returns the result dict (raises on failure)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "FlexGen needs a CUDA GPU (torch.cuda.is_available() is False): it hard-codes "
            "TorchDevice('cuda:0'), CUDA streams and CUDA copy threads. Run this on the GPU machine; "
            "here only --dry-run works")
    flex_opt = import_flexgen_offline()
    from flexllmgen.timer import timers
    from flexllmgen.utils import read_benchmark_log
    import transformers

    total_gpu = torch.cuda.get_device_properties(0).total_memory
    if gpu_mem_budget_gb is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_mem_budget_gb * GIB / total_gpu), 0)
    workdir = Path(tempfile.mkdtemp(prefix="flexgen_bench_"))
    log_file = workdir / "flexgen.log"
    argv = config.flexgen_argv(prompt_len, gen_len, workdir / "offload", log_file)
    parser = argparse.ArgumentParser(prog="flexllmgen.flex_opt")
    flex_opt.add_parser_arguments(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        flex_opt.run_flexllmgen(args)
        measured = read_benchmark_log(str(log_file))
        log_text = log_file.read_text()
    finally:
        costs = list(timers("generate").costs)
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "status": "ok",
        "projected": bool(config.fewer_batch),
        "prefill_latency_s": measured.prefill_latency,
        "prefill_throughput_tok_s": measured.prefill_throughput,
        "decode_latency_s": measured.decode_latency,
        "decode_throughput_tok_s": measured.decode_throughput,
        "total_latency_s": measured.total_latency,
        "total_throughput_tok_s": measured.total_throughput,
        "generate_costs_s": costs,
        "flexgen_log": log_text,
        "peak_gpu_mem_bytes": torch.cuda.max_memory_allocated(0),
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(0),
        "gpu_name": torch.cuda.get_device_name(0),
        "gpu_total_mem_bytes": total_gpu,
        "host_mem_total_bytes": host_mem_total_bytes(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "worker_wall_s": time.perf_counter() - start,
        "flexgen_argv": argv,
    }


def worker_main(spec, prompt_len, gen_len, gpu_mem_budget_gb, result_path):
    config = parse_config(spec)
    try:
        result = run_worker(config, prompt_len, gen_len, gpu_mem_budget_gb)
        code = 0
    except BaseException as e:  # noqa: BLE001 - every failure goes into the JSON
        result = {"status": "error", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()}
        try:
            from flexllmgen.timer import timers
            # FlexGen's raw per-token costs, if the timed generate finished before the failure.
            result["generate_costs_s"] = list(timers("generate").costs)
        except Exception:  # noqa: BLE001 - FlexGen not importable: nothing measured
            pass
        code = 1
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # FlexGen's disk copy threads are not daemons; if it failed before closing them (e.g. CUDA OOM
    # while placing weights) a normal exit would wait on them forever.
    os._exit(code)


# ------------------------------------------------------------------------------------------------
# parent: configs -> subprocesses -> one JSON


def describe(config, prompt_len, gen_len):
    p = config.percent
    return (f"{config.model} w{p[0]}/{p[1]} kv{p[2]}/{p[3]} act{p[4]}/{p[5]} "
            f"{config.gpu_batch_size}x{config.num_gpu_batches}"
            f"{' cpu-attn' if config.cpu_cache_compute else ''}{'' if config.pin_weight else ' unpinned'}"
            f"{' fewer_batch' if config.fewer_batch else ''} p{prompt_len}+g{gen_len}")


def summary_line(config, prompt_len, gen_len, result):
    head = f"flexgen {describe(config, prompt_len, gen_len)}:"
    if result.get("status") != "ok":
        return f"{head} FAILED {result.get('error', '?').splitlines()[0][:200]}"
    return (f"{head} prefill {result['prefill_latency_s']:.2f} s, decode {result['decode_latency_s']:.2f} s "
            f"({result['decode_throughput_tok_s']:.1f} tok/s), total {result['total_throughput_tok_s']:.1f} tok/s, "
            f"peak GPU {result['peak_gpu_mem_bytes'] / GIB:.1f} GiB"
            f"{' (projected)' if result['projected'] else ''}")


def worker_command(config, args, result_path):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-config", config.spec(),
           "--worker-result", str(result_path), "--prompt-len", str(args.prompt_len),
           "--gen-len", str(args.gen_len)]
    if args.gpu_mem_budget_gb is not None:
        cmd += ["--gpu-mem-budget-gb", str(args.gpu_mem_budget_gb)]
    return cmd


def run_subprocess(cmd, timeout_s):
    """Run cmd, echo its output, kill its process group after timeout_s; (returncode, tail, timed_out)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO_ROOT)
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    tail = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail = (tail + [line.rstrip("\n")])[-TAIL_LINES:]
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, tail, timed_out.is_set()


def run_config(config, args, remaining_s):
    record = {"config": config.spec(), "model": config.model, "percent": list(config.percent),
              "gpu_batch_size": config.gpu_batch_size, "num_gpu_batches": config.num_gpu_batches,
              "batch_size": config.batch_size, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "cpu_cache_compute": config.cpu_cache_compute, "pin_weight": config.pin_weight,
              "compress_weight": config.compress_weight, "compress_cache": config.compress_cache,
              "overlap": config.overlap, "fewer_batch": config.fewer_batch,
              "gpu_mem_budget_gb": args.gpu_mem_budget_gb,
              "estimate": memory_estimate(config, args.prompt_len, args.gen_len)}
    timeout_s = min(args.timeout_s, remaining_s)
    if timeout_s < 10:
        record.update(status="skipped", error="total time budget (--total-timeout-s) spent")
        return record
    with tempfile.TemporaryDirectory(prefix="flexgen_result_") as tmp:
        result_path = Path(tmp) / "result.json"
        start = time.perf_counter()
        returncode, tail, timed_out = run_subprocess(worker_command(config, args, result_path), timeout_s)
        record["wall_s"] = time.perf_counter() - start
        if result_path.exists():
            record.update(json.loads(result_path.read_text()))
        elif timed_out:
            record.update(status="error", error=f"timed out after {timeout_s:.0f} s (killed)")
        else:
            # No result file: the process died (e.g. killed by the host's OOM killer: -9).
            record.update(status="error", error=f"worker exited with {returncode} and wrote no result")
    if record["status"] != "ok":
        record["returncode"] = returncode
        record["output_tail"] = tail
    return record


def collect_configs(args, parser):
    configs = []
    try:
        configs += [parse_config(spec) for spec in args.config]
        if args.model is not None:
            if args.percent is None:
                parser.error("--model needs --percent (six integers)")
            configs.append(make_config(
                args.model, args.percent, args.gpu_batch_size, args.num_gpu_batches,
                cpu_cache_compute=args.cpu_cache_compute, pin_weight=bool(args.pin_weight),
                compress_weight=args.compress_weight, compress_cache=args.compress_cache,
                overlap=bool(args.overlap), fewer_batch=args.debug_mode == "fewer_batch"))
        elif args.percent is not None:
            parser.error("--percent needs --model")
        if not configs:
            configs = [parse_config(spec) for spec in DEFAULT_CONFIGS]
    except ValueError as e:
        parser.error(str(e))
    return configs


def build_parser():
    parser = argparse.ArgumentParser(
        description="Run FlexGen (peers/FlexLLMGen) offline with dummy weights; one JSON of its own "
                    "measurements. See the module docstring for what is patched and the default configs.")
    parser.add_argument("--config", action="append", default=[], metavar="SPEC",
                        help="MODEL:WG,WC,CG,CC,AG,AC:GBSxNGB[:FLAG...], repeatable; flags: "
                             + ", ".join(FLAGS) + f". Default (no --config/--model): {list(DEFAULT_CONFIGS)}")
    parser.add_argument("--model", help=f"one config from flags instead: {', '.join(MODELS)}")
    parser.add_argument("--percent", nargs=6, type=int, metavar="P",
                        help="weight GPU%% CPU%%, cache GPU%% CPU%%, activation GPU%% CPU%%")
    parser.add_argument("--gpu-batch-size", type=int, default=4)
    parser.add_argument("--num-gpu-batches", type=int, default=1)
    parser.add_argument("--cpu-cache-compute", action="store_true")
    parser.add_argument("--pin-weight", type=int, choices=(0, 1), default=1)
    parser.add_argument("--compress-weight", action="store_true")
    parser.add_argument("--compress-cache", action="store_true")
    parser.add_argument("--overlap", type=int, choices=(0, 1), default=1)
    parser.add_argument("--debug-mode", choices=("fewer_batch",))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--gpu-mem-budget-gb", type=float,
                        help="cap torch's GPU allocator at this many GiB (set_per_process_memory_fraction)")
    parser.add_argument("--timeout-s", type=float, default=420, help="per config (default 420)")
    parser.add_argument("--total-timeout-s", type=float, default=570,
                        help="for all configs together (default 570: one 600 s GPU call)")
    parser.add_argument("--out", help="JSON path (default $OUT/bench_flexgen.json, else ./bench_flexgen.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the configs and commands, run nothing")
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--worker-result", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.gen_len < 2:
        parser.error("--prompt-len must be >= 1 and --gen-len >= 2 (FlexGen's decode throughput "
                     "divides by gen_len - 1)")
    if args.worker_config is not None:
        return worker_main(args.worker_config, args.prompt_len, args.gen_len,
                           args.gpu_mem_budget_gb, args.worker_result)
    configs = collect_configs(args, parser)
    require_peer()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "bench_flexgen.json")

    if args.dry_run:
        for config in configs:
            est = memory_estimate(config, args.prompt_len, args.gen_len)
            print(f"# {describe(config, args.prompt_len, args.gen_len)}: weights {est['weights_bytes'] / GIB:.1f} "
                  f"GiB, KV {est['cache_bytes'] / GIB:.1f} GiB; placed on GPU "
                  f"{est['gpu_weights_and_cache_bytes'] / GIB:.1f} GiB, host "
                  f"{est['host_with_copy_buffers_bytes'] / GIB:.1f} GiB (incl. FlexGen's 8 GiB pinned copy buffers)")
            print(shlex.join(worker_command(config, args, "RESULT.json")))
            print("#   = python -m flexllmgen.flex_opt " + shlex.join(
                config.flexgen_argv(args.prompt_len, args.gen_len, "TMP/offload", "TMP/flexgen.log")))
        print(f"# would write {out}")
        return 0

    report = {"harness": "benchmarks/bench_flexgen.py", "flexllmgen_commit": peer_commit(),
              "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "gpu_mem_budget_gb": args.gpu_mem_budget_gb, "results": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.total_timeout_s
    for config in configs:
        print(f"=== flexgen {describe(config, args.prompt_len, args.gen_len)}", flush=True)
        record = run_config(config, args, deadline - time.perf_counter())
        report["results"].append(record)
        out.write_text(json.dumps(report, indent=1))
        print(summary_line(config, args.prompt_len, args.gen_len, record), flush=True)
    print(f"=== flexgen summary ({out})")
    for config, record in zip(configs, report["results"]):
        print(summary_line(config, args.prompt_len, args.gen_len, record))
    return 0 if all(r["status"] == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
