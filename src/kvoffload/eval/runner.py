"""Runs RULER, LongBench and perplexity over a list of KV policies on the same samples.

Every policy sees exactly the same prompts (generated or loaded once per task and
length); per-sample results go to ``{benchmark}_results.jsonl`` as they are made
(``resume=True`` skips the ones already there), and the summary table and plot
are written by :mod:`kvoffload.eval.report` at the end. The policy list is open:
any name in ``kvoffload.policies.available_policies()`` works, with options
(``topk:k=256,sink=4``), and a policy may appear several times under different
options. Policies with a selection cache (``clo``, ``tokenselect``) add to each record its engine
call's reuse statistics under ``selection`` (:func:`selection_stats`; the same for every sample of a
batch), which the summary averages. A ``generate_fn`` given in place of the engine's is called as
``generate_fn(model, prompts, max_new_tokens, policy=<built Policy>, temperature=0.0, stop_on_eos=True)``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

import numpy as np

from kvoffload.errors import KVOffloadError
from kvoffload.policies import Policy, make_policy

__all__ = [
    "PolicySpec",
    "parse_policies",
    "parse_lengths",
    "EvalResult",
    "selection_stats",
    "run_ruler",
    "run_longbench",
    "run_perplexity",
]


# ------------------------------------------------------------------ policies & lengths


@dataclass(frozen=True)
class PolicySpec:
    """One policy to evaluate: a registry name, its options, and the label shown in reports."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    label: str = ""

    @property
    def options_dict(self) -> dict:
        return dict(self.options)

    def __post_init__(self):
        if not self.label:
            lab = self.name
            if self.options:
                lab += ":" + ",".join(f"{k}={_fmt_value(v)}" for k, v in self.options)
            object.__setattr__(self, "label", lab)


def _fmt_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _parse_value(s: str):
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def parse_policies(specs: str | Sequence[str], available: Sequence[str] | None = None) -> list[PolicySpec]:
    """Parse ``"full,offload,topk:k=256,sink=4"`` (or a list of such strings) into PolicySpecs.

    A segment with ``=`` and no ``:`` continues the options of the policy before it.
    Values are JSON where they parse (numbers, booleans, lists), strings otherwise.
    ``available``: the registered policy names (default: ``available_policies()``);
    unknown names raise ValueError listing them.
    """
    if isinstance(specs, str):
        specs = [specs]
    groups: list[list[str]] = []
    for spec in specs:
        for seg in (s.strip() for s in spec.split(",")):
            if not seg:
                continue
            if "=" in seg and ":" not in seg.split("=", 1)[0]:
                if not groups:
                    raise ValueError(f"policy option {seg!r} comes before any policy name")
                groups[-1].append(seg)
            else:
                groups.append([seg])
    if not groups:
        raise ValueError("no policy given")
    check_options = available is None  # names given by hand (tests) need not be registered
    if available is None:
        from kvoffload.policies import available_policies

        available = available_policies()
    out: list[PolicySpec] = []
    for g in groups:
        name, _, first = g[0].partition(":")
        opts = []
        for kv in ([first] if first else []) + g[1:]:
            k, eq, v = kv.partition("=")
            if not eq or not k.strip():
                raise ValueError(f"bad policy option {kv!r} in {g[0]!r} (use name:key=value,key=value)")
            opts.append((k.strip(), v.strip()))
        name = name.strip()
        if name not in available:
            raise ValueError(f"unknown policy {name!r}; available: {', '.join(available)}")
        if check_options:  # typed by the policy's schema now: an unknown, repeated or bad option fails before the run
            from kvoffload.policies.base import check_options as parse_typed

            typed = parse_typed(name, opts)
            opts = [(k, typed[k]) for k, _ in opts if k in typed]
        else:
            if len({k for k, _ in opts}) < len(opts):
                raise ValueError(f"an option is given twice in {g[0]!r}")
            opts = [(k, _parse_value(v)) for k, v in opts]
        spec = PolicySpec(name, tuple(opts))
        if any(s.label == spec.label for s in out):
            raise ValueError(f"policy {spec.label!r} is listed twice")
        out.append(spec)
    return out


