"""The eval runner end to end on a tiny random model: two policies, same samples, files, resume, errors."""

import json
import math

import numpy as np
import pytest

from kvoffload.eval import cli_main, parse_lengths, parse_policies, run_longbench, run_perplexity, run_ruler
from kvoffload.eval import perplexity as pp
from kvoffload.eval.report import format_table, load_records, summarize
from kvoffload.eval.parse import parse_seeds
from kvoffload.models import tiny_random_model
from kvoffload.policies import base as policy_base

SECOND = "evaltest_copy"  # a second registered policy (a renamed `full`): identical scores expected


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", seed=0, max_position_embeddings=2048)


@pytest.fixture
def two_policies():
    from kvoffload.policies.full import FullPolicy

    class CopyPolicy(FullPolicy):
        pass

    policy_base._REGISTRY[SECOND] = CopyPolicy
    CopyPolicy.name = SECOND
    yield f"full,{SECOND}"
    policy_base._REGISTRY.pop(SECOND, None)


def fast_generate(model, prompts, max_new_tokens, **kw):
    """The real engine, with answers cut to 6 tokens (a random model never stops by itself)."""
    from kvoffload.engine import generate

    return generate(model, prompts, min(max_new_tokens, 6), **kw)


def test_parse_policies():
    avail = ["full", "offload", "topk", "kvpr"]
    specs = parse_policies("full, topk:k=256,sink=4,budget=0.5,mode=fast , kvpr", avail)
    assert [s.label for s in specs] == ["full", "topk:k=256,sink=4,budget=0.5,mode=fast", "kvpr"]
    assert specs[1].name == "topk" and specs[1].options_dict == {"k": 256, "sink": 4, "budget": 0.5, "mode": "fast"}
    assert [s.label for s in parse_policies(["full", "topk:k=8", "topk:k=16"], avail)] == ["full", "topk:k=8", "topk:k=16"]
    with pytest.raises(ValueError, match="unknown policy 'nope'; available: full, offload, topk, kvpr"):
        parse_policies("full,nope", avail)
    with pytest.raises(ValueError, match="listed twice"):
        parse_policies("full,full", avail)
    with pytest.raises(ValueError, match="before any policy"):
        parse_policies("k=3,full", avail)
    assert [s.name for s in parse_policies("full")] == ["full"]  # the live registry


def test_parse_lengths():
    assert parse_lengths("4k, 8K,16384") == [4096, 8192, 16384]
    assert parse_lengths("1.5k") == [1536]
    with pytest.raises(ValueError, match="bad length"):
        parse_lengths("4kb")


def test_sliding_windows_cover_each_token_once():
    for n, w, s in [(10, 10, 5), (100, 32, 16), (100, 32, 32), (33, 8, 3)]:
        wins = list(pp.sliding_windows(n, w, s))
        scored = [t for x in wins for t in range(x.begin + x.prefix_len, x.end)]
        assert scored == list(range(1, n)), (n, w, s)
        assert all(x.end - x.begin <= w and x.prefix_len >= 1 for x in wins)
    wins = list(pp.sliding_windows(100, 40, 20, decode_tokens=5))
    assert all(x.scored <= 5 for x in wins)
    res = pp.perplexity(list(range(50)), lambda toks, k: np.full(len(toks) - k, -math.log(2.0)), 16, 8)
    assert res.tokens == 49 and res.ppl == pytest.approx(2.0)


