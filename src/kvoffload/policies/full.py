"""`full`: the dense KV cache on the device. The reference every other policy is compared with."""

from __future__ import annotations

from kvoffload.models.transformer import dense_cache_from_prefill, dense_decode_step, prefill
from kvoffload.policies.base import Policy, register_policy


@register_policy("full")
class FullPolicy(Policy):
    def prefill(self, model, tokens, lengths, capacity):
        logits, ks, vs, _ = prefill(model.config, model.params, tokens, lengths)
        return logits, dense_cache_from_prefill(ks, vs, lengths, capacity)

    def decode_step(self, model, state, tokens):
        return dense_decode_step(model.config, model.params, state, tokens)
