"""Typed policy options: one declaration per option (name, kind, range or choices, one-line help) that the
CLI, the library (`make_policy`, `generate(policy_options=...)`) and docs/USER_ERRORS.md all read.

Values come as strings from the command line (`--policy-option k=v`, eval specs `name:k=v`) or as Python
values from the library; both go through `Option.parse`, which returns a value of the declared kind or
raises one `PolicyOptionError` naming the option. Parsing is idempotent (a parsed value parses to itself),
so the CLI can check options before the model loads and the policy can check them again when built.
Defaults are not declared here: they are the defaults of the code that uses them (`PipelineOptions`' fields,
a policy's `make_hooks` signature), read by `LayeredPolicy.option_schema`, so there is one place for each.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from kvoffload.errors import KVOffloadError

# what a string must read as for a boolean option (case-insensitive); anything else is refused, so that
# "no" or "off" never counts as true (a non-empty string is truthy in Python)
TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")
NONE_WORDS = ("none", "null")
_INT_RE = re.compile(r"[+-]?\d+")
KINDS = ("bool", "int", "float", "choice", "path", "floats", "pairs", "object", "any")


class PolicyOptionError(KVOffloadError, ValueError):
    """A policy option that is unknown, given twice, or whose value is not of its kind or out of its range."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


@dataclasses.dataclass(frozen=True)
class Option:
    """One policy option. kind: bool | int | float | choice (one of `choices`) | path (a file name) | floats
    (a number or a list of numbers, each in range) | pairs (one of `choices` or a list of [int, int]) | object
    (a Python object, library only). low / high: inclusive bounds unless low_open / high_open. words: strings
    an int or float option also takes (gpu_blocks=auto). Every option takes None ("none" on the command line):
    unset, i.e. its default. default: filled in from the code that uses it."""

    name: str
    kind: str
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    words: tuple = ()
    default: Any = None

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    # -- describing ---------------------------------------------------------------------------------------
    def range_text(self) -> str:
        """What the option takes, in words (error messages and the docs' table)."""
        if self.kind == "bool":
            text = "true or false (also 1/0, yes/no)"
        elif self.kind in ("choice",):
            text = "one of " + ", ".join(self.choices)
        elif self.kind == "pairs":
            text = "one of " + ", ".join(self.choices) + " or a list of [layer, kv_head] pairs"
        elif self.kind == "path":
            text = "a file or directory path"
        elif self.kind == "object":
            text = "a Python object (library only)"
        elif self.kind == "any":
            text = "any value (the policy checks it)"
        else:
            what = {"int": "an integer", "float": "a finite number", "floats": "a number or a list of numbers"}
            text = what[self.kind] + self._bounds_text()
            if self.words:
                text += " or " + ", ".join(self.words)
        return text

    def _bounds_text(self) -> str:
        lo, hi = self.low, self.high
        fmt = (lambda v: str(int(v)) if float(v).is_integer() else str(v))
        if lo is not None and hi is not None:
            return f" in {'(' if self.low_open else '['}{fmt(lo)}, {fmt(hi)}{')' if self.high_open else ']'}"
        if lo is not None:
            return f" {'>' if self.low_open else '>='} {fmt(lo)}"
        if hi is not None:
            return f" {'<' if self.high_open else '<='} {fmt(hi)}"
        return ""

    # -- parsing ------------------------------------------------------------------------------------------
    def parse(self, value, policy: str = "", spelled: str | None = None, error=None):
        """value (a string from the command line or a Python value) -> a value of this option's kind, or
        one PolicyOptionError (error: the policy's subclass) naming the option. spelled: how the user wrote it
        (a flag such as --split-point)."""
        if isinstance(value, str) and self.kind not in ("choice", "path", "pairs", "any"):
            value = value.strip()
        if isinstance(value, str) and (value in self.words or value in self.choices):
            return value  # before the none words: persistent_heads=none is a choice, not "unset"
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS):
            return None  # unset: the option's default
        parsed = getattr(self, f"_parse_{self.kind}")(value)
        if parsed is _BAD:
            who = f"policy {policy!r} option {spelled or self.name}" if policy else f"option {spelled or self.name}"
            raise (error or PolicyOptionError)(f"{who} must be {self.range_text()}, got {_show(value)}", self.name)
        return parsed

    def _in_range(self, v: float) -> bool:
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        return not (self.high is not None and (v > self.high or (self.high_open and v == self.high)))

    def _parse_bool(self, v):
        if isinstance(v, str):
            w = v.strip().lower()
            return True if w in TRUE_WORDS else False if w in FALSE_WORDS else _BAD
        if isinstance(v, bool) or type(v).__name__ == "bool_":  # numpy's bool
            return bool(v)
        if _is_number(v) and v in (0, 1):
            return bool(v)
        return _BAD

    def _parse_int(self, v):
        if isinstance(v, str):
            if not _INT_RE.fullmatch(v):
                return _BAD
            v = int(v)
        elif _is_number(v) and not isinstance(v, int):
            f = float(v)
            if not (math.isfinite(f) and f.is_integer()):  # 64.5 is not an integer: refused, not rounded
                return _BAD
            v = int(f)
        elif not isinstance(v, int) or isinstance(v, bool):
            return _BAD
        return int(v) if self._in_range(v) else _BAD

    def _parse_float(self, v):
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                return _BAD
        elif not _is_number(v):
            return _BAD
        f = float(v)
        return f if math.isfinite(f) and self._in_range(f) else _BAD

    def _parse_choice(self, v):
        return v if isinstance(v, str) and v in self.choices else _BAD

    def _parse_path(self, v):
        if isinstance(v, os.PathLike):
            v = os.fspath(v)
        return v if isinstance(v, str) and v else _BAD

    def _parse_floats(self, v):
        if isinstance(v, str):
            v = _json_or_bad(v) if v.startswith("[") else v
            if v is _BAD:
                return _BAD
        if isinstance(v, (list, tuple)) or type(v).__name__ == "ndarray":
            items = [self._parse_float(x) for x in list(v)]
            return _BAD if not items or any(x is _BAD for x in items) else items
        return self._parse_float(v)

    def _parse_pairs(self, v):
        if isinstance(v, str):
            if v in self.choices:
                return v
            v = _json_or_bad(v) if v.startswith("[") else _BAD
        if isinstance(v, (list, tuple)):
            pairs = []
            for p in v:
                if not isinstance(p, (list, tuple)) or len(p) != 2 or not all(_is_whole(x) and x >= 0 for x in p):
                    return _BAD
                pairs.append((int(p[0]), int(p[1])))
            return pairs
        return _BAD

    def _parse_any(self, v):
        return v  # an option of a policy without a schema: the policy checks it

    def _parse_object(self, v):
        return _BAD if isinstance(v, str) else v  # a string cannot be an object (a mesh comes from the library)


