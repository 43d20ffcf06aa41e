"""Where a profiled decode step's device time goes, by the code's named scopes.

`jax.profiler` traces hold every executed program's optimized HLO (the "/host:metadata" plane) and, per kernel
or CPU thunk, the program it ran in and its HLO instruction (`hlo_op`) or kernel name. The runtime names its
parts with `jax.named_scope` (pipeline.layer_body: qkv, pool_attention, tail_attention, out_mlp; the policy's
attend inside pool_attention, e.g. clo's cache / retrieval / transfer / attention; embed, logits), and XLA keeps
the scope in each instruction's `op_name`. `scope_breakdown(trace)` sums each kernel's time under the scope of
the instruction that launched it: a fusion counts under its root's scope (the convention of XLA's own op
profile). A kernel inside a GPU command buffer names the buffer, not its instruction: it is found by its kernel
name (a fusion's, "." -> "_"; a Pallas kernel's `pallas_call` name; a cuBLAS GEMM as any GEMM), a name several
instructions share in the program's schedule order (`Cursor`); copies and memsets the buffer issues count as
"other", a kernel no instruction explains as "unattributed".

No protobuf package is needed: the trace's few messages are read with a minimal wire-format reader, the HLO
printed by the installed jaxlib."""

from __future__ import annotations

import collections
import glob
import os
import re
import sys

from kvoffload.hlo_text import FREE, computations, control_computations, instruction, op_name

# the Fig. 11 parts of the CLO paper, and the rest of a layer, by the scopes an op_name holds
# (first match wins; a scope path is the named scopes among SCOPES in the op_name, outermost first)
SCOPES = ("embed", "logits", "qkv", "pool_attention", "tail_attention", "out_mlp",
          "cache", "retrieval", "transfer", "attention", "scores", "select")
PARTS = (
    ("retrieval", ("pool_attention", "retrieval")),
    ("transfer", ("pool_attention", "transfer")),
    ("cache management", ("pool_attention", "cache")),
    ("attention", ("pool_attention",)),  # the pool's attention itself (clo: its "attention"; full: all of it)
    ("attention", ("tail_attention",)),
    ("projections and MLP", ("qkv",)),
    ("projections and MLP", ("out_mlp",)),
    ("embedding and logits", ("embed",)),
    ("embedding and logits", ("logits",)),
)


def scope_path(op_name: str) -> str:
    """The named scopes of SCOPES in an op_name ("jit(layer_body)/pool_attention/retrieval/while/body/..."
    -> "pool_attention/retrieval"); "" where it has none."""
    return "/".join(p for p in op_name.split("/") if p in SCOPES)


def part_of(path: str) -> str:
    """The Fig. 11 part (`PARTS`) of a scope path; "other" outside them (a loop's bookkeeping, copies)."""
    parts = set(path.split("/")) if path else set()
    for name, need in PARTS:
        if all(n in parts for n in need):
            return name
    return "other"


# -- the trace file ------------------------------------------------------------------------------


def _varint(buf, i):
    shift = r = 0
    while True:
        b = buf[i]
        i += 1
        r |= (b & 0x7F) << shift
        if b < 0x80:
            return r, i
        shift += 7


def _fields(buf):
    """(field, value) of a protobuf message: varints as int, length-delimited fields as bytes."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        f, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 2:
            ln, i = _varint(buf, i)
            v, i = buf[i:i + ln], i + ln
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"not a protobuf message (wire type {wire})")
        yield f, v


def trace_file(path: str) -> str:
    """The .xplane.pb of a trace directory (the newest), or path itself."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
        if not found:
            raise FileNotFoundError(f"no .xplane.pb under {path}")
        return found[-1]
    return path


def trace_programs(path: str) -> dict:
    """{program id: (module name, HLO text with op_name metadata and backend configs)} of the programs a
    trace ran (XSpace.planes[/host:metadata].event_metadata: one per program, its "Hlo Proto" stat)."""
    from jax._src.lib import xla_client as xc

    data = open(trace_file(path), "rb").read()
    out = {}
    for f, plane in _fields(data):
        if f != 1:  # XSpace.planes
            continue
        fields = list(_fields(plane))
        if [v for k, v in fields if k == 2] != [b"/host:metadata"]:
            continue
        stat_names = {}
        for k, v in fields:
            if k == 5:  # map<int64, XStatMetadata>
                entry = dict(_fields(v))
                md = dict(_fields(entry.get(2, b"")))
                stat_names[md.get(1)] = md.get(2, b"").decode()
        for k, v in fields:
            if k != 4:  # map<int64, XEventMetadata>
                continue
            md = list(_fields(dict(_fields(v)).get(2, b"")))
            stats = {stat_names.get(st.get(1)): st for st in (dict(_fields(x)) for n, x in md if n == 5)}
            if "Hlo Proto" not in stats or 6 not in stats["Hlo Proto"]:
                continue
            # the events' program_id (XStat uint64 / int64), else the metadata's own id
            pid = stats.get("program_id", {}).get(3, stats.get("program_id", {}).get(4))
            pid = pid if pid is not None else next((x for n, x in md if n == 1), None)
            out[pid] = _hlo_text(xc, dict(_fields(stats["Hlo Proto"][6]))[1])  # HloProto.hlo_module
    return out


