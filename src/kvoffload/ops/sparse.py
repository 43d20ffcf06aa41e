"""Attention over a selection: ``sparse_attention`` (selected positions or pages of a K/V cache, device or
pinned host memory) and ``rows_attention`` (a selection's rows gathered into buffers, read in place)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.pallas import common as _c
from kvoffload.pallas import sparse_attention as _sa


_LAST_SPARSE_PATH = {"path": None}


def sparse_attention_path():
    """Which path the last eager ``sparse_attention`` call took:
    'kernel_zero_copy' (Pallas kernel reading K/V in pinned_host memory directly),
    'kernel' (Pallas kernel, K/V in device memory), 'reference',
    'reference_device_copy' (K/V were in host memory and copied to the device first),
    'traced' (called under jit: kernel/reference chosen by platform), or None."""
    return _LAST_SPARSE_PATH["path"]


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "interpret"))
def _sparse_kernel_jit(q, k, v, indices, num_valid, lengths, page_size, scale, interpret):
    return _sa.sparse_attention_kernel(q, k, v, indices, num_valid=num_valid,
                                       page_size=page_size, scale=scale, lengths=lengths,
                                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=("page_size", "scale"))
def _sparse_ref_jit(q, k, v, indices, num_valid, lengths, page_size, scale):
    return _sa.sparse_attention_reference(q, k, v, indices, num_valid=num_valid,
                                          page_size=page_size, scale=scale, lengths=lengths)


# whether the zero-copy (pinned_host -> Triton kernel) path works here; None = untested
_ZERO_COPY_OK = {"ok": None}


def sparse_attention(q, k, v, indices, *, num_valid=None, page_size=1, scale=None,
                     lengths=None, impl="auto", interpret=False):
    """Attention over selected positions / pages only.

    q [B, n_heads, d]; k, v [B, n_kv, S, d]; indices [B, n_kv, K] int32 per KV head:
    token positions (page_size=1) or page indices (page_size>1: page p covers positions
    p*page_size ... p*page_size+page_size-1). num_valid [B, n_kv] (optional): only the
    first num_valid entries count. lengths [B] (optional): positions >= lengths[b] are
    ignored (partial last page). Returns (out [B, n_heads, d] in q.dtype, lse [B, n_heads]).

    k, v may live in ``pinned_host`` memory. On GPU the Pallas kernel then reads the
    selected rows straight from host memory (zero-copy); where that fails (or on CPU)
    the arrays are copied to device memory first. ``sparse_attention_path()`` tells
    which path ran.
    """
    scale = None if scale is None else float(scale)
    page_size = int(page_size)
    indices = jnp.asarray(indices, jnp.int32)
    if num_valid is not None:
        num_valid = jnp.asarray(num_valid, jnp.int32)
    if lengths is not None:
        lengths = jnp.asarray(lengths, jnp.int32)
    traced = isinstance(k, jax.core.Tracer)
    host = (not traced) and _c.memory_kind(k) not in (None, "device")
    kernel = use_kernel(impl)
    if traced:
        _LAST_SPARSE_PATH["path"] = "traced"
        if kernel:  # per device on its heads under a tensor-parallel mesh (clo, tokenselect)
            heads, rep = _sh.KV_SPEC, _sh.REPLICATED
            return _sh.per_shard(
                lambda q_, k_, v_, i_, n_, l_: _sa.sparse_attention_kernel(q_, k_, v_, i_, num_valid=n_,
                                                                           page_size=page_size, scale=scale,
                                                                           lengths=l_, interpret=interpret),
                (heads, heads, heads, heads, heads, rep), (heads, heads))(q, k, v, indices, num_valid, lengths)
        return _sa.sparse_attention_reference(q, k, v, indices, num_valid=num_valid,
                                              page_size=page_size, scale=scale,
                                              lengths=lengths)
    if kernel and host and not interpret and _ZERO_COPY_OK["ok"] is not False:
        try:
            res = _sparse_kernel_jit(q, k, v, indices, num_valid, lengths, page_size,
                                     scale, False)
            _ZERO_COPY_OK["ok"] = True
            _LAST_SPARSE_PATH["path"] = "kernel_zero_copy"
            return res
        except Exception:  # lowering/runtime refused host operands: fall back
            _ZERO_COPY_OK["ok"] = False
    if host:
        k = _c.to_device_memory(k)
        v = _c.to_device_memory(v)
    if kernel:
        _LAST_SPARSE_PATH["path"] = "kernel_device_copy" if host else "kernel"
        return _sparse_kernel_jit(q, k, v, indices, num_valid, lengths, page_size, scale,
                                  interpret)
    _LAST_SPARSE_PATH["path"] = "reference_device_copy" if host else "reference"
    return _sparse_ref_jit(q, k, v, indices, num_valid, lengths, page_size, scale)


def rows_attention(q, k, v, num_valid, rows: int, *, row_offset=None, impl="auto", interpret=False):
    """Attention over row buffers (a selection's rows, gathered into device memory): each (request, KV head)'s
    first num_valid [B, n_kv] rows of k, v [B, n_kv, R, d], at rows [row_offset, row_offset + rows) (row_offset
    [] int32 or None: 0 and R = rows; several layers' buffers stacked along the rows). Returns (out [B, H, d],
    lse [B, H]). The kernel reads the rows in place and consecutively (`sparse_attention`'s gather form loads
    each block's indices first); per device on its heads under a tensor-parallel mesh."""
    rows = int(rows)
    num_valid = jnp.asarray(num_valid, jnp.int32)
    off = None if row_offset is None else jnp.asarray(row_offset, jnp.int32)
    if use_kernel(impl):
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        return _sh.per_shard(
            lambda q_, k_, v_, n_, o_: _sa.rows_attention_kernel(q_, k_, v_, n_, rows, row_offset=o_,
                                                                 interpret=interpret),
            (heads, heads, heads, heads, rep), (heads, heads))(q, k, v, num_valid, off)
    return _sa.rows_attention_reference(q, k, v, num_valid, rows, row_offset=off)
