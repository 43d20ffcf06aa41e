"""Which implementation an op runs: ``impl="auto" | "kernel" | "reference"`` (see the package's docstring)."""

from __future__ import annotations

from kvoffload.pallas import common as _c


IMPLS = ("auto", "kernel", "reference")


def kernel_default() -> bool:
    """Whether impl="auto" picks the Pallas kernels here (True on GPU)."""
    return _c.on_gpu()


def use_kernel(impl: str, supported: bool = True) -> bool:
    """Whether impl ("auto", "kernel", "reference") runs the Pallas kernel here: "auto" where supported on a GPU."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if impl == "kernel":
        return True
    return supported and _c.on_gpu()
