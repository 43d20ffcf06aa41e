"""Family-generic forward passes built from the per-layer functions every family exposes:
embed, attn_input, qkv, recompute_kv, attn_out, post_attention, logits.

`prefill` runs a (right-padded, per-sequence-length) prompt batch and returns each layer's K, V and,
on request, its attention-input activations X (what KVPR and HybridServe store). `dense_decode`
is the `full` policy's step: the dense on-device cache goes in and the new cache comes out.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.config import ModelConfig
from kvoffload.models import gemma3, llama, opt
from kvoffload.models.common import (
    PREFILL_KEY_BLOCK,
    attention_window,
    prefill_attention,
    prefill_attention_chunk,
    pytree_dataclass,
)

_FAMILIES = {"llama": llama, "opt": opt, "gemma3": gemma3}


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
    o = prefill_attention(q, k, v, lengths, window=attention_window(cfg, lp))
    return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o)), k, v, x


def layer_prefill_chunked(cfg: ModelConfig, lp, h, positions, lengths, chunk_tokens: int, keep_x: bool = True,
                          key_block: int = PREFILL_KEY_BLOCK, attention_impl: str = "reference"):
    """layer_prefill in token chunks of chunk_tokens (the last one may be shorter): each chunk's
    q/k/v, its K/V written into the layer's [B, n_kv, T, d] buffers, its attention over the keys so far
    (prefill_attention_chunk) and its MLP, before the next chunk. The workspace is a chunk's (MLP
    intermediate [B, Tc, I], scores [B, nh, Tc, key_block]) instead of the whole prompt's: a 1M-token
    Llama-3-8B prompt's MLP intermediate alone is 28 GB. What stays whole: h (in and out), K/V and X
    (keep_x) of this one layer. Returns (h_out, k, v, x or None) as layer_prefill (equal up to the order
    of fp32 sums in attention). attention_impl: prefill_attention_chunk's impl."""
    fam = family(cfg)
    b, t, hdim = h.shape
    tc = min(int(chunk_tokens), t)
    kv_shape = (b, cfg.num_kv_heads, t, cfg.head_dim)

    def chunk(s, size, carry):
        h_all, k_all, v_all, x_all = carry
        h_c = jax.lax.dynamic_slice_in_dim(h, s, size, axis=1)  # the layer's input, not the carry
        x_c = fam.attn_input(cfg, lp, h_c)
        q, k_c, v_c = fam.qkv(cfg, lp, x_c, jax.lax.dynamic_slice_in_dim(positions, s, size, axis=1))
        k_all = jax.lax.dynamic_update_slice_in_dim(k_all, k_c.astype(k_all.dtype), s, axis=2)
        v_all = jax.lax.dynamic_update_slice_in_dim(v_all, v_c.astype(v_all.dtype), s, axis=2)
        if x_all is not None:
            x_all = jax.lax.dynamic_update_slice_in_dim(x_all, x_c.astype(x_all.dtype), s, axis=1)
        o = prefill_attention_chunk(q, k_all, v_all, s, lengths, key_block=key_block, impl=attention_impl,
                                    window=attention_window(cfg, lp))
        h_c = fam.post_attention(cfg, lp, h_c, fam.attn_out(cfg, lp, o))
        return jax.lax.dynamic_update_slice_in_dim(h_all, h_c, s, axis=1), k_all, v_all, x_all

    dtype = h.dtype
    kdt = jax.eval_shape(lambda: fam.qkv(cfg, lp, fam.attn_input(cfg, lp, h[:, :1]), positions[:, :1]))[1].dtype
    carry = (jnp.zeros_like(h), jnp.zeros(kv_shape, kdt), jnp.zeros(kv_shape, kdt),
             jnp.zeros((b, t, hdim), dtype) if keep_x else None)
    full = t // tc
    carry = jax.lax.fori_loop(0, full, lambda c, cr: chunk(c * tc, tc, cr), carry)
    if t % tc:
        carry = chunk(full * tc, t % tc, carry)
    return carry


@functools.partial(jax.jit, static_argnames=("cfg", "all_logits"))
def prefill(cfg: ModelConfig, params, tokens, lengths, all_logits=False):
    """tokens [B, T] right-padded, lengths [B]. Returns (logits, ks, vs): logits [B, V] at each
    sequence's last token (or [B, T, V] with all_logits), ks/vs tuples of [B, n_kv, T, d] per
    layer."""
    fam = family(cfg)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = fam.embed(cfg, params, tokens, positions)
    ks, vs = [], []
    for lp in params.layers:
        h, k, v, _ = layer_prefill(cfg, lp, h, positions, lengths)
        ks.append(k)
        vs.append(v)
    if not all_logits:
        h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return fam.logits(cfg, params, h), tuple(ks), tuple(vs)


TAIL_SLOTS = 32


