"""`offload`: the whole KV cache in the pinned-host block pool; layer i+1's extents are fetched while
layer i computes (the FlexGen / HF-offload baseline, done well). The default hooks of the layer
pipeline are exactly this policy."""

from __future__ import annotations

from kvoffload.policies.base import register_policy
from kvoffload.policies.layered import LayeredPolicy
from kvoffload.policies.options import Option


@register_policy("offload")
class OffloadPolicy(LayeredPolicy):
    host_pool = True
    host_dtypes = ("native", "int4")
    hook_options = (Option("split_point", "int", "only 0 (offload fetches all K/V; kvpr takes other split points)",
                           low=0),)

    def make_hooks(self, split_point=None):
        if split_point is not None and int(split_point) != 0:
            raise ValueError("policy 'offload' fetches all K/V (split point 0); use policy 'kvpr' for split points")
        return super().make_hooks()
