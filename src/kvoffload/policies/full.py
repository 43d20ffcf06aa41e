"""`full`: the whole KV cache on the device. The reference every other policy is compared with.

It is the layer pipeline with the block pool in device memory: the same attention programs over the
same blocks in the same order as the offloading policies, so `offload` equals it bit for bit."""

from __future__ import annotations

from kvoffload.policies.base import register_policy
from kvoffload.policies.layered import LayeredPolicy


@register_policy("full")
class FullPolicy(LayeredPolicy):
    host_pool = False
    streams_weights = False  # weights and K/V on the device
