"""What the tests and the kernel checks share: correctness checks of every kernel and reference against float64
NumPy. Sits above the library (it may import any of it); nothing in the library imports it.

Used by tests/test_kernels*.py (CPU: references, and kernels with interpret=True) and by
benchmarks/check_kernels.py (GPU: compiled Triton kernels). Each ``check_*`` draws fresh random inputs (never
zeros), runs one implementation and returns a dict with the relative error(s) and pass/fail. Kernel outputs are
poisoned (NaN-initialised via aliasing) so unwritten elements fail. mode: "reference" (pure jnp), "kernel"
(compiled Pallas), "interpret" (Pallas interpret).

oracles.py (the float64 references, the errors against them, the result dict); one module of checks per kernel
family: attention.py, selection.py (scores and top-k), rows.py (quantization, gathers, refills), linear.py (K/V
recompute, stacked linear); cases.py (the case tables and run_case).
"""
