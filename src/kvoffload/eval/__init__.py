"""Accuracy evaluation: RULER, LongBench, perplexity, run over any list of KV policies.

Entry points: :func:`cli_main` (``kvoffload eval ruler|longbench|ppl ...``),
:func:`run_ruler`, :func:`run_longbench`, :func:`run_perplexity`. Submodules:
``ruler`` (NVIDIA's generators), ``longbench`` (official format, prompts, budgets),
``metrics`` (RULER string match, LongBench metrics), ``perplexity`` (sliding window),
``report`` (tables, plot), ``runner`` (the runs) and its parts ``parse`` (policies, lengths,
seeds), ``generation`` (prompt format, batched generation) and ``results`` (results file, resume, progress).
"""

from kvoffload.eval.cli import add_eval_arguments, cli_main, run_from_args
from kvoffload.eval.parse import PolicySpec, parse_lengths, parse_policies
from kvoffload.eval.results import EvalResult
from kvoffload.eval.runner import run_longbench, run_perplexity, run_ruler

__all__ = [
    "cli_main",
    "add_eval_arguments",
    "run_from_args",
    "run_ruler",
    "run_longbench",
    "run_perplexity",
    "parse_policies",
    "parse_lengths",
    "PolicySpec",
    "EvalResult",
]