def parse_lengths(s: str | int | Sequence[str | int]) -> list[int]:
    """``"4k,8K,16384"`` -> ``[4096, 8192, 16384]`` (k = 1024)."""
    if isinstance(s, int):
        return [s]
    items = s.split(",") if isinstance(s, str) else list(s)
    out = []
    for it in items:
        if isinstance(it, int):
            out.append(it)
            continue
        t = it.strip().lower()
        if not t:
            continue
        mult = 1
        if t.endswith("k"):
            mult, t = 1024, t[:-1]
        elif t.endswith("m"):
            mult, t = 1024 * 1024, t[:-1]
        try:
            v = int(float(t) * mult)
        except ValueError:
            raise ValueError(f"bad length {it!r} (use e.g. 4096, 4k, 32K)") from None
        if v <= 0:
            raise ValueError(f"length must be positive, got {it!r}")
        out.append(v)
    if not out:
        raise ValueError("no length given")
    return out


# ------------------------------------------------------------------------- plumbing


class _Progress:
    """A tqdm bar over the run's work units (samples; windows for perplexity) with rate and ETA; its
    description names the task, length and policy under way, its postfix the last result. Notes print
    above the bar. stream None: silent."""

    def __init__(self, benchmark: str, total: int, stream: TextIO | None, unit: str = "sample"):
        from tqdm import tqdm

        self.benchmark, self.stream = benchmark, stream
        self.bar = None if stream is None else tqdm(total=total, desc=benchmark, unit=unit, file=stream,
                                                   dynamic_ncols=True, smoothing=0.05)

    def task(self, what: str):
        if self.bar is not None:
            self.bar.set_description(f"{self.benchmark} {what}", refresh=False)

    def step(self, msg: str, n: int = 1):
        if self.bar is not None:
            self.bar.set_postfix_str(msg, refresh=False)
            self.bar.update(n)

    def note(self, msg: str):
        if self.bar is not None:
            self.bar.write(f"[{self.benchmark}] {msg}", file=self.stream)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _sha(ids: Sequence[int]) -> str:
    return hashlib.sha1(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]


class ExistingResultsError(KVOffloadError, ValueError):
    """The output directory holds results of an earlier run and neither resume nor overwrite was asked."""


