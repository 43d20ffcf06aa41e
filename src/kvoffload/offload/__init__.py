"""Host offloading: memory kinds and transfers (memory.py), the paged block pool (pool.py) and the
layer pipeline every pool policy runs on (pipeline.py). Planning (pool sizes, memory checks, cost
model, schedulers) lives in kvoffload.plan."""

from kvoffload.offload.memory import (  # noqa: F401
    HOST_LIMIT_ENV,
    available_device_bytes,
    available_host_bytes,
    host_memory_kind,
    host_pool_cap_bytes,
    to_device,
    to_host,
)

__all__ = ["HOST_LIMIT_ENV", "available_device_bytes", "available_host_bytes", "host_memory_kind", "host_pool_cap_bytes",
           "to_device", "to_host"]
