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


# Run with `-m slow` rather than by default, to keep the default run within 10 minutes on 2 cores. The value
# says what of the idea stays in the default run; "slow only" marks a check no default test repeats (its other
# variants are slow already): run `python -m pytest -m slow` after changing what it covers.
SLOW_VARIANTS = {
    "tests/test_hybrid.py::test_matches_full[opt-5]": "slow only: one request per mini-batch (the other splits stay)",
    "tests/test_offload.py::test_matches_full[opt-offload-6]": "[opt-offload-0]; the column schedule: slow only",
    "tests/test_eval_runner.py::test_ruler_records_selection_hit_rates[clo:topk=64,num_recent=16,eta=0.5,"
    "speculative_prefetch=true]": "slow only (the tokenselect case is slow too)",
    "tests/test_long_context.py::test_bench_long_context_with_random_prefill_decodes_and_says_so":
        "test_random_kv_prefill_takes_the_pipelines_layer_prefill_arguments",
    "tests/test_gemma3.py::test_policies_match_full[kvpr-2]": "[kvpr-4], [kvpr-5]",
    "tests/test_gemma3.py::test_full_policy_matches_transformers_greedy":
        "test_logits_match_transformers, test_dense_decode_matches_transformers",
    "tests/test_clo.py::test_quest_int4_v_rows_with_native_or_int8_keys[int8]": "slow only ([native] is slow too)",
    "tests/test_kernels.py::test_top_count_ascending_methods_against_numpy[normal]":
        "[ties], [infinities], [signed_zeros]",
    "tests/test_int4_pool.py::test_int4_logits_stay_near_native[kvpr-scheduler]": "[offload]; kvpr int4: slow only",
    "tests/test_int4_pool.py::test_int4_k_quant_native_or_int8_keys_and_their_bytes[native]": "[int8]",
    "tests/test_tokenselect_extrapolation.py::test_inside_the_window_same_tokens_as_without[20-10]":
        "slow only ([40-8] is slow too)",
    "tests/test_profile.py::test_a_traced_program_splits_by_its_named_scopes": "slow only",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
