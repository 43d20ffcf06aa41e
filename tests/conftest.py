import os
import sys

# Test this checkout's code even where another copy of kvoffload is installed (an editable install
# of a different clone, a GPU box running with PYTHONPATH unset).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

# Tests compare against float64/float32 references: keep XLA's CPU matmuls exact.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

try:  # property tests draw the same examples every run: a CI run cannot fail on a draw no other run made
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("kvoffload", derandomize=True)
    _hypothesis_settings.load_profile("kvoffload")
except ImportError:
    pass
