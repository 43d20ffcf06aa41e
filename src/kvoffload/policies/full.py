"""`full`: the dense KV cache on the device. The reference every other policy is compared with."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvoffload.models.transformer import DenseKVCache, dense_cache_from_prefill, dense_decode, prefill
from kvoffload.policies.base import Policy, register_policy


@dataclasses.dataclass
class FullState:
    cache: DenseKVCache
    tail_count: int = 0  # tokens in the cache's tail, tracked on the host


@register_policy("full")
class FullPolicy(Policy):
    def prefill(self, model, tokens, lengths, capacity):
        logits, ks, vs = prefill(model.config, model.params, tokens, lengths)
        return logits, FullState(dense_cache_from_prefill(ks, vs, lengths, capacity))

    def decode_step(self, model, state: FullState, tokens) -> tuple[Any, FullState]:
        logits, cache, n = dense_decode(model.config, model.params, state.cache, tokens, state.tail_count)
        return logits, FullState(cache, n)