class _ResultsFile:
    """Appends per-sample records, one JSON line each, after a first line holding the run's provenance
    (`kvoffload.provenance`). With resume, refuses a file whose provenance differs from this run's (naming
    the fields) and knows which samples were done before; the file is read as bytes and a last line cut by a
    crash is dropped, whatever it holds (even half a UTF-8 character). Without resume, refuses a file holding
    earlier results unless overwrite."""

    def __init__(self, path: Path, resume: bool, overwrite: bool = False, provenance: dict | None = None):
        from kvoffload.provenance import check_same

        self.path = path
        self.done: dict[tuple, dict] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        held = path.exists() and path.stat().st_size > 0
        if held and resume:
            header, rows, complete = self._read(path)
            if provenance is not None:
                check_same(path, header, provenance)
            for r in rows:
                if "error" not in r:
                    self.done[self.key(r)] = r
            with open(path, "r+b") as f:  # a cut last line goes: its sample runs again
                f.truncate(complete)
        elif held and not overwrite:
            raise ExistingResultsError(
                f"{path} holds results of an earlier run; pass --resume (resume=True) to keep them and run only "
                "the missing samples, or --overwrite (overwrite=True) to replace them, or choose another --out")
        self._f = open(path, "a" if resume else "w", encoding="utf-8")
        # written with the first record: a run refused before any sample leaves no file that looks like results
        self._header = None if held and resume else provenance

    @staticmethod
    def _read(path: Path) -> tuple[dict | None, list[dict], int]:
        """(the provenance header or None, the records, the byte length of the complete lines)."""
        data = path.read_bytes()
        complete = data.rfind(b"\n") + 1  # past the last newline: a line without one was cut mid-write
        header, rows = None, []
        for line in data[:complete].splitlines():
            try:
                r = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue  # a damaged line: its sample runs again
            if isinstance(r, dict) and "provenance" in r:
                header = header or r["provenance"]
            elif isinstance(r, dict):
                rows.append(r)
        return header, rows, complete

    @staticmethod
    def key(r: dict) -> tuple:
        return (r.get("task"), r.get("length"), r.get("policy"), r.get("seed"), r.get("index"), r.get("prompt_sha"))

    def write(self, r: dict):
        if self._header is not None:
            header, self._header = self._header, None
            self.write({"provenance": header})
        self._f.write(json.dumps(r, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self):
        self._f.close()


def run_provenance(model, benchmark: str, specs: Sequence["PolicySpec"], same: dict, info: dict) -> dict:
    """The provenance of an evaluation run: the model (fingerprint and dtype), the package version, the
    benchmark and `same` (settings that make a row mean something else) are compared on resume; the
    policies and `info` (sample counts, lengths, tasks: a resume may add to them) are recorded."""
    from kvoffload.provenance import make_provenance

    policies = [{"label": s.label, "name": s.name, "options": s.options_dict} for s in specs]
    return make_provenance(model, same={"benchmark": benchmark, **same}, info={"policies": policies, **info})


def _resume_or_run(rf: _ResultsFile, prog: _Progress, records: list[dict], errors: list[str], *, benchmark: str,
                   task: str, length: int, spec: "PolicySpec", items: list[dict],
                   run: Callable[[list[dict], Callable[..., None]], None]):
    """The loop every benchmark shares for one (task, length, policy): items (dicts with ``index`` and
    ``sha``, the prompt's hash; with task None each item names its ``task``, so that one engine call can batch
    samples of several tasks) already in the results file are taken from it; the rest go to
    ``run(todo, emit)``, which calls ``emit(item, record, steps=1)`` for each finished item. Each
    record gets the common fields, is written and kept. A failure of ``run`` is recorded (in the file
    and ``errors``) and does not stop the other policies."""
    where = f"{task or 'all tasks'} L={length} {spec.label}"
    prog.task(where)
    running: list[float] = []
    todo = []
    for it in items:
        r = rf.done.get((it.get("task", task), length, spec.label, it.get("seed"), it["index"], it["sha"]))
        if r is None:
            todo.append(it)
            continue
        records.append(r)
        running.append(r["score"])
        prog.step(f"#{it['index']} (resumed) score={r['score']:.2f}", n=r.get("windows", 1))
    pending = {id(it) for it in todo}

    def emit(it: dict, r: dict, steps: int = 1):
        r = {"benchmark": benchmark, "task": it.get("task", task), "length": length, "policy": spec.label,
             "policy_name": spec.name,
             "policy_options": spec.options_dict, "index": it["index"], **r, "prompt_sha": it["sha"]}
        rf.write(r)
        records.append(r)
        running.append(r["score"])
        pending.discard(id(it))
        prog.step(f"#{it['index']} score={r['score']:.2f} (mean {np.mean(running):.2f})", n=steps)

    if not todo:
        return
    try:
        run(todo, emit)
    except Exception as e:  # one failing policy must not sink the others
        msg = f"{spec.label} failed on {task or 'a batch of tasks'} L={length}: {type(e).__name__}: {e}"
        errors.append(msg)
        prog.note("ERROR " + msg + "\n" + traceback.format_exc(limit=3))
        rf.write({"benchmark": benchmark, "task": task or sorted({it["task"] for it in todo}), "length": length,
                  "policy": spec.label, "error": msg})
        prog.step("failed", n=sum(it.get("steps", 1) for it in todo if id(it) in pending))


@dataclass
class EvalResult:
    """What a run produced: per-sample records, the summary rows and the files written."""

    benchmark: str
    records: list[dict]
    summary: list[dict]
    files: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    table: str = ""


def _engine_generate():
    from kvoffload.engine import generate

    return generate


def _engine_logprobs():
    from kvoffload.engine import teacher_forced_logprobs

    return teacher_forced_logprobs


TEMPLATES = ("auto", "chat", "plain")


def _resolve_chat(tok, template: str | bool | None):
    """The prompt format: ``chat`` wraps each prompt in the model's chat template (an error where it has none),
    ``plain`` is the task's own template with its answer prefix (as for base models), ``auto`` chat where the
    tokenizer has a template. The older spellings on / off / True / False / None are accepted."""
    from .ruler import ChatWrapper

    modes = {"auto": None, "chat": True, "plain": False, "on": True, "off": False, None: None, True: True,
             False: False}
    if isinstance(template, str) and template not in modes or not isinstance(template, (str, bool, type(None))):
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    return ChatWrapper.from_tokenizer(tok, modes[template])


def template_name(chat) -> str:
    """The prompt format a run used, as its records and summaries name it: chat or plain."""
    return "chat" if chat.enabled else "plain"


def parse_seeds(seeds: int | str | Sequence[int | str]) -> list[int]:
    """``"1,2,3"``, ``[1, 2, 3]`` or ``42`` -> a list of distinct whole-number seeds (in order)."""
    items = seeds.split(",") if isinstance(seeds, str) else [seeds] if isinstance(seeds, (int, np.integer)) \
        else list(seeds)
    out: list[int] = []
    for it in items:
        t = it.strip() if isinstance(it, str) else it
        if isinstance(t, str) and not t:
            continue
        try:
            v = int(t) if not isinstance(t, (bool, float)) else None
        except ValueError:
            v = None
        if v is None or v < 0:
            raise ValueError(f"bad seed {it!r}: seeds are whole numbers >= 0 (e.g. --seeds 1,2,3)")
        if v in out:
            raise ValueError(f"seed {v} is listed twice")
        out.append(v)
    if not out:
        raise ValueError("no seed given")
    return out


def _as_specs(policies) -> list[PolicySpec]:
    if isinstance(policies, str) or (isinstance(policies, (list, tuple)) and policies and isinstance(policies[0], str)):
        return parse_policies(policies)
    return list(policies)


def _check_count(n, what: str):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what} must be a whole number >= 1, got {n!r}")


