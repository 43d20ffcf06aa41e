"""Family-generic forward passes built from the per-layer functions every family exposes:
embed, attn_input, qkv, recompute_kv, attn_out, post_attention, logits.

`prefill` runs a (right-padded, per-sequence-length) prompt batch and returns each layer's K, V and,
on request, its attention-input activations X (what KVPR and HybridServe store). `dense_decode_step`
is the `full` policy's step: the dense on-device cache goes in and the new cache comes out.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.config import ModelConfig
from kvoffload.models import llama, opt
from kvoffload.models.common import prefill_attention, pytree_dataclass

_FAMILIES = {"llama": llama, "opt": opt}


def family(cfg: ModelConfig):
    """The module holding this config's layer functions."""
    return _FAMILIES[cfg.family]


def init_params(cfg: ModelConfig, key, dtype=jnp.float32):
    return family(cfg).init_params(cfg, key, dtype)


def layer_prefill(cfg: ModelConfig, lp, h, positions, lengths):
    """One layer over a prompt: returns (h_out, k, v, x)."""
    fam = family(cfg)
    x = fam.attn_input(cfg, lp, h)
    q, k, v = fam.qkv(cfg, lp, x, positions)
    o = prefill_attention(q, k, v, lengths)
    return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o)), k, v, x


@functools.partial(jax.jit, static_argnames=("cfg", "keep_activations", "all_logits"))
def prefill(cfg: ModelConfig, params, tokens, lengths, keep_activations=False, all_logits=False):
    """tokens [B, T] right-padded, lengths [B]. Returns (logits, ks, vs, xs):
    logits [B, V] at each sequence's last token (or [B, T, V] with all_logits), ks/vs tuples of
    [B, n_kv, T, d] per layer, xs a tuple of [B, T, H] per layer or None."""
    fam = family(cfg)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = fam.embed(cfg, params, tokens, positions)
    ks, vs, xs = [], [], []
    for lp in params.layers:
        h, k, v, x = layer_prefill(cfg, lp, h, positions, lengths)
        ks.append(k)
        vs.append(v)
        if keep_activations:
            xs.append(x)
    if not all_logits:
        h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return fam.logits(cfg, params, h), tuple(ks), tuple(vs), (tuple(xs) if keep_activations else None)


@pytree_dataclass
class DenseKVCache:
    k: tuple  # per layer [B, n_kv, S, d]
    v: tuple
    lengths: Any  # [B] int32: valid tokens per sequence

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


@functools.partial(jax.jit, static_argnames=("capacity",))
def dense_cache_from_prefill(ks, vs, lengths, capacity: int) -> DenseKVCache:
    """Pads prefill K/V to the cache capacity. Jitted so every leaf comes out committed to the
    device, like the decode step's outputs: otherwise the second step would compile again."""
    t = ks[0].shape[2]
    pad = ((0, 0), (0, 0), (0, capacity - t), (0, 0))
    return DenseKVCache(
        k=tuple(jnp.pad(k, pad) for k in ks), v=tuple(jnp.pad(v, pad) for v in vs),
        lengths=jnp.asarray(lengths, jnp.int32),
    )


def write_token(cache_layer, new, lengths):
    """Writes new [B, n, 1, d] at position lengths[b] of cache_layer [B, n, S, d] (in place under jit)."""
    b = cache_layer.shape[0]
    return cache_layer.at[jnp.arange(b), :, lengths].set(new[:, :, 0])


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def dense_decode_step(cfg: ModelConfig, params, cache: DenseKVCache, tokens):
    """One decode step of the `full` policy. tokens [B] -> (logits [B, V], new cache)."""
    fam = family(cfg)
    lengths = cache.lengths
    positions = lengths[:, None]
    h = fam.embed(cfg, params, tokens[:, None], positions)
    new_k, new_v = [], []
    for lp, kc, vc in zip(params.layers, cache.k, cache.v):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        kc = write_token(kc, k, lengths)
        vc = write_token(vc, v, lengths)
        o, _ = ops.decode_attention(q[:, :, 0], kc, vc, lengths + 1)
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o[:, :, None]))
        new_k.append(kc)
        new_v.append(vc)
    out = fam.logits(cfg, params, h[:, 0])
    return out, DenseKVCache(k=tuple(new_k), v=tuple(new_v), lengths=lengths + 1)
