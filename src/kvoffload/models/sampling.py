"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), reproducible from a seed."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from kvoffload.errors import KVOffloadError


class SamplingParameterError(KVOffloadError, ValueError):
    """A temperature, top_k or top_p that does not define a distribution to sample from."""


def check_sampling(temperature, top_k, top_p) -> tuple[float, int, float]:
    """Validates the sampling parameters and returns them as (float, int, float), the form `sample`
    takes. temperature: 0 (greedy) or a finite positive number; top_k: an integer >= 0 (0 = off);
    top_p: a number in [0, 1] (1 = off, 0 = the single most likely token, as in transformers)."""
    def number(name, v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise SamplingParameterError(f"{name} must be a number, got {v!r}")
        return float(v)

    t = number("temperature", temperature)
    if not (math.isfinite(t) and t >= 0.0):
        raise SamplingParameterError(f"temperature must be 0 (greedy) or a finite positive number, got {temperature!r}")
    p = number("top_p", top_p)
    if not 0.0 <= p <= 1.0:  # NaN fails both comparisons
        raise SamplingParameterError(f"top_p must be in [0, 1] (1 = no nucleus filter), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise SamplingParameterError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {top_k!r}")
    return t, int(top_k), p


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """logits [B, V] -> tokens [B] int32. temperature 0 is greedy (key unused). Parameters as
    `check_sampling` returns them."""
    logits = logits.astype(jnp.float32)
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p; the most likely token always stays
        # (so top_p = 0 is greedy)
        drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
        drop_sorted = drop_sorted.at[:, 0].set(False)
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
