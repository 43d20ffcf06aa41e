"""Runs RULER, LongBench and perplexity over a list of KV policies on the same samples.

Every policy sees exactly the same prompts (generated or loaded once per task and
length); per-sample results go to ``{benchmark}_results.jsonl`` as they are made
(``resume=True`` skips the ones already there), and the summary table and plot
are written by :mod:`kvoffload.eval.report` at the end. The policy list is open:
any name in ``kvoffload.policies.available_policies()`` works, with options
(``topk:k=256,sink=4``), and a policy may appear several times under different
options. Policies with a selection cache (``clo``, ``tokenselect``) add to each record its engine
call's reuse statistics under ``selection`` (:func:`.generation.selection_stats`; the same for every sample of a
batch), which the summary averages. A ``generate_fn`` given in place of the engine's is called as
``generate_fn(model, prompts, max_new_tokens, policy=<built Policy>, temperature=0.0, stop_on_eos=True)``.

This module runs each benchmark; its parts are parse.py (policies, lengths, seeds), generation.py (prompt
format, batched greedy generation, selection statistics) and results.py (the results file, resume, progress,
the run's end).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, TextIO

import numpy as np

from .generation import engine_generate, engine_logprobs, generate_group, resolve_chat, template_name
from .parse import PolicySpec, as_specs, check_count, parse_seeds
from .results import (
    EvalResult,
    Progress,
    ResultsFile,
    finish_run,
    max_positions,
    prompt_sha,
    resume_or_run,
    run_meta,
    run_provenance,
)

__all__ = ["run_ruler", "run_longbench", "run_perplexity"]


# ---------------------------------------------------------------------------- RULER


def run_ruler(model, *, tasks: Sequence[str] | None = None, lengths: Sequence[int] = (4096,),
              policies: Sequence[PolicySpec] | str = "full", num_samples: int = 20,
              seed: int | str | Sequence[int] = 42, out_dir: str | os.PathLike = "eval-out",
              template: str | bool | None = "auto", batch_size: int = 1, resume: bool = False,
              overwrite: bool = False, save_inputs: bool = False, progress: TextIO | None = sys.stderr,
              baseline: str = "full", plot: bool = True, generate_fn: Callable | None = None,
              chat_template: str | bool | None = None) -> EvalResult:
    """RULER tasks x lengths x seeds x policies on the same samples; writes results, summary and plot.
    seed: one generator seed or several (``[1, 2, 3]``, ``"1,2,3"``): num_samples per task, length and seed,
    every record carrying its seed (42, RULER's own, is the development set: accept on others, see
    docs/EVALUATION.md). template: ``chat``, ``plain`` or ``auto`` (`resolve_chat`; ``chat_template`` is its
    older name). resume: keep the results already in out_dir and run only the missing samples; overwrite:
    replace them (without either, earlier results are refused rather than lost)."""
    from . import ruler

    if chat_template is not None:
        if template != "auto":
            raise ValueError("template and chat_template (its older name) set the same thing: give one")
        template = chat_template
    seeds = parse_seeds(seed)
    check_count(num_samples, "num_samples (--num-samples)")
    check_count(batch_size, "batch_size (--batch-size)")
    t_start = time.time()
    specs = as_specs(policies)
    tasks = list(tasks or ruler.RULER_TASKS)
    for t in tasks:
        ruler.task_config(t)  # unknown task -> KeyError now, not after an hour
    lengths = [int(x) for x in lengths]
    limit = max_positions(model)
    too_long = [L for L in lengths if L > limit]
    if too_long:
        raise ValueError(f"context length(s) {too_long} exceed the model's {limit} positions "
                         f"(max_position_embeddings); RULER lengths count prompt + answer tokens")
    tok = model.tokenizer
    chat = resolve_chat(tok, template)
    fmt = template_name(chat)
    generate_fn = generate_fn or engine_generate()
    out = Path(out_dir)
    # the template changes what a row means (compared on resume); each record names its seed, so a resume may
    # add seeds as it may add tasks or lengths
    prov = run_provenance(model, "ruler", specs, {"template": fmt},
                          {"tasks": tasks, "lengths": lengths, "num_samples": num_samples, "seeds": seeds})
    rf = ResultsFile(out / "ruler_results.jsonl", resume, overwrite, prov)
    prog = Progress("ruler", len(tasks) * len(lengths) * len(seeds) * len(specs) * num_samples, progress)
    prog.note(f"tasks={','.join(tasks)} lengths={lengths} seeds={seeds} policies={[s.label for s in specs]} "
              f"samples={num_samples} per seed, template={fmt}")
    records: list[dict] = []
    errors: list[str] = []
    samples_file = open(out / "ruler_samples.jsonl", "w", encoding="utf-8") if save_inputs else None
    # All samples first: a length too short for some task fails now, before hours of decoding.
    all_items: dict[tuple, list[dict]] = {}
    infeasible = []
    for L in lengths:
        for task in tasks:
            items = []
            for sd in seeds:
                t0 = time.time()
                try:
                    samples = ruler.generate_samples(tok, task, L, num_samples, seed=sd, chat=chat)
                except ValueError as e:
                    infeasible.append(str(e))
                    break
                prog.note(f"{task} L={L} seed {sd}: {len(samples)} samples generated in {time.time() - t0:.1f}s "
                          f"(prompt tokens {min(len(s.prompt_ids) for s in samples)}-"
                          f"{max(len(s.prompt_ids) for s in samples)})")
                for s in samples:
                    if samples_file:
                        samples_file.write(json.dumps({**s.to_json(with_input=True), "seed": sd, "template": fmt},
                                                      ensure_ascii=False) + "\n")
                    if not save_inputs:
                        s.input = ""  # keep memory flat at long lengths; the ids are what runs
                    items.append({"sample": s, "index": s.index, "seed": sd, "prompt_ids": s.prompt_ids,
                                  "max_new_tokens": s.max_new_tokens, "sha": prompt_sha(s.prompt_ids)})
            all_items[(task, L)] = items
    if infeasible:
        if samples_file:
            samples_file.close()
        rf.close()
        prog.close()
        raise ValueError("; ".join(infeasible))
    try:
        for L in lengths:
            # every task's samples of this length at once: an engine call batches samples of several tasks
            # (those of equal answer budgets), as many as batch_size
            items = [dict(it, task=task) for task in tasks for it in all_items[(task, L)]]
            for spec in specs:
                def run(todo, emit, spec=spec):
                    def on_done(it, new_ids, dt, extra):
                        s = it["sample"]
                        pred = tok.decode(new_ids, skip_special_tokens=True)
                        emit(it, {"score": ruler.score_sample(s.metric, pred, s.outputs), "metric": s.metric,
                                  "pred": pred, "outputs": s.outputs, "prompt_tokens": len(s.prompt_ids),
                                  "new_tokens": len(new_ids), "seconds": round(dt, 3), "seed": it["seed"],
                                  "template": fmt, **extra})

                    generate_group(model, todo, spec, generate_fn, batch_size, on_done)

                resume_or_run(rf, prog, records, errors, benchmark="ruler", task=None, length=L, spec=spec,
                               items=items, run=run)
    finally:
        rf.close()
        prog.close()
        if samples_file:
            samples_file.close()
    meta = run_meta(model, "ruler", specs, {"tasks": tasks, "lengths": lengths, "num_samples": num_samples,
                                          "seeds": seeds, "template": fmt, "chat_template": chat.enabled,
                                          "errors": errors, "provenance": prov})
    return finish_run("ruler", records, out, errors, t_start, meta, prog, baseline, plot)


# ------------------------------------------------------------------------ LongBench


def run_longbench(model, *, data_dir: str | os.PathLike, datasets: Sequence[str] | None = None,
                  lengths: Sequence[int] | None = None, policies: Sequence[PolicySpec] | str = "full",
                  limit: int | None = None, longbench_e: bool = False, out_dir: str | os.PathLike = "eval-out",
                  template: str | bool | None = "auto", batch_size: int = 1, resume: bool = False,
                  overwrite: bool = False,
                  progress: TextIO | None = sys.stderr, baseline: str = "full", plot: bool = True,
                  generate_fn: Callable | None = None) -> EvalResult:
    """LongBench datasets x prompt budgets (``lengths``, in tokens) x policies (resume, overwrite: as
    :func:`run_ruler`)."""
    from . import longbench as lb

    check_count(batch_size, "batch_size (--batch-size)")
    if limit is not None:
        check_count(limit, "limit (--limit)")
    t_start = time.time()
    specs = as_specs(policies)
    data = lb.load_longbench(data_dir, datasets, longbench_e=longbench_e, limit=limit)
    tok = model.tokenizer
    chat = resolve_chat(tok, template)
    limit_pos = max_positions(model)
    overhead = len(tok.encode(chat.wrap(""), add_special_tokens=False)) + 2 if chat.enabled else 2
    if lengths is None:
        lengths = [limit_pos - max(lb.DATASET2MAXLEN[d] for d in data) - overhead]
    lengths = [int(x) for x in lengths]
    for L in lengths:
        bad = [d for d in data if L + lb.DATASET2MAXLEN[d] + overhead > limit_pos]
        if bad:
            worst = max(lb.DATASET2MAXLEN[d] for d in bad)
            raise ValueError(f"prompt budget {L} + up to {worst} new tokens (+{overhead} template tokens) exceeds "
                             f"the model's {limit_pos} positions for {', '.join(bad)}; use a budget <= "
                             f"{limit_pos - worst - overhead}")
    generate_fn = generate_fn or engine_generate()
    out = Path(out_dir)
    from kvoffload.provenance import file_fingerprint

    suffix = "_e" if longbench_e else ""
    prov = run_provenance(model, "longbench", specs,
                          {"chat_template": chat.enabled, "longbench_e": longbench_e,
                           "data": {d: file_fingerprint(str(Path(data_dir) / f"{d}{suffix}.jsonl")) for d in data}},
                          {"datasets": list(data), "lengths": lengths, "limit": limit, "data_dir": str(data_dir)})
    rf = ResultsFile(out / "longbench_results.jsonl", resume, overwrite, prov)
    total = sum(len(v) for v in data.values()) * len(lengths) * len(specs)
    prog = Progress("longbench", total, progress)
    prog.note(f"datasets={','.join(data)} budgets={lengths} policies={[s.label for s in specs]} "
              f"template={template_name(chat)}{' LongBench-E' if longbench_e else ''}")
    records, errors = [], []
    try:
        for L in lengths:
            for ds, samples in data.items():
                items = []
                for s in samples:
                    _, ids, max_new = lb.build_prompt(tok, s, L, chat, max_positions=limit_pos)
                    items.append({"sample": s, "index": s.index, "prompt_ids": ids, "max_new_tokens": max_new,
                                  "sha": prompt_sha(ids)})
                for spec in specs:
                    def run(todo, emit, spec=spec, ds=ds):
                        def on_done(it, new_ids, dt, extra):
                            s = it["sample"]
                            pred = tok.decode(new_ids, skip_special_tokens=True)
                            emit(it, {"_id": s.id, "score": lb.score_sample(ds, pred, s.answers, s.all_classes),
                                      "pred": pred, "answers": s.answers, "all_classes": s.all_classes,
                                      "sample_length": s.length, "prompt_tokens": len(it["prompt_ids"]),
                                      "new_tokens": len(new_ids), "seconds": round(dt, 3),
                                      "template": template_name(chat), **extra})

                        generate_group(model, todo, spec, generate_fn, batch_size, on_done)

                    resume_or_run(rf, prog, records, errors, benchmark="longbench", task=ds, length=L, spec=spec,
                                   items=items, run=run)
    finally:
        rf.close()
        prog.close()
    meta = run_meta(model, "longbench", specs, {"datasets": list(data), "lengths": lengths, "limit": limit,
                                              "longbench_e": longbench_e, "template": template_name(chat),
                                              "chat_template": chat.enabled,
                                              "data_dir": str(data_dir), "errors": errors, "provenance": prov})
    return finish_run("longbench", records, out, errors, t_start, meta, prog, baseline, plot)


# ----------------------------------------------------------------------- perplexity


def run_perplexity(model, *, lengths: Sequence[int] = (2048,), policies: Sequence[PolicySpec] | str = "full",
                   texts: Sequence[str] = ("essays",), text_file: str | os.PathLike | None = None,
                   window: int | None = None, stride: int | None = None, decode_tokens: int | None = None,
                   seed: int = 0, out_dir: str | os.PathLike = "eval-out", resume: bool = False,
                   overwrite: bool = False,
                   progress: TextIO | None = sys.stderr, baseline: str = "full", plot: bool = True,
                   logprobs_fn: Callable | None = None) -> EvalResult:
    """Sliding-window perplexity of the first ``length`` tokens of each text, per policy.

    ``texts``: ``essays`` (RULER's Paul Graham essays), ``random`` (uniform random token
    ids: the baseline), ``file`` (``text_file``). ``window`` defaults to
    min(length, max positions), ``stride`` to ``window // 2``.
    """
    from . import perplexity as pp

    t_start = time.time()
    specs = as_specs(policies)
    tok = model.tokenizer
    limit = max_positions(model)
    logprobs_fn = logprobs_fn or engine_logprobs()
    lengths = [int(x) for x in lengths]
    sources: dict[str, Callable[[int], list[int]]] = {}
    for t in texts:
        if t == "essays":
            from .ruler import essays_text

            txt = essays_text()
            sources["essays"] = lambda n, txt=txt: pp.text_tokens(tok, txt, n)
        elif t == "random":
            vocab = int(model.config.vocab_size)
            sources["random"] = lambda n: pp.random_tokens(vocab, n, seed)
        elif t == "file":
            if text_file is None:
                raise ValueError("texts include 'file' but no text file was given (--text-file)")
            txt = Path(text_file).read_text(encoding="utf-8")
            sources[Path(text_file).stem] = lambda n, txt=txt: pp.text_tokens(tok, txt, n)
        else:
            raise ValueError(f"unknown text {t!r}: use essays, random or file")
    plans = []
    for L in lengths:
        w = min(window or L, L, limit)
        if w > limit:
            raise ValueError(f"window {w} exceeds the model's {limit} positions")
        s = stride or max(1, w // 2)
        n_win = sum(1 for _ in pp.sliding_windows(L, w, s, decode_tokens))
        plans.append((L, w, s, n_win))
    out = Path(out_dir)
    prov = run_provenance(model, "ppl", specs, {"window": window, "stride": stride, "decode_tokens": decode_tokens,
                                                "seed": seed}, {"texts": list(sources), "lengths": lengths})
    rf = ResultsFile(out / "ppl_results.jsonl", resume, overwrite, prov)
    prog = Progress("ppl", sum(p[3] for p in plans) * len(sources) * len(specs), progress)
    prog.note(f"texts={list(sources)} lengths={lengths} policies={[s.label for s in specs]} "
              f"windows={[(p[1], p[2]) for p in plans]}")
    records, errors = [], []
    try:
        for L, w, stride_, n_win in plans:
            for name, src in sources.items():
                ids = src(L)
                items = [{"index": 0, "sha": prompt_sha(ids), "steps": n_win}]
                for spec in specs:
                    def run(todo, emit, spec=spec, ids=ids, w=w, stride_=stride_):
                        t0 = time.time()

                        def lp_fn(toks, prefix_len):
                            return logprobs_fn(model, list(toks), prefix_len, policy=spec.name,
                                               policy_options=spec.options_dict or None)

                        def on_window(win, lp):
                            prog.step(f"window [{win.begin},{win.end}) ppl={math.exp(-float(np.mean(lp))):.2f}")

                        res = pp.perplexity(ids, lp_fn, w, stride_, decode_tokens, on_window=on_window)
                        emit(todo[0], {"score": res.ppl, "ppl": res.ppl, "nll": res.nll, "tokens": res.tokens,
                                       "windows": res.windows, "window": w, "stride": stride_,
                                       "decode_tokens": decode_tokens, "seconds": round(time.time() - t0, 3)},
                             steps=0)  # the windows advanced the bar

                    resume_or_run(rf, prog, records, errors, benchmark="ppl", task=name, length=L, spec=spec,
                                   items=items, run=run)
    finally:
        rf.close()
        prog.close()
    meta = run_meta(model, "ppl", specs, {"texts": list(sources), "lengths": lengths, "window": window,
                                        "stride": stride, "decode_tokens": decode_tokens, "errors": errors,
                                        "provenance": prov})
    return finish_run("ppl", records, out, errors, t_start, meta, prog, baseline, plot)