def _hlo_text(xc, module_bytes: bytes):
    mod = xc.XlaComputation(module_bytes).get_hlo_module()
    opts = sys.modules[type(mod).__module__].HloPrintOptions()
    opts.print_metadata = True
    opts.print_backend_config = True
    return mod.name, mod.to_string(opts)


# -- the HLO -----------------------------------------------------------------------------------

_PALLAS = re.compile(r"([\w.\-]+)/pallas_call$")
_COPY = re.compile(r"^(memcpy|memset)", re.I)
_GEMM = re.compile(r"gemm|gemv|xmma|nvjet|cutlass|cublas", re.I)
_NO_KERNEL = FREE | {"while", "call", "conditional"}
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def _kernel_name(instr: str) -> str:
    """The GPU kernel XLA emits for a fusion instruction ("loop_add_fusion.1" -> "loop_add_fusion_1")."""
    return re.sub(r"[.\-]", "_", instr)


class ProgramScopes:
    """One program's instructions -> scope paths. A kernel finds its instruction by the event's `hlo_op`, else
    (inside a command buffer, whose events name the buffer) by its kernel name: a fusion's kernel is named after
    the fusion; a name several instructions share (one Pallas kernel used in several scopes, a cuBLAS GEMM) is
    matched in the program's schedule order, from the instruction the previous kernel of that buffer matched
    (`Cursor`): a command buffer runs its instructions in that order."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.by_instr, self.by_kernel_name, self.by_key = {}, {}, collections.defaultdict(set)
        inside = {}  # a fused computation's scope: that of its instructions (a fusion XLA made may carry none)
        for comp, lines in computations(text).items():
            paths = {scope_path(op) for op in map(op_name, lines) if op} - {""}
            inside[comp] = _common(paths) if paths else ""
        for line in text.splitlines():  # every instruction: a kernel may be named after one inside a wrapper
            ins = instruction(line)  # fusion (a sort's)
            if ins:
                op = op_name(line)
                called = _CALLS.search(line) if op is None else None
                path = scope_path(op) if op is not None else inside.get(called.group(1), "") if called else ""
                self.by_instr[ins[0]] = self.by_kernel_name[_kernel_name(ins[0])] = path
        # the kernels in schedule order: the computations the program steps through (the entry, while bodies
        # and conditions, branches; `hlo_text.control_computations`), not the fused ones
        self.sequence = []
        for lines in control_computations(text).values():
            for line in lines:
                ins = instruction(line)
                if not ins or ins[2] in _NO_KERNEL:
                    continue
                path, op = self.by_instr[ins[0]], op_name(line) or ""
                pallas = _PALLAS.search(op) if ins[2] == "custom-call" else None
                key = pallas.group(1) if pallas else ("GEMM" if ins[2] == "custom-call" and "cublas" in line
                                                      else _kernel_name(ins[0]))
                self.sequence.append((key, path))
                self.by_key[key].add(path)

    def scope_of(self, hlo_op: str | None, kernel: str, cursor: "Cursor | None" = None) -> str:
        """The scope path of a kernel (event name) launched for instruction hlo_op; "?" where unknown."""
        if hlo_op in self.by_instr:
            return self.by_instr[hlo_op]
        if _COPY.match(kernel):  # a copy or memset a command buffer issues: bookkeeping, no part of its own
            return ""
        key = "GEMM" if _GEMM.search(kernel) else re.sub(r"__\d+$", "", kernel)  # "__N": Triton's later kernels
        if kernel in self.by_kernel_name and len(self.by_key.get(kernel, ())) <= 1:
            if cursor is not None:
                cursor.find(kernel)
            return self.by_kernel_name[kernel]
        if cursor is not None:
            found = cursor.find(key)
            if found is not None:
                return found
        paths = self.by_key.get(key)
        return _common(paths) if paths else "?"


class Cursor:
    """A position in a program's kernel sequence, one per command buffer of a trace (`ProgramScopes.scope_of`)."""

    def __init__(self, program: ProgramScopes):
        self.seq, self.at = program.sequence, 0

    def find(self, key: str):
        """The path of the next instruction with this kernel key from the position (wrapping around: a loop's
        next iteration), the position then past it; None where none has it."""
        n = len(self.seq)
        for i in range(n):
            j = (self.at + i) % n
            if self.seq[j][0] == key:
                self.at = j + 1
                return self.seq[j][1]
        return None


