"""clo's row buffer: the selected rows held on the GPU, refilled with only the rows it lacks (speculative
prefetch: `refill_rows`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvoffload.policies.selection.rows import HostRows
from kvoffload.policies.selection.space import sorted_positions, tier_index


FETCH_TIERS = (16, 4, 1)  # a refill gathers K/16, K/4 or K rows (the smallest that holds its misses), or none


def locate_rows(held, held_valid, want, want_valid):
    """(present, pos) [B, n_kv, K]: whether each wanted token (the first want_valid entries of want) is among
    the held ones (the first held_valid entries of held, ascending, as ``choose_tokens`` gives them) and
    at which entry of held."""
    Kh, Kw = held.shape[-1], want.shape[-1]
    keyed = jnp.where(jnp.arange(Kh) < held_valid[..., None], held, jnp.int32(2 ** 30))  # sorted
    pos = sorted_positions(keyed.reshape(-1, Kh), want.reshape(-1, Kw)).reshape(want.shape)
    pos = jnp.minimum(pos, Kh - 1).astype(jnp.int32)
    present = (jnp.take_along_axis(keyed, pos, -1) == want) & (jnp.arange(Kw) < want_valid[..., None])
    return present, pos


def missing_rows(held, held_valid, want, want_valid):
    """(present, pos, missing, count): ``locate_rows`` and the wanted tokens the held ones lack, compacted
    ([B, n_kv, K]: the first count [B, n_kv] entries, in want's order; the rest 0)."""
    present, pos = locate_rows(held, held_valid, want, want_valid)
    K = want.shape[-1]
    miss = (jnp.arange(K) < want_valid[..., None]) & ~present
    rank = jnp.cumsum(miss, axis=-1, dtype=jnp.int32) - 1
    B, n_kv = want.shape[:2]
    at = (jnp.arange(B)[:, None, None], jnp.arange(n_kv)[None, :, None], jnp.where(miss, rank, K))
    missing = jnp.zeros_like(want).at[at].set(want, mode="drop")
    return present, pos, missing, jnp.sum(miss, axis=-1, dtype=jnp.int32)


def gather_missing(sources: HostRows, missing, count, blk, like):
    """(rows, x_rows): rows of the tokens missing[..., :max(count)] from the layer's host side (`HostRows`: each
    buffer's extents, int4 or native, dequantized to like[i]'s dtype; or recomputed from X rows, x_rows [B] of
    them read), as [B, n_kv, K, d] arrays shaped like `like` (rows past the count undefined). The gather takes
    the smallest of the FETCH_TIERS sizes that holds max(count) rows (a ``lax.switch``: static shapes), none
    when nothing is missing."""
    K = missing.shape[-1]
    sizes = sorted({max(1, -(-K // t)) for t in FETCH_TIERS})

    def gather(m):
        def run():
            rows, x_rows = sources(missing[..., :m], jnp.minimum(count, m), tuple(b.dtype for b in like), blk)
            return tuple(jnp.pad(r, ((0, 0), (0, 0), (0, K - m), (0, 0))) for r in rows), x_rows
        return run

    which = tier_index(sizes, jnp.max(count))
    none = lambda: (tuple(jnp.zeros_like(b) for b in like), jnp.zeros(count.shape[:1], jnp.int32))  # noqa: E731
    return jax.lax.switch(which, [none] + [gather(m) for m in sizes])


def refill_rows(held, held_valid, buffers, want, want_valid, sources, blk):
    """(rows, fetched, x_rows): the rows of the wanted tokens ([B, n_kv, K, d] per buffer, in want's order), how
    many were fetched per (request, KV head) and the X rows read per request (store=act). buffers hold the rows
    of `held` (one per part: V, or K and V); a wanted row already held is taken from its buffer, only the others
    come from the sources (a `HostRows`, or per buffer the host extents to gather from): exactly want minus held."""
    if not isinstance(sources, HostRows):
        sources = HostRows(extents=tuple(sources))
    present, pos, missing, count = missing_rows(held, held_valid, want, want_valid)
    got, x_rows = gather_missing(sources, missing, count, blk, buffers)
    rank = jnp.maximum(jnp.cumsum(~present, axis=-1, dtype=jnp.int32) - 1, 0)
    out = tuple(jnp.where(present[..., None], jnp.take_along_axis(buf, pos[..., None], axis=2),
                          jnp.take_along_axis(new, rank[..., None], axis=2)) for buf, new in zip(buffers, got))
    return out, count, x_rows


# CloSlots fields a decode layer program reads and never writes: the per-head reuse rule and the retrieval
