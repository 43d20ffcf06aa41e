"""benchmarks/bench_flexgen.py: config parsing, FlexGen's own parser takes our arguments, the offline patch,
--dry-run, and a config that cannot run (no CUDA here) recorded in the JSON instead of crashing.

The FlexGen peer lives git-ignored in peers/FlexLLMGen; tests that need it skip where it is absent."""

import json
import pathlib

import pytest
from script_loader import script_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_PEER = (ROOT / "peers" / "FlexLLMGen" / "flexllmgen" / "flex_opt.py").exists()
needs_peer = pytest.mark.skipif(not HAVE_PEER, reason="FlexGen peer not exported to peers/FlexLLMGen")


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_flexgen") as mod:
        yield mod


def test_config_round_trip_and_flags(bench):
    c = bench.parse_config("facebook/OPT-30B:20,80,0,100,0,100:48x3:cpu:pin0:fewer_batch")
    assert (c.model, c.percent, c.gpu_batch_size, c.num_gpu_batches, c.batch_size) == (
        "opt-30b", (20, 80, 0, 100, 0, 100), 48, 3, 144)
    assert c.cpu_cache_compute and not c.pin_weight and c.fewer_batch and c.overlap
    assert not (c.compress_weight or c.compress_cache)
    assert bench.parse_config(c.spec()) == c
    for spec in bench.DEFAULT_CONFIGS:
        assert bench.parse_config(spec).spec() == spec


@pytest.mark.parametrize("spec, words", [
    ("opt-13b:20,80,0,100:32x4", "six integers"),
    ("opt-13b:20,90,0,100,0,100:32x4", "weight GPU% + CPU% = 110"),
    ("opt-13b:20,80,0,100,50,50:32x4", "activations must be all on one device"),
    ("opt-13b:20,80,0,100,0,100:32", "GBSxNGB"),
    ("opt-13b:20,80,0,100,0,100:32x4:cpux", "unknown flag"),
    ("opt-12b:20,80,0,100,0,100:32x4", "unknown model"),
    ("opt-13b:20,80,0,100,0,100:0x4", "batch sizes must be >= 1"),
    ("opt-13b:20,80", "is not MODEL"),
])
def test_bad_config_says_what_is_wrong(bench, spec, words):
    with pytest.raises(ValueError, match=words.replace("+", r"\+")):
        bench.parse_config(spec)


def test_cli_single_config_from_flags(bench, capsys):
    parser = bench.build_parser()
    args = parser.parse_args(["--model", "opt-6.7b", "--percent", "100", "0", "100", "0", "100", "0",
                              "--gpu-batch-size", "2", "--overlap", "0", "--config",
                              "opt-13b:68,32,0,100,0,100:32x5:cpu"])
    configs = bench.collect_configs(args, parser)
    assert [c.spec() for c in configs] == ["opt-13b:68,32,0,100,0,100:32x5:cpu",
                                           "opt-6.7b:100,0,100,0,100,0:2x1:nooverlap"]
    assert [c.spec() for c in bench.collect_configs(parser.parse_args([]), parser)] == list(
        bench.DEFAULT_CONFIGS)
    with pytest.raises(SystemExit):
        bench.collect_configs(parser.parse_args(["--model", "opt-13b"]), parser)
    assert "--model needs --percent" in capsys.readouterr().err


@needs_peer
def test_flexgen_parser_takes_our_arguments_and_tokenizer_is_offline(bench, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    flex_opt = bench.import_flexgen_offline()
    assert flex_opt.AutoTokenizer is bench.OfflineAutoTokenizer
    config = bench.parse_config("opt-30b:31,69,0,100,0,100:4x15:cpu:compc")
    parser = __import__("argparse").ArgumentParser()
    flex_opt.add_parser_arguments(parser)
    args = parser.parse_args(config.flexgen_argv(512, 32, tmp_path / "off", tmp_path / "log"))
    assert (args.model, args.path, args.percent, args.gpu_batch_size, args.num_gpu_batches) == (
        "facebook/opt-30b", "_DUMMY_", [31, 69, 0, 100, 0, 100], 4, 15)
    assert args.cpu_cache_compute and args.compress_cache and not args.compress_weight
    assert args.pin_weight is True and args.overlap is True and args.debug_mode is None
    assert (args.prompt_len, args.gen_len, args.log_file) == (512, 32, str(tmp_path / "log"))
    # run_flexllmgen's own input path with the stand-in: prompt_len ordinary ids, none is the pad id.
    tokenizer = flex_opt.AutoTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")
    inputs = flex_opt.get_test_inputs(512, 6, tokenizer)
    assert len(inputs) == 6 and all(len(ids) == 512 for ids in inputs)
    assert min(inputs[0]) >= 4 and max(inputs[0]) < 50265
    assert len(set(inputs[0])) > 400  # random ids, not a constant prompt


@needs_peer
def test_dry_run_prints_worker_and_flexgen_commands(bench, capsys):
    assert bench.main(["--dry-run", "--config", "opt-30b:20,80,0,100,0,100:48x3:cpu"]) == 0
    out = capsys.readouterr().out
    assert "--worker-config opt-30b:20,80,0,100,0,100:48x3:cpu" in out
    assert "python -m flexllmgen.flex_opt --model facebook/opt-30b --path _DUMMY_" in out
    assert "--percent 20 80 0 100 0 100" in out and "--cpu-cache-compute" in out
    # FlexGen's formulas: OPT-30B ~55.8 GiB of weights; 144 x 544 tokens of KV ~100.4 GiB.
    assert "weights 55.8 GiB, KV 100.4 GiB" in out


@needs_peer
def test_failed_config_is_recorded_not_raised(bench, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: this checks the no-GPU failure path")
    out = tmp_path / "flexgen.json"
    code = bench.main(["--config", "opt-6.7b:100,0,100,0,100,0:2x1", "--out", str(out)])
    assert code == 1
    report = json.loads(out.read_text())
    (record,) = report["results"]
    assert record["status"] == "error" and "FlexGen needs a CUDA GPU" in record["error"]
    assert record["config"] == "opt-6.7b:100,0,100,0,100,0:2x1" and record["batch_size"] == 2
    assert "FAILED RuntimeError: FlexGen needs a CUDA GPU" in capsys.readouterr().out
