"""Import a script of benchmarks/ or experiments/ as a module, for the tests of that script."""

import contextlib
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIRS = (ROOT / "benchmarks", ROOT / "experiments")
# scripts import benchmarks/ modules by name (their folder, or one they put on sys.path, when run)
if str(DIRS[0]) not in sys.path:
    sys.path.insert(0, str(DIRS[0]))


@contextlib.contextmanager
def script_module(name: str):
    path = next((d / f"{name}.py" for d in DIRS if (d / f"{name}.py").exists()), None)
    if path is None:
        raise FileNotFoundError(f"no {name}.py in benchmarks/ or experiments/")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
