"""Provenance of result files: what produced a result (the model's fingerprint, dtype, policies and options,
seeds, template, task settings, package version), so a file can say what it holds and a resumed run can
refuse to mix its rows with another run's.

A provenance is a dict with two parts: ``same`` (the fields a resumed run must match: results made under
another model, dtype, template or code are other results) and ``info`` (recorded, not compared: the policy
list, sample counts and lengths may grow between a run and its resume, whose rows are keyed by them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from kvoffload.errors import KVOffloadError

_SAMPLE_BYTES = 1 << 20  # a large weight file is fingerprinted by its size and its first and last MiB


class ProvenanceMismatchError(KVOffloadError, ValueError):
    """Results whose provenance differs from the run that would add to them."""


def package_version() -> str:
    import kvoffload

    return kvoffload.__version__


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(path: str) -> dict:
    """size and a sha256 of a file (of its first and last MiB past 2 MiB: weight files are large, and a
    changed file changes its size or its header almost always)."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * _SAMPLE_BYTES:
            h.update(f.read())
        else:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(size - _SAMPLE_BYTES)
            h.update(f.read())
    return {"name": os.path.basename(path), "size": size, "sha256": h.hexdigest()[:16]}


def source_fingerprint(kind: str, path: str | None = None, **details) -> dict:
    """What a model was loaded from: kind (converted, hf, gguf, tiny, embedded) and a digest of its weight
    files (or of the settings that make a random model)."""
    files = []
    if path is not None and kind in ("hf", "gguf", "embedded"):  # weight files (and configs) at the path
        paths = [path] if os.path.isfile(path) else sorted(
            os.path.join(path, n) for n in os.listdir(path)
            if n.endswith((".safetensors", ".bin", ".gguf", ".json")) and os.path.isfile(os.path.join(path, n)))
        files = [file_fingerprint(p) for p in paths]
        if kind == "embedded":
            path = None  # where the package put its GGUF is no part of the model's identity
    return {"kind": kind, "path": None if path is None else os.path.abspath(path),
            "weights_sha": _digest({"files": files, **details})}


def model_fingerprint(model) -> dict:
    """The model's config digest and its weights' (from where it was loaded: `Model.source`), with its dtype.
    A model built by hand (no source) is fingerprinted by its config alone (weights_sha None)."""
    import jax

    cfg = dataclasses.asdict(model.config)
    leaves = jax.tree.leaves(model.params)
    source = getattr(model, "source", None) or {}
    return {"model_type": cfg.get("model_type"), "config_sha": _digest(cfg),
            "weights_sha": source.get("weights_sha"), "source": source.get("path") or source.get("kind"),
            "dtype": str(leaves[0].dtype) if leaves else None}


def make_provenance(model=None, *, same: dict | None = None, info: dict | None = None) -> dict:
    """A provenance: the model's fingerprint (when there is a model), the package version and `same` are
    compared on resume; `info` is recorded."""
    fixed = {"package_version": package_version()}
    if model is not None:
        fp = model_fingerprint(model)
        fixed["model"] = {k: fp[k] for k in ("model_type", "config_sha", "weights_sha")}
        fixed["dtype"] = fp["dtype"]
        info = {"model_source": fp["source"], "model_name": getattr(model, "name", None), **(info or {})}
    return {"same": json.loads(json.dumps({**fixed, **(same or {})}, default=str)),
            "info": json.loads(json.dumps(info or {}, default=str))}


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'field: old -> new' for every field of two provenances' ``same`` parts that differs (nested: a.b)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {_short(a)} -> {_short(b)}")
    return out


def _short(v) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check_same(path, held: dict | None, new: dict, how: str = "--resume"):
    """Refuses (ProvenanceMismatchError) adding to results whose provenance differs, naming each field."""
    if held is None:
        raise ProvenanceMismatchError(f"{path} records no provenance (written by an older kvoffload or by hand), "
                                      f"so {how} cannot tell whether its results match this run; use --overwrite "
                                      "or another --out")
    diff = differences(held.get("same", {}), new["same"])
    if diff:
        raise ProvenanceMismatchError(f"{how}: {path} holds results of a different run ({'; '.join(diff)}); "
                                      "use the same settings, --overwrite or another --out")
