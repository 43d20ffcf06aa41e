"""Planning: the profiler (measures the machine), cost-model fits, memory planning of the block pool,
and the schedulers (KVPR's split point)."""

from kvoffload.plan.cost import CostModel, LayerShape, LayerWork, Linear, layer_terms, predict_layers, predict_step  # noqa: F401
from kvoffload.plan.memory import (  # noqa: F401
    MemoryPlan,
    MemoryPlanError,
    PoolPlan,
    check_memory,
    check_pool,
    plan_pool,
    pool_memory,
    weight_bytes,
)
from kvoffload.plan.split import SplitPlan, choose_split, no_recompute_reason  # noqa: F401

__all__ = ["CostModel", "LayerShape", "LayerWork", "Linear", "layer_terms", "predict_layers", "predict_step", "MemoryPlan",
           "MemoryPlanError", "PoolPlan", "check_memory", "check_pool", "plan_pool", "pool_memory", "weight_bytes",
           "SplitPlan", "choose_split", "no_recompute_reason"]
