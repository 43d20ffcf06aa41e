"""What the tests and the kernel checks share: float64 oracles and kernel case tables (checks.py). Sits above the
library (it may import any of it); nothing in the library imports it."""
