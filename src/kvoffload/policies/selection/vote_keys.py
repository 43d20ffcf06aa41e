"""The keys a vote reads: the exact keys, or a quantized copy of them kept on the GPU beside the pool.

A miss scores every key of the request before it attends anything, so reading K is the floor of a vote over
exact keys. An int8 copy (a code per value, a float32 step and min per 64 values of a row) reads 0.56x the
bytes of bf16 keys at head_dim 128, an int4 copy 0.31x. On SmolLM2's RULER prompts the int8 vote keeps
99.2-99.8% of the exact vote's top-k and the same vote mass to 1e-5; int4 keeps 88-97% of it and 99.7-99.9%
of the mass (tests/test_selection_recall.py measures it). Only the vote reads the copy: the selected rows are
attended from the exact K/V. tokenselect keeps it in its slots (``vote_keys``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvoffload import ops

VOTE_KEYS = ("native", "int8", "int4")


def vote_group(head_dim: int) -> int:
    """Values sharing a step and a min: 64 (the pool's int4 group), or the whole row if shorter."""
    return min(64, head_dim)


def vote_key_copy(k, form: str):
    """What the vote reads of keys k [..., d]: k itself ("native") or its int8 / int4 codes (`ops.QuantizedInt`,
    groups of `vote_group` along d)."""
    if form == "native":
        return k
    if form not in VOTE_KEYS:
        raise ValueError(f"vote_keys must be one of {VOTE_KEYS}, got {form!r}")
    quantize = ops.quantize_int8 if form == "int8" else ops.quantize_int4
    return quantize(k, vote_group(k.shape[-1]))


def vote_key_zeros(shape, form: str, dtype):
    """An empty copy for keys of `shape` [..., d] in `vote_key_copy`'s form: its shapes traced, never the keys made."""
    like = jax.eval_shape(lambda: vote_key_copy(jnp.zeros(shape, dtype), form))
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), like)


def vote_key_values(keys, dtype):
    """The keys a vote multiplies the query with: a quantized copy's values in dtype (`vote_key_copy`), exact keys
    as they are."""
    if isinstance(keys, ops.QuantizedInt):
        return ops.dequantize(keys, dtype)
    return keys