def _common(paths) -> str:
    """The scope of several instructions: their common part ("pool_attention/retrieval" and
    "pool_attention/transfer" -> "pool_attention"), "?" where they share none."""
    if len(paths) == 1:
        return next(iter(paths))
    split = [p.split("/") if p else [] for p in paths]
    common = []
    for level in zip(*split):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return "/".join(common) if common else "?"


# -- the breakdown -------------------------------------------------------------------------------


def device_events(path: str):
    """(program id or None, module, hlo_op, kernel name, start ns, duration ns) of every event that ran in an
    XLA program: the GPU's kernels (device planes) or, on a CPU backend, its thunks."""
    import jax

    pd = jax.profiler.ProfileData.from_file(trace_file(path))
    gpu = any(p.name.startswith("/device:") for p in pd.planes)
    for plane in pd.planes:
        if plane.name == "/host:metadata" or (gpu and not plane.name.startswith("/device:")):
            continue
        for line in plane.lines:
            evs = sorted((x for x in ((e.start_ns, e.duration_ns, e.name, dict(e.stats)) for e in line.events)
                          if "hlo_module" in x[3]), key=lambda x: x[0])
            for i, (t, d, name, st) in enumerate(evs):
                # a thunk holding others (a CPU while's): its parts count. A GPU's kernels never nest (a stream's
                # neighbours may overlap by a few ns in the timestamps)
                if not gpu and i + 1 < len(evs) and evs[i + 1][0] < t + d:
                    continue
                pid = st.get("program_id")
                yield (int(pid) if pid is not None else None, str(st["hlo_module"]), st.get("hlo_op"), name, t, d)


KERNELS_LISTED = 40


def scope_breakdown(path: str, steps: int = 1) -> dict:
    """Device time per step of a trace of `steps` decode steps, by program and scope path, and the Fig. 11
    parts (`PARTS`): {"programs": {module: {"seconds": s, "scopes": {path: s}, "parts": {part: s}, "kernels":
    [[path, kernel, s, launches]] the KERNELS_LISTED longest (a scope's time kernel by kernel: which to fuse or
    rewrite)}}, "parts": {part: s}, "unattributed_s": s, "unattributed_kernels": the 10 longest unattributed
    kernels}. Times and launches per step."""
    progs = {pid: ProgramScopes(*nt) for pid, nt in trace_programs(path).items()}
    return attribute(device_events(path), progs, steps)


def attribute(events, programs: dict, steps: int = 1) -> dict:
    """`scope_breakdown` of events (`device_events`' tuples; a stream's in time order) against programs
    ({program id: ProgramScopes})."""
    progs = programs
    by_name = collections.defaultdict(list)
    for p in progs.values():
        by_name[p.name].append(p)
    out = collections.defaultdict(lambda: {"seconds": 0.0, "scopes": collections.Counter(),
                                           "parts": collections.Counter(), "kernels": collections.Counter(),
                                           "launches": collections.Counter()})
    total_parts, unattributed, lost, cursors = collections.Counter(), 0.0, collections.Counter(), {}
    for pid, module, hlo_op, kernel, _, dur in events:
        cands = [progs[pid]] if pid in progs else by_name.get(module, [])
        paths = {c.scope_of(hlo_op, kernel, cursors.setdefault((id(c), hlo_op), Cursor(c))) for c in cands} or {"?"}
        scope = next(iter(paths)) if len(paths) == 1 else _common(paths)
        s = dur * 1e-9 / steps
        rec = out[module]
        rec["seconds"] += s
        rec["scopes"][scope] += s
        rec["kernels"][(scope, kernel)] += s
        rec["launches"][(scope, kernel)] += 1 / steps
        part = part_of(scope) if scope != "?" else "unattributed"
        rec["parts"][part] += s
        total_parts[part] += s
        if scope == "?":
            unattributed += s
            lost[(module, str(hlo_op), kernel)] += s
    programs = {m: {"seconds": r["seconds"], "scopes": dict(r["scopes"].most_common()),
                    "parts": dict(r["parts"].most_common()),
                    "kernels": [[*key, t, r["launches"][key]] for key, t in r["kernels"].most_common(KERNELS_LISTED)]}
                for m, r in out.items()}
    return {"steps": steps, "programs": programs, "parts": dict(total_parts.most_common()),
            "unattributed_s": unattributed,
            "unattributed_kernels": [[*key, s] for key, s in lost.most_common(10)]}  # (module, hlo_op, kernel, s)
