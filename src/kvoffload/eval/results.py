"""What a run records: the results file (provenance first, resume, a last line cut by a crash), the loop every
benchmark shares for one (task, length, policy) (resumed samples taken from the file, the rest run, a failure
recorded), the progress bar, and the run's end (summary, report files, metadata)."""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TextIO

import numpy as np

from kvoffload.errors import KVOffloadError

from .parse import PolicySpec

__all__ = ["EvalResult", "ExistingResultsError", "ResultsFile", "Progress", "run_provenance", "resume_or_run",
           "finish_run", "run_meta", "prompt_sha", "max_positions"]


class Progress:
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


def prompt_sha(ids: Sequence[int]) -> str:
    return hashlib.sha1(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]


class ExistingResultsError(KVOffloadError, ValueError):
    """The output directory holds results of an earlier run and neither resume nor overwrite was asked."""


class ResultsFile:
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


def resume_or_run(rf: ResultsFile, prog: Progress, records: list[dict], errors: list[str], *, benchmark: str,
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



def max_positions(model) -> int:
    return int(model.config.max_position_embeddings)


def finish_run(benchmark: str, records: list[dict], out_dir: Path, errors: list[str], t0: float,
            meta: dict, progress: Progress, baseline: str, plot: bool) -> EvalResult:
    from . import report

    summary = report.summarize(records, benchmark)
    files = report.write_report(out_dir, benchmark, records, summary, meta=meta, baseline=baseline, plot=plot)
    table = report.format_table(summary, benchmark, baseline=baseline)
    res = EvalResult(benchmark, records, summary, files, errors, time.time() - t0, table)
    progress.note(f"done in {_hms(res.seconds)}; results in {out_dir}")
    progress.close()
    return res


def run_meta(model, benchmark: str, specs: list[PolicySpec], extra: dict) -> dict:
    import platform

    m = {
        "benchmark": benchmark,
        "policies": [{"label": s.label, "name": s.name, "options": s.options_dict} for s in specs],
        "model": getattr(model, "name", None) or getattr(getattr(model, "config", None), "name_or_path", None),
        "max_position_embeddings": max_positions(model),
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
