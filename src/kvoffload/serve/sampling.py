"""Per-request sampling inside one batch: each row its own temperature, top-k, top-p and seed.

`models.sampling.sample` takes one setting for the whole batch as static arguments; a continuous batch
mixes requests, so here the settings are arrays. Greedy rows take the argmax of the raw logits, as
`sample` does, so a greedy request gets `generate`'s tokens whatever it is batched with. A sampled row's key
is fold_in(key(seed), its token index): its tokens depend on its seed only, not on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from kvoffload.errors import ServeError
from kvoffload.models.sampling import SamplingParameterError, check_sampling


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)  # strings that end the output (not included)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def checked(self, vocab_size: int) -> "SamplingParams":
        """These parameters validated (one ServeError naming the bad one)."""
        try:
            t, k, p = check_sampling(self.temperature, self.top_k, self.top_p)
        except SamplingParameterError as e:
            raise ServeError(str(e)) from None
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ServeError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ServeError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ServeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise ServeError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {ids!r}")
        return SamplingParams(self.max_tokens, t, p, k, self.seed, list(stop), list(ids), bool(self.ignore_eos))


@jax.jit
def sample_rows(logits, temperature, top_k, top_p, seed, index):
    """logits [S, V]; temperature, top_p [S] float32; top_k, index [S] int32; seed [S] uint32 -> [S] int32."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        v = logits.shape[-1]
        x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        order = jnp.argsort(-x, axis=-1)
        xs = jnp.take_along_axis(x, order, axis=-1)
        rank = jnp.arange(v)[None]
        xs = jnp.where((top_k[:, None] > 0) & (rank >= top_k[:, None]), -jnp.inf, xs)
        probs = jax.nn.softmax(xs, axis=-1)
        # the smallest prefix whose mass reaches top_p; the most likely token always stays
        drop = ((jnp.cumsum(probs, axis=-1) - probs) >= top_p[:, None]) & (rank > 0)
        xs = jnp.where(drop, -jnp.inf, xs)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed, index)
        pick = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, xs)
        return jnp.where(temperature > 0, jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0], greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy).astype(jnp.int32)