def test_ruler_two_policies_end_to_end(model, two_policies, tmp_path):
    res = run_ruler(model, tasks=["niah_single_1", "niah_multikey_2"], lengths=[1024, 1536],
                    policies=two_policies, num_samples=2, out_dir=tmp_path, progress=None,
                    generate_fn=fast_generate)
    assert not res.errors
    recs = load_records(tmp_path / "ruler_results.jsonl")
    assert len(recs) == len(res.records) == 2 * 2 * 2 * 2
    for r in recs:
        assert set(r) >= {"task", "length", "policy", "index", "score", "pred", "outputs", "prompt_sha"}
        assert r["prompt_tokens"] + r["new_tokens"] <= r["length"]
        assert "selection" not in r  # no selection cache, no statistics
    # same samples for both policies, and a renamed full policy gives the same answers
    by = {}
    for r in recs:
        by.setdefault((r["task"], r["length"], r["index"]), {})[r["policy"]] = r
    for pair in by.values():
        assert pair["full"]["prompt_sha"] == pair[SECOND]["prompt_sha"]
        assert pair["full"]["pred"] == pair[SECOND]["pred"]
    rows = [r for r in res.summary if r["task"] == "average"]
    assert len(rows) == 4
    assert f"| Δ {SECOND} |" in res.table and "+0.00" in res.table
    assert "hit_rate" not in rows[0] and "selection cache" not in res.table
    for f in ("ruler_summary.md", "ruler_summary.csv", "ruler_summary.json", "ruler_plot.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    assert (tmp_path / "ruler_plot.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "ruler_summary.json").read_text())
    assert summary["meta"]["template"] == "plain" and summary["meta"]["seeds"] == [42]
    assert all(r["seed"] == 42 and r["template"] == "plain" for r in recs)
    # the renamed full policy minus full on paired samples: 0 with an interval of no width, per task too
    cmp = json.loads((tmp_path / "compare.json").read_text())
    assert {(r["task"], r["length"]) for r in cmp} == {(t, L) for t in ("average", "niah_single_1", "niah_multikey_2")
                                                       for L in (1024, 1536)}
    assert all(r["policy"] == SECOND and r["delta"] == r["lo"] == r["hi"] == 0.0 for r in cmp)
    assert res.files["compare_plot"].endswith("compare.png") and (tmp_path / "compare.md").exists()


def test_ruler_refuses_lengths_up_front(model, tmp_path):
    with pytest.raises(ValueError, match="exceed the model's 2048 positions"):
        run_ruler(model, tasks=["niah_single_1"], lengths=[4096], out_dir=tmp_path, progress=None)
    calls = []
    with pytest.raises(ValueError, match="too short|cannot be built"):
        run_ruler(model, tasks=["niah_single_1", "vt"], lengths=[1024], out_dir=tmp_path, progress=None,
                  generate_fn=lambda *a, **k: calls.append(1))
    assert not calls  # nothing ran before the refusal


def test_resume_and_failing_policy(model, two_policies, tmp_path):
    from kvoffload.engine import generate

    calls = []

    def flaky(model, prompts, max_new_tokens, policy="full", **kw):
        calls.append(policy.name)  # the runner passes the policy built
        if policy.name == SECOND:
            raise RuntimeError("boom")
        return generate(model, prompts, 4, policy=policy, **kw)

    kw = dict(tasks=["niah_single_1"], lengths=[1024], policies=two_policies, num_samples=2,
              out_dir=tmp_path, progress=None, plot=False)
    res = run_ruler(model, generate_fn=flaky, **kw)
    assert len(res.errors) == 1 and "boom" in res.errors[0] and SECOND in res.errors[0]
    assert {r["policy"] for r in res.records} == {"full"} and len(res.records) == 2
    calls.clear()
    res2 = run_ruler(model, generate_fn=flaky, resume=True, **kw)
    assert calls == [SECOND]  # full's samples were kept; the failed policy is retried
    assert [r["pred"] for r in res2.records] == [r["pred"] for r in res.records]