def _max_positions(model) -> int:
    return int(model.config.max_position_embeddings)


def selection_stats(described: dict) -> dict | None:
    """The selection-cache reuse in a policy's ``describe(state)`` (clo, tokenselect), in short; None for a
    policy that reports none. ``hit_rate``: the fraction of (step, layer, KV head) looks that reused the
    cached selection, over the run's decode steps; ``hit_rate_per_layer``; ``hit_rate_cached_heads`` (clo:
    without its persistent heads); ``guess_hit_rate`` (clo with speculative prefetch: the fraction of the
    fresh selections' rows its guesses had fetched); ``bytes_fetched_per_step`` (K and V rows gathered
    from the host, per decode step, where the policy counts them). Rates are None when nothing was decoded
    past the prefill (no selection ran)."""
    sel = next((v for v in described.values() if isinstance(v, dict) and "hit_rate" in v), None)
    if sel is None:
        return None
    steps = int(described.get("last_step", {}).get("step", -1)) + 1  # the decode steps the state went through
    out = {"decode_steps": steps, "hit_rate": sel["hit_rate"] if steps else None,
           "hit_rate_per_layer": sel["hit_rate_per_layer"] if steps else None}
    if "hit_rate_cached_heads" in sel:
        out["hit_rate_cached_heads"] = sel["hit_rate_cached_heads"] if steps else None
    if "speculative_prefetch" in sel:
        out["guess_hit_rate"] = sel["speculative_prefetch"]["guess_hit_rate"]
    fetched = [sel[k] for k in ("v_bytes_fetched", "k_bytes_fetched") if k in sel]
    if fetched:
        out["bytes_fetched_per_step"] = sum(fetched) / steps if steps else None
    return out


class _KeepsLastState(Policy):
    """A built policy that keeps the state its last prefill or decode step returned, so that what the run
    did (``describe(state)``: selection-cache hits, bytes fetched) can be read after ``generate`` returns.
    Everything else (``extrapolates``, ``release``, ...) is the policy's own."""

    def __init__(self, policy: Policy):
        self.policy, self.name, self.state = policy, policy.name, None

    def __getattr__(self, attr):
        if attr == "policy":  # not set yet: no recursion
            raise AttributeError(attr)
        return getattr(self.policy, attr)

    def prefill(self, model, tokens, lengths, capacity):
        logits, self.state = self.policy.prefill(model, tokens, lengths, capacity)
        return logits, self.state

    def decode_step(self, model, state, tokens):
        logits, self.state = self.policy.decode_step(model, state, tokens)
        return logits, self.state

    def describe(self, state=None) -> dict:
        return self.policy.describe(state)

    def selection_stats(self) -> dict | None:
        """:func:`selection_stats` of the last run; lets its state (the KV cache) go."""
        state, self.state = self.state, None
        return None if state is None else selection_stats(self.policy.describe(state))


