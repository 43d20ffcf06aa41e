"""Host offloading: memory kinds and transfers (memory.py), the host store (store.py), the memory
planner (planner.py), and the layer-by-layer decode runtime with row / column schedules and weight
streaming (runtime.py) behind the `offload` and `kvpr` policies."""

from kvoffload.offload.memory import (  # noqa: F401
    HOST_LIMIT_ENV,
    available_device_bytes,
    available_host_bytes,
    host_memory_kind,
    host_pool_cap_bytes,
    to_device,
    to_host,
)
from kvoffload.offload.planner import MemoryPlan, MemoryPlanError, check_memory, plan_memory, weight_bytes  # noqa: F401

__all__ = ["HOST_LIMIT_ENV", "available_device_bytes", "available_host_bytes", "host_memory_kind", "host_pool_cap_bytes",
           "to_device", "to_host", "MemoryPlan", "MemoryPlanError", "check_memory", "plan_memory", "weight_bytes"]
