"""Reading XLA's optimized HLO text (a dump's `*after_optimizations.txt`, or `Compiled.as_text()`): its
computations, their instructions' names, result shapes, opcodes and op_names, and an array result's bytes. Used
by `experiments/count_layer_kernels.py` and `kvoffload.profile`."""

from __future__ import annotations

import math
import re

# instructions that launch nothing
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^%?([\w.\-]+) \(.*\{$")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
             "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def instruction(line: str):
    """(name, result shape text, opcode) of an instruction line, or None."""
    m = _INSTRUCTION.match(line)
    return m.groups() if m else None


def op_name(line: str):
    """An instruction line's `op_name` metadata ("jit(f)/scope/.../primitive"), or None."""
    m = _OP_NAME.search(line)
    return m.group(1) if m else None


def array_bytes(result: str):
    """(bytes, "dtype[dims]") of an array result shape ("bf16[1,8,64]{2,1,0}"); None for a tuple or an
    unknown element type."""
    m = _ARRAY.match(result)
    if not m or m.group(1) not in _ITEMSIZE:
        return None
    n = math.prod(int(d) for d in m.group(2).split(",") if d)
    return n * _ITEMSIZE[m.group(1)], m.group(0)


def entry_lines(text: str) -> list[str]:
    """The lines of the module's ENTRY computation."""
    start = text.find("\nENTRY")
    if start < 0:
        return []
    body = text[start + 1:]
    end = body.find("\n}")
    return body[:end].splitlines()[1:] if end >= 0 else body.splitlines()[1:]


def computations(text: str) -> dict:
    """{computation name: its lines} of every non-entry computation (fused computations, regions)."""
    out, name = {}, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith("ENTRY"):
            name, out[m.group(1)] = m.group(1), []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


_CONTROL = re.compile(r"\b(?:body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def control_computations(text: str) -> dict:
    """{name: lines} of the computations the program steps through itself: the entry and, from it, every while
    loop's body and condition and every conditional's branches (recursively). Fused computations (a kernel's
    inside, named by `calls=`) and reductions' `to_apply` are not among them: their values never reach memory."""
    comps = computations(text)
    out, todo = {"ENTRY": entry_lines(text)}, ["ENTRY"]
    while todo:
        for line in out[todo.pop()]:
            names = _CONTROL.findall(line)
            for group in _BRANCHES.findall(line):
                names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
            for n in names:
                if n in comps and n not in out:
                    out[n] = comps[n]
                    todo.append(n)
    return out


def large_writes(text: str, min_bytes: int = 1 << 20, opcodes=None) -> list[str]:
    """Instructions of the program's own computations (`control_computations`) whose array result is at least
    min_bytes, as "opcode dtype[dims] MiB (name in computation) op_name": the copies and slices a program writes
    out, e.g. a loop over stacked layers copying a layer's slice of a stacked array before a kernel reads it (in
    the loop's body, not the entry). opcodes: only these (e.g. {"copy", "dynamic-update-slice"}: what copy
    insertion added, with the jax op it came from if any)."""
    out = []
    for comp, lines in control_computations(text).items():
        for line in lines:
            ins = instruction(line)
            if ins and opcodes is not None and ins[2] not in opcodes:
                continue
            size = ins and ins[2] not in FREE and array_bytes(ins[1])
            if size and size[0] >= min_bytes:
                where = op_name(line)
                out.append(f"{ins[2]} {size[1]} {size[0] / 2**20:.3f} MiB ({ins[0]} in {comp})"
                           + (f" {where}" if where else ""))
    return out