def _generate_group(model, items: list[dict], spec: PolicySpec, generate_fn, batch_size: int,
                    on_done: Callable[[dict, list[int], float, dict], None]):
    """Greedy generation for items (dicts with prompt_ids, max_new_tokens), batched by max_new_tokens (items of
    equal budgets grouped, in their order). on_done(item, new_ids, seconds, extra): extra holds the batch's
    ``selection`` statistics (the same for every item of the batch; :func:`selection_stats`) where the policy
    reports them."""
    budgets = list(dict.fromkeys(it["max_new_tokens"] for it in items))
    items = sorted(items, key=lambda it: budgets.index(it["max_new_tokens"]))
    i = 0
    while i < len(items):
        batch = [items[i]]
        while (len(batch) < batch_size and i + len(batch) < len(items)
               and items[i + len(batch)]["max_new_tokens"] == batch[0]["max_new_tokens"]):
            batch.append(items[i + len(batch)])
        # built here, as generate would from the name, and kept, to read its state after the run
        pol = _KeepsLastState(make_policy(spec.name, **spec.options_dict))
        t0 = time.time()
        outs = generate_fn(model, [b["prompt_ids"] for b in batch], batch[0]["max_new_tokens"], policy=pol,
                           temperature=0.0, stop_on_eos=True)
        dt = (time.time() - t0) / len(batch)
        stats = pol.selection_stats()
        extra = {"selection": stats} if stats else {}
        for b, o in zip(batch, outs):
            on_done(b, [int(t) for t in o], dt, extra)
        i += len(batch)


def _finish(benchmark: str, records: list[dict], out_dir: Path, errors: list[str], t0: float,
            meta: dict, progress: _Progress, baseline: str, plot: bool) -> EvalResult:
    from . import report

    summary = report.summarize(records, benchmark)
    files = report.write_report(out_dir, benchmark, records, summary, meta=meta, baseline=baseline, plot=plot)
    table = report.format_table(summary, benchmark, baseline=baseline)
    res = EvalResult(benchmark, records, summary, files, errors, time.time() - t0, table)
    progress.note(f"done in {_hms(res.seconds)}; results in {out_dir}")
    progress.close()
    return res


