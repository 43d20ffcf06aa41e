"""The import rules in pyproject.toml ([tool.importlinter]: the layers, the runtime naming no policy, the kernels
knowing no model, no cycle inside a package) hold for this checkout's sources, function-level imports included;
every module sits in a declared layer; and no module-level import cycle exists anywhere in the package."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("importlinter")
grimp = pytest.importorskip("grimp")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
# package modules whose own __init__ imports nothing: a layer cannot name them (they hold every layer)
UNLAYERED = {"kvoffload", "kvoffload.offload", "kvoffload.runtime"}


def _graph():
    sys.path.insert(0, SRC)  # this checkout's sources, whatever kvoffload is installed
    try:
        return grimp.build_graph("kvoffload", cache_dir=None)
    finally:
        sys.path.remove(SRC)


def _layer_modules() -> list[str]:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [m.strip() for layer in layers for m in layer.replace(":", "|").split("|")]


def test_import_contracts():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())", "--no-cache", "--config",
                          os.path.join(ROOT, "pyproject.toml")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"import contracts broken:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout, run.stdout


def test_every_module_in_a_layer():
    layered = _layer_modules()
    graph = _graph()
    loose = sorted(m for m in graph.modules - UNLAYERED
                   if not any(m == top or m.startswith(top + ".") for top in layered))
    assert not loose, f"modules in no layer of pyproject.toml's layers contract: {loose}"


def test_no_import_cycle():
    """Tarjan's strongly connected components over every module-level import edge of the package."""
    graph = _graph()
    succ = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in succ[v]:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(succ)))
    for m in sorted(succ):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"