@pytree_dataclass
class DenseKVCache:
    """The `full` policy's on-device cache: the main K/V, read-only inside a decode step, plus a
    small tail holding the newest tokens. A step writes only into the tail (one shared slot for
    the whole batch) and attends over main + tail merged exactly by log-sum-exp, so its cost never
    depends on whether XLA updates a multi-GB donated buffer in place; `dense_flush` moves a full
    tail into the main cache once every TAIL_SLOTS steps (the offload runtime's write-back works
    the same way)."""

    k: tuple  # per layer [B, n_kv, S, d]
    v: tuple
    lengths: Any  # [B] int32: tokens of each sequence in k/v
    tail_k: tuple  # per layer [B, n_kv, W, d]
    tail_v: tuple
    tail_len: Any  # int32 scalar: tokens in the tail (every sequence appends one per step)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def tail_slots(self) -> int:
        return self.tail_k[0].shape[2]


def dense_cache(ks, vs, lengths, tail_slots: int = TAIL_SLOTS) -> DenseKVCache:
    """A cache over per-layer K/V already at capacity [B, n_kv, S, d], with an empty tail. Every leaf
    is committed to the cache's device, like a decode step's outputs (else the next step recompiles).
    S must hold every token the sequences will have (prompt + generated)."""
    where = ks[0].sharding
    tail = lambda a: jax.device_put(jnp.zeros(a.shape[:2] + (tail_slots, a.shape[3]), a.dtype), where)  # noqa: E731
    return DenseKVCache(
        k=tuple(ks), v=tuple(vs), lengths=jax.device_put(jnp.asarray(lengths, jnp.int32), where),
        tail_k=tuple(tail(k) for k in ks), tail_v=tuple(tail(v) for v in vs),
        tail_len=jax.device_put(jnp.zeros((), jnp.int32), where),
    )


@functools.partial(jax.jit, static_argnames=("capacity",))
def pad_to_capacity(ks, vs, capacity: int):
    pad = ((0, 0), (0, 0), (0, capacity - ks[0].shape[2]), (0, 0))
    return tuple(jnp.pad(k, pad) for k in ks), tuple(jnp.pad(v, pad) for v in vs)


def dense_cache_from_prefill(ks, vs, lengths, capacity: int, tail_slots: int = TAIL_SLOTS) -> DenseKVCache:
    """The cache after a prefill: K/V padded to capacity plus an empty tail."""
    return dense_cache(*pad_to_capacity(tuple(ks), tuple(vs), capacity), lengths, tail_slots)


@functools.partial(jax.jit, donate_argnames=("cache",))
def dense_flush(cache: DenseKVCache) -> DenseKVCache:
    """Moves the tail into the main cache at each sequence's length (a whole tail window is
    written; slots past tail_len stay beyond `lengths`, so they are never attended)."""
    put = jax.vmap(lambda m, t, n: jax.lax.dynamic_update_slice(m, t, (0, n, 0)))
    return DenseKVCache(
        k=tuple(put(m, t, cache.lengths) for m, t in zip(cache.k, cache.tail_k)),
        v=tuple(put(m, t, cache.lengths) for m, t in zip(cache.v, cache.tail_v)),
        lengths=cache.lengths + cache.tail_len, tail_k=cache.tail_k, tail_v=cache.tail_v,
        tail_len=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _dense_decode_step(cfg: ModelConfig, params, cache: DenseKVCache, tokens):
    """One decode step of the `full` policy. tokens [B] -> (logits [B, V], new cache).
    The tail must have a free slot (tail_len < tail_slots): call dense_flush when it is full."""
    fam = family(cfg)
    b = tokens.shape[0]
    positions = (cache.lengths + cache.tail_len)[:, None]
    tail_lengths = jnp.broadcast_to(cache.tail_len + 1, (b,))
    h = fam.embed(cfg, params, tokens[:, None], positions)
    new_tk, new_tv = [], []
    for lp, kc, vc, tk, tv in zip(params.layers, cache.k, cache.v, cache.tail_k, cache.tail_v):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        tk = jax.lax.dynamic_update_slice(tk, k.astype(tk.dtype), (0, 0, cache.tail_len, 0))
        tv = jax.lax.dynamic_update_slice(tv, v.astype(tv.dtype), (0, 0, cache.tail_len, 0))
        window = attention_window(cfg, lp)
        # a sliding layer: keys at positions > p - window (main cache slot = position; tail slot j = lengths + j)
        lo = None if window is None else positions[:, 0] - window + 1
        o, _ = ops.merge_attention([
            ops.decode_attention(q[:, :, 0], kc, vc, cache.lengths, start=lo),
            ops.decode_attention(q[:, :, 0], tk, tv, tail_lengths, start=None if lo is None else lo - cache.lengths),
        ])
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o[:, :, None]))
        new_tk.append(tk)
        new_tv.append(tv)
    out = fam.logits(cfg, params, h[:, 0])
    return out, DenseKVCache(k=cache.k, v=cache.v, lengths=cache.lengths, tail_k=tuple(new_tk),
                             tail_v=tuple(new_tv), tail_len=cache.tail_len + 1)


def dense_decode(cfg: ModelConfig, params, cache: DenseKVCache, tokens, tail_count: int):
    """A decode step that flushes a full tail first. tail_count: tokens in the tail, tracked on the
    host so no device value is read. Returns (logits, cache, new tail_count)."""
    if tail_count == cache.tail_slots:
        cache, tail_count = dense_flush(cache), 0
    logits, cache = _dense_decode_step(cfg, params, cache, tokens)
    return logits, cache, tail_count + 1
