import os

# Tests compare against float64/float32 references: keep XLA's CPU matmuls exact.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