def _meta(model, benchmark: str, specs: list[PolicySpec], extra: dict) -> dict:
    import platform

    m = {
        "benchmark": benchmark,
        "policies": [{"label": s.label, "name": s.name, "options": s.options_dict} for s in specs],
        "model": getattr(model, "name", None) or getattr(getattr(model, "config", None), "name_or_path", None),
        "max_position_embeddings": _max_positions(model),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cpus",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import jax

        m["jax_backend"] = jax.default_backend()
        m["devices"] = [str(d) for d in jax.devices()]
    except Exception:  # pragma: no cover
        pass
    m.update(extra)
    return m


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
    docs/EVALUATION.md). template: ``chat``, ``plain`` or ``auto`` (`_resolve_chat`; ``chat_template`` is its
    older name). resume: keep the results already in out_dir and run only the missing samples; overwrite:
    replace them (without either, earlier results are refused rather than lost)."""
    from . import ruler

    if chat_template is not None:
        if template != "auto":
            raise ValueError("template and chat_template (its older name) set the same thing: give one")
        template = chat_template
    seeds = parse_seeds(seed)
    _check_count(num_samples, "num_samples (--num-samples)")
    _check_count(batch_size, "batch_size (--batch-size)")
    t_start = time.time()
    specs = _as_specs(policies)
    tasks = list(tasks or ruler.RULER_TASKS)
    for t in tasks:
        ruler.task_config(t)  # unknown task -> KeyError now, not after an hour
    lengths = [int(x) for x in lengths]
    limit = _max_positions(model)
    too_long = [L for L in lengths if L > limit]
    if too_long:
        raise ValueError(f"context length(s) {too_long} exceed the model's {limit} positions "
                         f"(max_position_embeddings); RULER lengths count prompt + answer tokens")
    tok = model.tokenizer
    chat = _resolve_chat(tok, template)
    fmt = template_name(chat)
    generate_fn = generate_fn or _engine_generate()
    out = Path(out_dir)
    # the template changes what a row means (compared on resume); each record names its seed, so a resume may
    # add seeds as it may add tasks or lengths
    prov = run_provenance(model, "ruler", specs, {"template": fmt},
                          {"tasks": tasks, "lengths": lengths, "num_samples": num_samples, "seeds": seeds})
    rf = _ResultsFile(out / "ruler_results.jsonl", resume, overwrite, prov)
    prog = _Progress("ruler", len(tasks) * len(lengths) * len(seeds) * len(specs) * num_samples, progress)
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
                                  "max_new_tokens": s.max_new_tokens, "sha": _sha(s.prompt_ids)})
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

                    _generate_group(model, todo, spec, generate_fn, batch_size, on_done)

                _resume_or_run(rf, prog, records, errors, benchmark="ruler", task=None, length=L, spec=spec,
                               items=items, run=run)
    finally:
        rf.close()
        prog.close()
        if samples_file:
            samples_file.close()
    meta = _meta(model, "ruler", specs, {"tasks": tasks, "lengths": lengths, "num_samples": num_samples,
                                          "seeds": seeds, "template": fmt, "chat_template": chat.enabled,
                                          "errors": errors, "provenance": prov})
    return _finish("ruler", records, out, errors, t_start, meta, prog, baseline, plot)


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

    _check_count(batch_size, "batch_size (--batch-size)")
    if limit is not None:
        _check_count(limit, "limit (--limit)")
    t_start = time.time()
    specs = _as_specs(policies)
    data = lb.load_longbench(data_dir, datasets, longbench_e=longbench_e, limit=limit)
    tok = model.tokenizer
    chat = _resolve_chat(tok, template)
    limit_pos = _max_positions(model)
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
    generate_fn = generate_fn or _engine_generate()
    out = Path(out_dir)
    from kvoffload.provenance import file_fingerprint

    suffix = "_e" if longbench_e else ""
    prov = run_provenance(model, "longbench", specs,
                          {"chat_template": chat.enabled, "longbench_e": longbench_e,
                           "data": {d: file_fingerprint(str(Path(data_dir) / f"{d}{suffix}.jsonl")) for d in data}},
                          {"datasets": list(data), "lengths": lengths, "limit": limit, "data_dir": str(data_dir)})
    rf = _ResultsFile(out / "longbench_results.jsonl", resume, overwrite, prov)
    total = sum(len(v) for v in data.values()) * len(lengths) * len(specs)
    prog = _Progress("longbench", total, progress)
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
                                  "sha": _sha(ids)})
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

                        _generate_group(model, todo, spec, generate_fn, batch_size, on_done)

                    _resume_or_run(rf, prog, records, errors, benchmark="longbench", task=ds, length=L, spec=spec,
                                   items=items, run=run)
    finally:
        rf.close()
        prog.close()
    meta = _meta(model, "longbench", specs, {"datasets": list(data), "lengths": lengths, "limit": limit,
                                              "longbench_e": longbench_e, "template": template_name(chat),
                                              "chat_template": chat.enabled,
                                              "data_dir": str(data_dir), "errors": errors, "provenance": prov})
    return _finish("longbench", records, out, errors, t_start, meta, prog, baseline, plot)


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
    specs = _as_specs(policies)
    tok = model.tokenizer
    limit = _max_positions(model)
    logprobs_fn = logprobs_fn or _engine_logprobs()
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
    rf = _ResultsFile(out / "ppl_results.jsonl", resume, overwrite, prov)
    prog = _Progress("ppl", sum(p[3] for p in plans) * len(sources) * len(specs), progress)
    prog.note(f"texts={list(sources)} lengths={lengths} policies={[s.label for s in specs]} "
              f"windows={[(p[1], p[2]) for p in plans]}")
    records, errors = [], []
    try:
        for L, w, stride_, n_win in plans:
            for name, src in sources.items():
                ids = src(L)
                items = [{"index": 0, "sha": _sha(ids), "steps": n_win}]
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

                    _resume_or_run(rf, prog, records, errors, benchmark="ppl", task=name, length=L, spec=spec,
                                   items=items, run=run)
    finally:
        rf.close()
        prog.close()
    meta = _meta(model, "ppl", specs, {"texts": list(sources), "lengths": lengths, "window": window,
                                        "stride": stride, "decode_tokens": decode_tokens, "errors": errors,
                                        "provenance": prov})
    return _finish("ppl", records, out, errors, t_start, meta, prog, baseline, plot)
