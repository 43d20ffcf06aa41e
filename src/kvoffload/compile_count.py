"""Counting XLA compilations, to check that a decode loop reuses its programs.

    with count_compilations() as compiled:
        generate(...)
    print(compiled.count, compiled.names)

JAX reports each backend (XLA) compilation through `jax.monitoring` as a duration event
(`/jax/core/compile/backend_compile_duration`, fired once per compiled program, eager
primitives included; a program found in the persistent compilation cache still fires it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

from jax import monitoring

# The name JAX 0.4-0.11 gives the event (jax._src.dispatch.BACKEND_COMPILE_EVENT); read from JAX
# when it is there so a rename cannot silently turn every count into zero.
try:
    from jax._src.dispatch import BACKEND_COMPILE_EVENT
except ImportError:  # pragma: no cover - a JAX that moved the constant
    BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCount:
    """Compilations seen so far inside `count_compilations`: how many, and the compiled
    functions' names in order (jit_<function name> for jitted functions)."""

    names: list[str] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def count(self) -> int:
        return len(self.names)

    def _record(self, event: str, duration_secs: float, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self.names.append(str(kwargs.get("fun_name", "?")))


@contextlib.contextmanager
def count_compilations():
    """Yields a CompileCount that counts every XLA compilation until the block ends (process-wide:
    compilations of other threads count too)."""
    counter = CompileCount()
    monitoring.register_event_duration_secs_listener(counter._record)
    try:
        yield counter
    finally:
        monitoring.unregister_event_duration_listener(counter._record)
