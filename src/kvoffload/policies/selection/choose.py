"""Which tokens a query's vote selects (`choose_tokens`: the top-k with sinks and recent tokens forced in,
whole pages), shared by the selective policies (`tokenselect`, `clo`, `extrapolation`)."""

from __future__ import annotations

import jax.numpy as jnp

from kvoffload import ops
from kvoffload.pallas.sparse_attention import expand_indices

NEG_INF = float("-inf")


def choose_tokens(scores, positions, pool_tokens, context, n_select, K, num_sink, num_recent, page_size,
                  token_ids=None, method="sort"):
    """The selection from a vote: (indices [B, n_kv, K] ascending, num_valid [B, n_kv]).

    scores [B, n_kv, T] (-inf: not the request's) over a token space: the pool's (T = N), or each request's
    own (`TokenSpace`: then token_ids [B, T] gives each slot's pool token, ascending in the request's valid
    slots, and the indices returned are those pool tokens); positions [T] or [B, T]; pool_tokens, context
    [B] (the context counts the tail and the new token); n_select [B] or per head [B, n_kv]: tokens to select
    (<= K, a multiple of page_size). Forced in: positions < num_sink, and positions >= context - num_recent
    (pool tokens only where the tail is shorter than num_recent). With page_size > 1 the vote is summed
    over pages (page_size tokens inside one block) and whole pages are selected. The top n_select of each
    (request, head) by `ops.select_topk` with its own count (method "sort", "radix" or "kernel": the same
    indices)."""
    B, n_kv, N = scores.shape
    positions = positions if positions.ndim == 2 else positions[None]
    forced = (positions < num_sink) | (positions >= (context - num_recent)[:, None])  # [B, N]
    pri = jnp.where(forced[:, None] & (scores > NEG_INF), jnp.inf, scores)
    if page_size > 1:
        pri = jnp.sum(pri.reshape(B, n_kv, N // page_size, page_size), axis=-1)  # a forced token forces its page
    n_select = n_select if n_select.ndim == 2 else n_select[:, None]
    counts = jnp.broadcast_to(n_select // page_size, (B, n_kv))
    idx, nv = ops.select_topk(pri, K // page_size, counts=counts, method=method)  # ascending, valid first
    if page_size > 1:
        idx, _ = expand_indices(idx, nv, page_size, N)
        nv = nv * page_size
    if token_ids is not None:  # slots of the requests' own spaces -> pool tokens (monotone: order kept)
        kept = jnp.arange(idx.shape[-1])[None, None] < nv[..., None]
        idx = jnp.where(kept, jnp.take_along_axis(token_ids[:, None], idx, axis=-1), 0)
    return idx, nv
