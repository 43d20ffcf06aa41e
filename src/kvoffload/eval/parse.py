"""What an evaluation run is asked, parsed: the policies (PolicySpec: a registry name, options, a label), the
lengths, the seeds; counts checked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["PolicySpec", "parse_policies", "parse_lengths", "parse_seeds", "as_specs", "check_count"]


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


def as_specs(policies) -> list[PolicySpec]:
    if isinstance(policies, str) or (isinstance(policies, (list, tuple)) and policies and isinstance(policies[0], str)):
        return parse_policies(policies)
    return list(policies)


def check_count(n, what: str):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what} must be a whole number >= 1, got {n!r}")