@pytest.mark.slow  # slow only, both policies
@pytest.mark.parametrize("spec", [
    "clo:topk=64,num_recent=16,eta=0.5,speculative_prefetch=true",  # a guess hit rate too
    "tokenselect:token_budget=96,num_recent=16,cache_threshold=0.5",
])
def test_ruler_records_selection_hit_rates(model, spec, tmp_path):
    """clo and tokenselect: each sample's record holds its batch's selection-cache statistics, those of
    describe(state) at the end of that batch's own decode; the summary averages them per task x length x
    policy, in the JSON and in a Markdown table of their own. (`full` records none: the end-to-end test.)"""
    from kvoffload.engine import CAPACITY_BUCKET, bucket, pad_prompts

    described = []  # (policy name, prompts, describe(final state)) per engine call

    def generate_and_describe(model, prompts, max_new_tokens, policy, **kw):
        """Greedy decode of 4 tokens through the policy as given, described at the end."""
        tokens, lengths = pad_prompts(prompts)
        logits, state = policy.prefill(model, tokens, lengths, bucket(tokens.shape[1] + 4, CAPACITY_BUCKET))
        out = [np.asarray(logits).argmax(-1)]
        for _ in range(3):
            logits, state = policy.decode_step(model, state, out[-1].astype(np.int32))
            out.append(np.asarray(logits).argmax(-1))
        described.append((policy.name, [list(p) for p in prompts], policy.describe(state)))
        return np.stack(out, 1).tolist()

    res = run_ruler(model, tasks=["niah_single_1"], lengths=[1024], policies=spec, num_samples=2, batch_size=2,
                    out_dir=tmp_path, progress=None, plot=False, generate_fn=generate_and_describe)
    assert not res.errors and len(described) == 1  # one batch of 2
    name, prompts, d = described[0]
    recs = load_records(tmp_path / "ruler_results.jsonl")
    assert len(recs) == 2 and {r["prompt_sha"] for r in recs} == {_sha_of(p) for p in prompts}
    want = d["clo"] if name == "clo" else d["selection"]
    for r in recs:
        got = r["selection"]
        assert got["decode_steps"] == 3 and 0 <= got["hit_rate"] <= 1
        assert got["hit_rate"] == want["hit_rate"] and got["hit_rate_per_layer"] == want["hit_rate_per_layer"]
        if name == "clo":
            assert got["hit_rate_cached_heads"] == want["hit_rate_cached_heads"]
            assert got["guess_hit_rate"] == want["speculative_prefetch"]["guess_hit_rate"]
            assert 0 < got["guess_hit_rate"] <= 1
            assert got["bytes_fetched_per_step"] == want["v_bytes_fetched"] / 3 > 0
        else:  # tokenselect (kv=gpu) fetches nothing and guesses nothing
            assert set(got) == {"decode_steps", "hit_rate", "hit_rate_per_layer"}
    assert recs[0]["selection"] == recs[1]["selection"]  # the batch's, in each of its samples
    assert recs[0]["selection"]["hit_rate"] > 0  # the cache was reused: a rate that can be wrong
    row, = res.summary
    assert row["hit_rate"] == want["hit_rate"]
    md = (tmp_path / "ruler_summary.md").read_text()
    assert "selection cache — hit rate" in md and res.table in md
    cols = f"| hit % {spec} | guess hit % {spec} | KiB/step {spec} |" if name == "clo" else f"| hit % {spec} |"
    assert f"| task | length {cols}" in md
    line = md.splitlines()[md.splitlines().index(f"| task | length {cols}") + 2]
    assert line.startswith(f"| niah_single_1 | 1024 | {100 * want['hit_rate']:.1f} |")
    summary = json.loads((tmp_path / "ruler_summary.json").read_text())["summary"]
    assert summary[0]["hit_rate"] == row["hit_rate"]
    assert ("guess_hit_rate" in summary[0]) == (name == "clo")


def _sha_of(ids):
    from kvoffload.eval.results import prompt_sha

    return prompt_sha(ids)


def test_perplexity_runner(model, two_policies, tmp_path):
    res = run_perplexity(model, lengths=[40], texts=["essays", "random"], window=24, stride=16,
                         policies=two_policies, out_dir=tmp_path, progress=None)
    assert not res.errors
    rows = {(r["task"], r["policy"]): r for r in res.summary}
    assert set(rows) == {("essays", "full"), ("random", "full"), ("essays", SECOND), ("random", SECOND)}
    for r in res.records:
        assert r["tokens"] == 39 and r["windows"] == 2
    assert rows[("essays", "full")]["score"] == pytest.approx(rows[("essays", SECOND)]["score"])
    assert "perplexity" in res.table and (tmp_path / "ppl_plot.png").exists()


