"""Pieces shared by the model families: pytree dataclasses, norms, RoPE, prefill attention."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.pallas import prefill_attention as _pf
from kvoffload.config import ModelConfig


def pytree_dataclass(cls=None, *, meta: tuple = ()):
    """A dataclass registered as a pytree; every field is a child (None fields are empty) except those named
    in meta: static, part of the tree's structure (a jitted function compiles per value)."""
    def register(cls):
        cls = dataclasses.dataclass(cls)
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=list(meta))
        return cls

    return register if cls is None else register(cls)


def _overflow_is_nan(inv, moment):
    """rsqrt of a moment that overflowed to inf is 0, and a norm would turn huge (finite) activations into zeros
    and the logits into a silent all-zero row: NaN instead, which the engine refuses with its diagnosis."""
    return jnp.where(jnp.isinf(moment), jnp.nan, inv)


def attention_window(cfg: ModelConfig, lp) -> int | None:
    """The sliding window a layer's attention keeps (its parameters' static `sliding` flag), or None."""
    return cfg.sliding_window if getattr(lp, "sliding", False) else None


def rms_norm(x, weight, eps, offset: float = 0.0):
    """RMSNorm over the last axis, scaled by (offset + weight) in fp32 (Gemma stores weight - 1: offset 1)."""
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * _overflow_is_nan(jax.lax.rsqrt(ms + eps), ms)
    w = weight.astype(jnp.float32)
    return (y * (w + offset if offset else w)).astype(x.dtype)


