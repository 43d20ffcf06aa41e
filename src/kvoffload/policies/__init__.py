"""KV policies: full (dense on GPU), offload, kvpr, ... Each registers itself by name."""

from kvoffload.policies.base import Policy, available_policies, make_policy, register_policy

__all__ = ["Policy", "available_policies", "make_policy", "register_policy"]
