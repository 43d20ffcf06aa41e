"""How many kernels each layer program launches, and from which part of the code.

Where a decode step is host-bound (HATA, Qwen2.5-7B, 32K: see BENCHMARKS), the host's time follows the
number of kernels a layer program launches, so that number is the one to drive down. This reads an XLA dump
(`--xla_dump_to=DIR --xla_dump_hlo_as_text`) and counts, in each compiled module whose name matches, the
instructions of its entry computation that launch work: fusions, custom calls (Pallas / Triton kernels, cuBLAS),
copies and any other op that is not free (parameters, constants, tuples and bitcasts are). It groups them by
opcode and by the source scope in their `op_name` metadata (named scopes, inner jits, Pallas kernel names), and
lists every launch with its result shape and the source lines it came from (the dump's stack frames; for a
fusion, those of every op fused into it): which lines of the code to change to cut a launch (`--list`).

    # run a benchmark under the dump flags, then count (GPU: the counts the host pays for)
    PYTHONPATH=src python experiments/count_layer_kernels.py --out $OUT/kernels.json --run \\
        "python benchmarks/bench_selection.py --only clo_hata:32k:1 --steps 1 --warmup 1 --no-extremes"
    # or count an existing dump
    python experiments/count_layer_kernels.py DUMP_DIR

On the CPU the same dump counts XLA:CPU's fusions, which differ from the GPU's: compare counts on one backend.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from kvoffload.hlo_text import FREE, computations, entry_lines, instruction, op_name  # noqa: E402

_FILE = re.compile(r"^module_(\d+)\.(.+?)\.(?:sm_[\w.]+_gpu_|cpu_|)after_optimizations\.txt$")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _table(text: str, name: str) -> dict:
    """{id: {key: value}} of one of the dump's source tables (FileNames, FunctionNames, FileLocations,
    StackFrames): lines `ID "name"` or `ID {key=value ...}` after a line holding the table's name."""
    out, inside = {}, False
    for line in text.splitlines():
        if line == name:
            inside = True
            continue
        if inside:
            m = re.match(r'^(\d+) (.*)$', line)
            if not m:
                break
            body = m.group(2)
            if body.startswith('"'):
                out[int(m.group(1))] = body.strip('"')
            else:
                out[int(m.group(1))] = dict(re.findall(r'(\w+)=("[^"]*"|[^ }]+)', body))
    return out


def source_lines(text: str) -> dict:
    """{stack frame id: "file.py:line (function)"}, the innermost frame of each (JAX records the caller's
    frames, its own filtered out)."""
    files, funcs = _table(text, "FileNames"), _table(text, "FunctionNames")
    locs, frames = _table(text, "FileLocations"), _table(text, "StackFrames")
    out = {}
    for fid, fr in frames.items():
        loc = locs.get(int(fr.get("file_location_id", -1)))
        if not loc:
            continue
        path = files.get(int(loc.get("file_name_id", -1)), "?")
        func = funcs.get(int(loc.get("function_name_id", -1)), "?")
        out[fid] = f"{os.path.basename(path)}:{loc.get('line', '?')} ({func})"
    return out


def scope_of(op_name: str) -> str:
    """The source scope of an op: its op_name without the module's own jit(...) and the final primitive
    ("jit(layer_body)/kvo_select_count/pallas_call" -> "kvo_select_count"); the primitive alone at top level."""
    parts = op_name.split("/")
    if parts and parts[0].startswith("jit("):
        parts = parts[1:]
    return "/".join(parts[:-1]) or (parts[-1] if parts else "")


def _sources(lines, frames: dict) -> list[str]:
    """The distinct source lines of these instructions, in order of first appearance."""
    seen = {}
    for line in lines:
        f = _FRAME_ID.search(line)
        if f and int(f.group(1)) in frames:
            seen.setdefault(frames[int(f.group(1))], None)
    return list(seen)


def count_module(text: str) -> dict:
    """{"launches": n, "by_opcode": {...}, "by_scope": {...}, "launch_list": [...]} for one module's optimized
    HLO text; launch_list: per launch its opcode, result shape, scope and source lines (a fusion's: its fused
    ops' too)."""
    by_op, by_scope = collections.Counter(), collections.Counter()
    frames, comps = source_lines(text), computations(text)
    listed = []
    for line in entry_lines(text):
        ins = instruction(line)
        if not ins or ins[2] in FREE:
            continue
        _, result, op = ins
        name = op_name(line)
        scope = scope_of(name) if name is not None else f"({op}, no op_name)"
        by_op[op] += 1
        by_scope[scope] += 1
        called = _CALLS.search(line)
        body = comps.get(called.group(1), []) if called and op == "fusion" else []
        listed.append({"opcode": op, "shape": result, "scope": scope,
                       "sources": _sources([line] + body, frames)})
    return {"launches": sum(by_op.values()), "by_opcode": dict(by_op.most_common()),
            "by_scope": dict(by_scope.most_common()), "launch_list": listed}


def count_dump(dump_dir: str, module_re: str = ".*layer.*") -> list[dict]:
    """One record per optimized module in dump_dir whose name matches module_re, in compilation order."""
    pat = re.compile(module_re)
    out = []
    for f in sorted(os.listdir(dump_dir)):
        m = _FILE.match(f)
        if not m or not pat.search(m.group(2)):  # as XLA matches --xla_dump_hlo_module_re
            continue
        with open(os.path.join(dump_dir, f)) as fh:
            out.append({"module": m.group(2), "id": int(m.group(1)), "file": f, **count_module(fh.read())})
    return sorted(out, key=lambda r: r["id"])


def table(records: list[dict], top: int = 12, listing: bool = False) -> str:
    lines = []
    for r in records:
        ops = ", ".join(f"{k} {v}" for k, v in r["by_opcode"].items())
        lines.append(f"{r['module']} (module {r['id']}): {r['launches']} launches ({ops})")
        for scope, n in list(r["by_scope"].items())[:top]:
            lines.append(f"  {n:4d}  {scope}")
        if listing:
            for n, launch in enumerate(r.get("launch_list", [])):
                where = "; ".join(launch["sources"][:4]) + (" ..." if len(launch["sources"]) > 4 else "")
                lines.append(f"    #{n:<3d} {launch['opcode']:<12s} {launch['shape'][:48]:<48s} {where}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", nargs="?", help="an XLA dump directory (with --run: where to dump; default a temp dir)")
    ap.add_argument("--run", help="a command to run under the dump flags first (its own output is shown)")
    ap.add_argument("--modules", default=".*layer.*", help="regex on the module name (jit_<function>)")
    ap.add_argument("--top", type=int, default=12, help="scopes listed per module")
    ap.add_argument("--list", action="store_true", help="also list every launch: shape and source lines")
    ap.add_argument("--out", help="JSON path")
    args = ap.parse_args(argv)
    if args.run is None and args.dump is None:
        ap.error("give a dump directory, or --run COMMAND")
    dump = args.dump or tempfile.mkdtemp(prefix="kvoffload-dump-")
    if args.run is not None:
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={args.modules}"
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        rc = subprocess.run(shlex.split(args.run), env=env).returncode
        if rc:
            raise SystemExit(f"count_layer_kernels: the command exited with {rc}: {args.run}")
    if not os.path.isdir(dump):
        raise SystemExit(f"count_layer_kernels: no dump directory {dump}")
    records = count_dump(dump, args.modules)
    if not records:
        raise SystemExit(f"count_layer_kernels: no optimized module matching {args.modules!r} in {dump}")
    print(table(records, args.top, args.list))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dump": dump, "command": args.run, "modules": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
