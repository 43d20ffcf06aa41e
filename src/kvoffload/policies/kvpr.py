"""`kvpr`: KV cache and attention-input activations X in pinned host memory. For layer i+1, X[0:l]
and K/V[l:s] are fetched while layer i computes; K/V[0:l] are recomputed on the GPU (X W_K, X W_V)
and attention runs over both parts merged by log-sum-exp. l comes from the split-point scheduler
(plan/split.py) for each step, or is forced with split_point."""

from __future__ import annotations

from kvoffload.policies.base import register_policy
from kvoffload.policies.offload import _OffloadBase


@register_policy("kvpr")
class KVPRPolicy(_OffloadBase):
    kvpr = True