def test_longbench_runner(model, two_policies, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    row = {"input": "Who?", "context": "Some context. " * 40, "answers": ["Paris"], "length": 120,
           "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "a"}
    (d / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "_id": "b"}) + "\n")
    trec = {**row, "dataset": "trec", "answers": ["Human"], "all_classes": ["Human", "Location"]}
    (d / "trec.jsonl").write_text(json.dumps(trec) + "\n")
    res = run_longbench(model, data_dir=d, lengths=[300], policies=two_policies, out_dir=tmp_path / "o",
                        progress=None, generate_fn=fast_generate)
    assert not res.errors and len(res.records) == 3 * 2
    assert all(r["prompt_tokens"] <= 302 for r in res.records)
    assert {r["task"] for r in res.summary} == {"hotpotqa", "trec", "average"}
    with pytest.raises(ValueError, match="exceeds the model's 2048 positions"):
        run_longbench(model, data_dir=d, lengths=[2040], out_dir=tmp_path / "o", progress=None)


def test_cli_main(tmp_path, capsys):
    rc = cli_main(["ppl", "--model", "tiny", "--lengths", "20", "--texts", "essays,random", "--window", "16",
                   "--out", str(tmp_path), "--quiet", "--no-plot"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| essays | 20 | 1 |" in out and "| random | 20 | 1 |" in out
    assert cli_main(["ruler", "--model", "tiny", "--policy", "full,nope", "--out", str(tmp_path)]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert cli_main(["ruler", "--model", "tiny", "--lengths", "4k", "--out", str(tmp_path), "--quiet"]) == 2
    assert "exceed the model's 512 positions" in capsys.readouterr().err


def test_summary_table_by_hand():
    recs = [{"task": "t", "length": 4096, "policy": p, "score": s, "seconds": 1.0}
            for p, s in [("full", 100.0), ("full", 50.0), ("topk", 50.0), ("topk", 0.0)]]
    rows = summarize(recs, "ruler")
    table = format_table(rows, "ruler")
    assert "| t | 4096 | 2 | 75.0 | 25.0 | -50.00 |" in table


def test_ruler_several_seeds_and_the_template(model, tmp_path):
    """--seeds 1,2: num_samples per seed, each record naming its seed, the seeds' prompts different; resume
    keys on the seed (a run with one more seed runs only that seed); a chat template the model lacks is refused
    before anything runs; bad seeds are refused."""
    calls = []

    def counting(model, prompts, max_new_tokens, **kw):
        calls.append(len(prompts))
        return fast_generate(model, prompts, max_new_tokens, **kw)

    kw = dict(tasks=["niah_single_1"], lengths=[1024], policies="full", num_samples=2, out_dir=tmp_path,
              progress=None, plot=False, generate_fn=counting)
    res = run_ruler(model, seed=[1, 2], template="plain", **kw)
    assert sorted((r["seed"], r["index"]) for r in res.records) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({r["prompt_sha"] for r in res.records}) == 4
    assert all(r["template"] == "plain" for r in res.records)
    calls.clear()
    res = run_ruler(model, seed="1,2,3", template="plain", resume=True, **kw)
    assert sum(calls) == 2 and sorted({r["seed"] for r in res.records}) == [1, 2, 3]
    with pytest.raises(ValueError, match="no chat template"):
        run_ruler(model, seed=[4], template="chat", overwrite=True, **kw)
    for bad in ("1,x", "-1", "2,2", ""):
        with pytest.raises(ValueError, match="seed"):
            parse_seeds(bad)
    with pytest.raises(ValueError, match="template must be one of"):
        run_ruler(model, template="raw", overwrite=True, **kw)
