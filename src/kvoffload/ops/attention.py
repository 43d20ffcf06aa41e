"""Dense decode attention (``decode_attention``; over int4 K/V, ``decode_attention_int4``) and a prefill chunk's
attention (the Pallas kernel, cuDNN's)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.pallas import common as _c
from kvoffload.pallas import decode_attention as _da
from kvoffload.pallas import prefill_attention as _pf
from kvoffload.pallas import quant as _q
from kvoffload.pallas.quant import QuantizedInt


# a prefill chunk's attention also has cuDNN's flash attention ("auto" on a GPU, for 16-bit inputs)
PREFILL_IMPLS = ("auto", "cudnn", "kernel", "reference")


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_s", "num_splits"))
def _decode_kernel_jit(q, k, v, lengths, scale, interpret, block_s=None, num_splits=None, start=None):
    return _da.decode_attention_kernel(q, k, v, lengths, scale=scale, interpret=interpret,
                                       block_s=block_s, num_splits=num_splits, start=start)


@functools.partial(jax.jit, static_argnames=("scale",))
def _decode_ref_jit(q, k, v, lengths, scale, start=None):
    return _da.decode_attention_reference(q, k, v, lengths, scale=scale, start=start)


def decode_attention(q, k, v, lengths, *, start=None, scale=None, impl="auto", interpret=False):
    """Decode attention of one query token per sequence over a KV cache.

    q [B, n_heads, d]; k, v [B, n_kv, S, d]; lengths [B] int32 (keys at positions
    < lengths[b] are valid; 0 allowed -> out 0, lse -inf); start [B] int32 or None: keys at positions
    < start[b] are masked too (a sliding window's; any value, negative or past lengths[b]). scale defaults
    to d**-0.5. Returns (out [B, n_heads, d] in q.dtype, lse [B, n_heads] float32).
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    start = None if start is None else jnp.asarray(start, jnp.int32)
    scale = None if scale is None else float(scale)
    if use_kernel(impl):  # per device on its heads under a tensor-parallel mesh (XLA cannot split a kernel)
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        if start is None:
            return _sh.per_shard(lambda q_, k_, v_, n_: _decode_kernel_jit(q_, k_, v_, n_, scale, interpret),
                                 (heads, heads, heads, rep), (heads, heads))(q, k, v, lengths)
        return _sh.per_shard(lambda q_, k_, v_, n_, s_: _decode_kernel_jit(q_, k_, v_, n_, scale, interpret,
                                                                           start=s_),
                             (heads, heads, heads, rep, rep), (heads, heads))(q, k, v, lengths, start)
    return _decode_ref_jit(q, k, v, lengths, scale, start)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _prefill_kernel_jit(q, k, v, q_start, lengths, scale, interpret):
    return _pf.prefill_attention_chunk_kernel(q, k, v, q_start, lengths, scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale",))
def _prefill_cudnn_jit(q, k, v, q_start, lengths, scale):
    return _pf.prefill_attention_chunk_cudnn(q, k, v, q_start, lengths, scale=scale)


def _prefill_chunk_per_head(run, q, k, v, q_start, lengths):
    """run(q, k, v, q_start, lengths) of a prefill chunk, per device on its heads under a tensor-parallel mesh."""
    heads, rep = _sh.KV_SPEC, _sh.REPLICATED
    return _sh.per_shard(run, (heads, heads, heads, rep, rep), heads)(q, k, v, jnp.asarray(q_start, jnp.int32),
                                                                      jnp.asarray(lengths, jnp.int32))


def prefill_attention_chunk_cudnn(q, k, v, q_start, lengths, *, scale=None):
    """cuDNN flash attention of a prefill chunk (`pallas.prefill_attention.prefill_attention_chunk_cudnn`):
    per device on its heads under a tensor-parallel mesh."""
    scale = None if scale is None else float(scale)
    return _prefill_chunk_per_head(lambda *a: _prefill_cudnn_jit(*a, scale), q, k, v, q_start, lengths)


def prefill_attention_chunk_kernel(q, k, v, q_start, lengths, *, scale=None):
    """The Pallas flash attention of a prefill chunk (`models.common.prefill_attention_chunk`'s kernel):
    per device on its heads under a tensor-parallel mesh; interpret mode off the GPU."""
    scale = None if scale is None else float(scale)
    interpret = not _c.on_gpu()
    return _prefill_chunk_per_head(lambda *a: _prefill_kernel_jit(*a, scale, interpret), q, k, v, q_start, lengths)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _int4_kernel_jit(q, kq, vq, lengths, scale, interpret):
    return _q.decode_attention_int4_kernel(q, kq, vq, lengths, scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale",))
def _int4_ref_jit(q, kq, vq, lengths, scale):
    return _q.decode_attention_int4_reference(q, kq, vq, lengths, scale=scale)


def decode_attention_int4(q, kq: QuantizedInt, vq: QuantizedInt, lengths, *, scale=None,
                          impl="auto", interpret=False):
    """Decode attention reading int4 K/V (``quantize_int4`` of [B, n_kv, S, d] caches)
    without dequantising the cache in memory. Same returns as ``decode_attention``. The kernel reads
    per-token group scales only: K or V quantized per channel (``scales="channel"``) is dequantized and
    attended by the reference (impl="kernel" refuses it)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    scale = None if scale is None else float(scale)
    d = q.shape[-1]
    if 8 in (kq.bits, vq.bits):
        raise ValueError("decode_attention_int4 attends int4 K/V; an int8 QuantizedInt (quantize_int8) is "
                         "dequantized (ops.dequantize) and attended with decode_attention")
    per_channel = "channel" in (kq.scales, vq.scales)
    if per_channel and impl == "kernel":
        raise ValueError("decode_attention_int4's kernel reads per-token int4 scales only; K/V quantized with "
                         "scales='channel' runs with impl='reference' or 'auto' (dequantize, then attend)")
    ok = _q.int4_kernel_supported(d, kq.group_size) and not per_channel
    if use_kernel(impl, ok) and (ok or impl == "kernel"):
        return _int4_kernel_jit(q, kq, vq, lengths, scale, interpret)
    return _int4_ref_jit(q, kq, vq, lengths, scale)
