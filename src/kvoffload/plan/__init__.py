"""Planning: the profiler (measures the machine), cost-model fits, and the KVPR split-point scheduler."""

from kvoffload.plan.cost import CostModel, LayerShape, Linear, layer_terms, predict_step  # noqa: F401
from kvoffload.plan.split import SplitPlan, SplitProblem, brute_force, bucket_candidates, choose_split  # noqa: F401

__all__ = ["CostModel", "LayerShape", "Linear", "layer_terms", "predict_step", "SplitPlan", "SplitProblem", "brute_force",
           "bucket_candidates", "choose_split"]
