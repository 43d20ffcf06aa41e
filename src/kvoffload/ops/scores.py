"""The selection's scores per KV head (`pallas.scores`): exact q.K, Quest page and block bounds, HATA Hamming
scores, the TokenSelect soft vote."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload.device import sharding as _sh
from kvoffload.ops.dispatch import use_kernel
from kvoffload.pallas import scores as _sc


@functools.partial(jax.jit, static_argnames=("scale", "group_reduce", "interpret"))
def _scores_kernel_jit(q, k, lengths, scale, group_reduce, interpret):
    return _sc.topk_scores_exact_kernel(q, k, lengths, scale=scale,
                                        group_reduce=group_reduce, interpret=interpret)


def topk_scores_exact(q, k, lengths=None, *, scale=None, group_reduce="sum", impl="auto",
                      interpret=False):
    """Exact scores scale*q.K per KV head, aggregated over the GQA group
    (group_reduce 'sum' | 'max' | 'mean'). q [B, n_heads, d], k [B, n_kv, S, d],
    lengths [B], [B, n_kv] (per KV head; 0: the head is not scored, its keys not read) or None.
    Returns [B, n_kv, S] float32, -inf past lengths."""
    scale = None if scale is None else float(scale)
    if use_kernel(impl):
        if lengths is not None:
            lengths = jnp.asarray(lengths, jnp.int32)
        # per device on its heads under a tensor-parallel mesh; per-head lengths [B, n_kv] split with them
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        return _sh.per_shard(lambda q_, k_, n_: _scores_kernel_jit(q_, k_, n_, scale, group_reduce, interpret),
                             (heads, heads, heads if lengths is not None and lengths.ndim == 2 else rep),
                             heads)(q, k, lengths)
    return _sc.topk_scores_exact_reference(q, k, lengths, scale=scale,
                                           group_reduce=group_reduce)


@functools.partial(jax.jit, static_argnames=("group_reduce", "interpret"))
def _quest_kernel_jit(q, kmin, kmax, num_pages, group_reduce, interpret):
    return _sc.quest_page_scores_kernel(q, kmin, kmax, num_pages, group_reduce=group_reduce,
                                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _quest_blocks_kernel_jit(q, owner, kmin, kmax, scale, interpret, active=None):
    return _sc.quest_block_bounds_kernel(q, owner, kmin, kmax, scale, active=active, interpret=interpret)


def quest_block_bounds(q, owner, kmin, kmax, scale=None, *, active=None, impl="auto", interpret=False):
    """Quest's page bounds of pool blocks, each against its owner's query
    (`pallas.scores.quest.quest_block_bounds_reference`): q [B, H, d]; owner [E]; kmin, kmax [E, n_kv, P, d] (int8 with scale [E, n_kv, P], or the keys' dtype);
    active [B, n_kv] or None: an inactive (request, head)'s bounds are -inf and its pages are not read.
    Returns [E, n_kv, P] f32. The kernel on the GPU, per device on its heads under a tensor-parallel mesh."""
    kmin, kmax, scale = (None if a is None else jnp.asarray(a) for a in (kmin, kmax, scale))
    if use_kernel(impl):
        heads, rep = _sh.KV_SPEC, _sh.REPLICATED
        return _sh.per_shard(
            lambda q_, o_, lo_, hi_, s_, a_: _quest_blocks_kernel_jit(q_, o_, lo_, hi_, s_, interpret, active=a_),
            (heads, rep, heads, heads, heads, heads), heads)(q, owner, kmin, kmax, scale, active)
    return _sc.quest_block_bounds_reference(q, owner, kmin, kmax, scale, active=active)


def quest_page_scores(q, kmin, kmax, num_pages=None, *, group_reduce="sum", impl="auto",
                      interpret=False):
    """Quest page upper bounds sum_c max(q_c min_c, q_c max_c) from per-page
    channel-wise min/max keys (see ``quest_page_minmax``), per query head, aggregated
    over the GQA group. q [B, n_heads, d]; kmin, kmax [B, n_kv, P, d]; num_pages [B]
    (valid pages) or None. Returns [B, n_kv, P] float32, -inf for empty pages
    (kmin > kmax) and pages >= num_pages."""
    if use_kernel(impl):
        if num_pages is not None:
            num_pages = jnp.asarray(num_pages, jnp.int32)
        return _quest_kernel_jit(q, kmin, kmax, num_pages, group_reduce, interpret)
    return _sc.quest_page_scores_reference(q, kmin, kmax, num_pages, group_reduce=group_reduce)


@functools.partial(jax.jit, static_argnames=("group_reduce", "interpret"))
def _hata_kernel_jit(q_codes, k_codes, lengths, k_norm, group_reduce, interpret):
    return _sc.hata_scores_kernel(q_codes, k_codes, lengths, k_norm=k_norm,
                                  group_reduce=group_reduce, interpret=interpret)


def hata_scores(q_codes, k_codes, lengths=None, *, k_norm=None, group_reduce="sum",
                impl="auto", interpret=False):
    """HATA similarity r - hamming(q_code, k_code) (optionally times key norm), per KV head
    aggregated over the group. q_codes [B, n_heads, r//32] uint32, k_codes [B, n_kv, S,
    r//32] uint32 (packing convention in the module docstring); k_norm [B, n_kv, S] or
    None; lengths [B] or None. Returns [B, n_kv, S] float32, -inf past lengths."""
    if use_kernel(impl):
        if lengths is not None:
            lengths = jnp.asarray(lengths, jnp.int32)
        return _hata_kernel_jit(q_codes, k_codes, lengths, k_norm, group_reduce, interpret)
    return _sc.hata_scores_reference(q_codes, k_codes, lengths, k_norm=k_norm,
                                     group_reduce=group_reduce)


@functools.partial(jax.jit, static_argnames=("scale", "shared", "interpret"))
def _tokenselect_kernel_jit(q, k, lengths, scale, shared, interpret):
    return _sc.tokenselect_scores_kernel(q, k, lengths, scale=scale, shared=shared,
                                         interpret=interpret)


def tokenselect_scores(q, k, lengths=None, *, scale=None, shared=False, impl="auto",
                       interpret=False):
    """TokenSelect soft vote: per-head softmax of scale*q.K over the valid keys, summed
    over the heads of each GQA group (shared=True: over all heads, same selection for
    every KV head). q [B, n_heads, d] (cast to k.dtype by the kernel), k [B, n_kv, S, d],
    lengths [B] or None. Returns [B, n_kv, S] float32, -inf past lengths. The kernel is
    exact (two passes: logits + per-head softmax statistics, then normalised sums)."""
    scale = None if scale is None else float(scale)
    shared = bool(shared)
    if use_kernel(impl):
        if lengths is not None:
            lengths = jnp.asarray(lengths, jnp.int32)
        return _tokenselect_kernel_jit(q, k, lengths, scale, shared, interpret)
    return _sc.tokenselect_scores_reference(q, k, lengths, scale=scale, shared=shared)