_BAD = object()  # a parse that failed (None is a legal value: unset)


def _is_number(v) -> bool:
    """A real number: Python's int / float or a numpy scalar of an integer or float dtype (not a bool)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    dtype = getattr(v, "dtype", None)
    return dtype is not None and getattr(v, "ndim", None) == 0 and dtype.kind in "iuf"


def _is_whole(v) -> bool:
    return _is_number(v) and math.isfinite(float(v)) and float(v).is_integer()


def _json_or_bad(s: str):
    import json

    try:
        return json.loads(s)
    except ValueError:
        return _BAD


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_options(policy: str, schema: dict[str, Option], given, spelled: dict | None = None, error=None) -> dict:
    """The options `given` (a dict, or a list of (name, value) pairs as the command line has them), each
    parsed by its declaration; those set to None (unset) left out. Refuses an option the policy does not take
    (naming what it takes) and one given twice. spelled: how the user wrote each name (e.g. split_point ->
    --split-point), for messages. error: the PolicyOptionError subclass the policy raises."""
    spelled = spelled or {}
    error = error or PolicyOptionError
    items = list(given.items()) if isinstance(given, dict) else list(given)
    seen: dict[str, Any] = {}
    unknown = []
    for name, value in items:
        if name in seen:
            raise error(f"policy {policy!r} option {spelled.get(name, name)} is given twice "
                                    f"({_show(seen[name])} and {_show(value)}); give it once", name)
        seen[name] = value
        if name not in schema:
            unknown.append(name)
    if unknown:
        takes = "options " + ", ".join(sorted(schema)) if schema else "no options"
        raise error(f"policy {policy!r} takes {takes}; got unknown option {', '.join(spelled.get(k, k) for k in unknown)}",
                    unknown[0])
    parsed = {name: schema[name].parse(value, policy, spelled.get(name), error) for name, value in seen.items()}
    return {k: v for k, v in parsed.items() if v is not None}  # None: unset, the default applies