def layer_norm(x, weight, bias, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * _overflow_is_nan(jax.lax.rsqrt(var + eps), var)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def stack_trees(trees):
    """One tree of [n, ...] leaves from n trees of one structure (layers' weights): a copy."""
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def linear(x, w, b=None):
    """x @ w (+ b), fp32 accumulation (`ops.matmul_f32`), rounded once to x's dtype."""
    y = ops.matmul_f32(x, w)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False):
    """Inverse frequencies as HF computes them, including linear and llama3 scaling. local: a sliding-window
    layer's (gemma3: default RoPE at rope_local_theta)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if local:
        return inv
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        low_wl = cfg.rope_original_max_position / cfg.rope_low_freq_factor
        high_wl = cfg.rope_original_max_position / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wl, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = jnp.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions, local: bool = False):
    """cos, sin of shape positions.shape + (head_dim // 2,), float32."""
    ang = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg, local)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """HF split-half RoPE. x [B, n, T, d]; cos, sin [B, T, d/2]."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    c = cos[:, None]
    s = sin[:, None]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def split_heads(x, n_heads, head_dim):
    """[B, T, n*d] -> [B, n, T, d] (the cache layout)."""
    b, t, _ = x.shape
    return x.reshape(b, t, n_heads, head_dim).transpose(0, 2, 1, 3)


def merge_heads(o):
    """[B, n, T, d] -> [B, T, n*d]."""
    b, n, t, d = o.shape
    return o.transpose(0, 2, 1, 3).reshape(b, t, n * d)


PREFILL_QUERY_CHUNK = 512


def in_window(kpos, qpos, window: int | None):
    """The causal (and, with a window, sliding-window) mask of keys at kpos for queries at qpos, broadcast
    together: kpos <= qpos, and kpos > qpos - window (the window counts the query's own key: HF Gemma's
    sliding_window_overlay)."""
    ok = kpos <= qpos
    return ok if window is None else ok & (kpos > qpos - window)


def prefill_attention(q, k, v, lengths, *, scale=None, window: int | None = None):
    """Causal attention of a prompt over itself, keys at positions >= lengths[b] masked; with window, a
    sliding-window layer's (keys at positions <= q - window masked too: `in_window`).

    q [B, nh, T, d]; k, v [B, nkv, T, d]. Queries are processed in chunks so the score matrix stays
    small for long prompts. Returns [B, nh, T, d] in q.dtype.
    """
    b, nh, t, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, nkv, g, t, d)
    kpos = jnp.arange(t)

    def chunk(q_c, qpos):
        s = jnp.einsum("bkgqd,bksd->bkgqs", q_c, k, preferred_element_type=jnp.float32) * scale
        valid = in_window(kpos[None, :], qpos[:, None], window)[None] & (kpos[None, None, :] < lengths[:, None, None])
        s = jnp.where(valid[:, None, None], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return (o / jnp.where(denom > 0, denom, 1.0)).astype(q.dtype)

    if t <= PREFILL_QUERY_CHUNK:
        o = chunk(qg, kpos)
    else:
        n_chunks = -(-t // PREFILL_QUERY_CHUNK)
        pad = n_chunks * PREFILL_QUERY_CHUNK - t
        qp = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
        qc = qp.reshape(b, nkv, g, n_chunks, PREFILL_QUERY_CHUNK, d).transpose(3, 0, 1, 2, 4, 5)
        pos = jnp.arange(n_chunks * PREFILL_QUERY_CHUNK).reshape(n_chunks, PREFILL_QUERY_CHUNK)
        oc = jax.lax.map(lambda a: chunk(*a), (qc, pos))
        o = oc.transpose(1, 2, 3, 0, 4, 5).reshape(b, nkv, g, n_chunks * PREFILL_QUERY_CHUNK, d)[:, :, :, :t]
    return o.reshape(b, nh, t, d)


PREFILL_KEY_BLOCK = 1024


def prefill_attention_chunk(q, k, v, q_start, lengths, *, scale=None, key_block: int = PREFILL_KEY_BLOCK,
                            impl: str = "reference", window: int | None = None):
    """Causal attention of one chunk of a prompt's queries over the keys before and in it: q [B, nh,
    Tc, d] at positions q_start + [0, Tc) (q_start may be traced), k, v [B, nkv, T, d] the layer's whole
    K/V buffer (only positions < q_start + Tc are read, so later ones may be unwritten), keys at positions
    >= lengths[b] masked. Key blocks of key_block tokens are folded with an online softmax (fp32), so the
    scores held are [B, nh, Tc, key_block] however long the prompt: what chunked prefill needs for a
    1M-token context, where prefill_attention's [B, nh, 512, T] score chunk alone would be 68 GB
    (Llama-3-8B). The loop runs over the key blocks up to the chunk's last query (causal: ~half of a
    square's work). Returns [B, nh, Tc, d] in q.dtype; the same as prefill_attention's rows up to the
    order of fp32 sums. impl (ops.PREFILL_IMPLS): "kernel", the Pallas flash-attention kernel of the same
    semantics (`pallas/prefill_attention.py`), scores in registers; "cudnn", cuDNN's flash attention (a GPU,
    16-bit inputs), 2.1x the kernel's rate on an H100; "auto": cuDNN where it runs, else this XLA path.
    window: a sliding-window layer's (`in_window`): this XLA path only ("auto" takes it; the key blocks wholly
    before the chunk's first query's window are skipped)."""
    if impl not in ops.PREFILL_IMPLS:
        raise ValueError(f"prefill attention impl must be one of {ops.PREFILL_IMPLS}, got {impl!r}")
    if window is not None and impl in ("cudnn", "kernel"):
        raise ValueError(f"prefill attention impl {impl!r} has no sliding window; use 'reference' or 'auto'")
    if window is not None:
        impl = "reference"
    if impl == "cudnn" or (impl == "auto" and _pf.cudnn_supported(q.dtype, q.shape[-1])):
        return ops.prefill_attention_chunk_cudnn(q, k, v, q_start, lengths, scale=scale)
    if impl == "kernel":
        return ops.prefill_attention_chunk_kernel(q, k, v, q_start, lengths, scale=scale)
    b, nh, tc, d = q.shape
    nkv, t = k.shape[1], k.shape[2]
    g = nh // nkv
    kb = min(int(key_block), t)
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, nkv, g, tc, d)
    qpos = q_start + jnp.arange(tc)

    def body(j, carry):
        m, l, acc = carry
        lo = j * kb
        start = jnp.minimum(lo, t - kb)  # the last block may overlap the one before: keys < lo are masked
        kj = jax.lax.dynamic_slice_in_dim(k, start, kb, axis=2)
        vj = jax.lax.dynamic_slice_in_dim(v, start, kb, axis=2)
        kpos = start + jnp.arange(kb)
        s = jnp.einsum("bkgqd,bksd->bkgqs", qg, kj, preferred_element_type=jnp.float32) * scale
        valid = (in_window(kpos[None, :], qpos[:, None], window) & (kpos[None, :] >= lo))[None] & (
            kpos[None, None, :] < lengths[:, None, None])
        s = jnp.where(valid[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe)
        corr = jnp.exp(m - m_safe)  # m = -inf (nothing seen yet): 0
        l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
        acc = acc * corr + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((b, nkv, g, tc, 1), -jnp.inf, jnp.float32), jnp.zeros((b, nkv, g, tc, 1), jnp.float32),
            jnp.zeros((b, nkv, g, tc, d), jnp.float32))
    n_blocks = (jnp.minimum(q_start + tc, t) + kb - 1) // kb
    first = 0 if window is None else jnp.maximum(q_start - window + 1, 0) // kb
    _, l, acc = jax.lax.fori_loop(first, n_blocks, body, init)
    return (acc / jnp.where(l > 0, l, 1.0)).astype(q.dtype).reshape(b, nh, tc, d)
