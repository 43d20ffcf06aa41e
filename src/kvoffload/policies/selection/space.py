"""The token space a selection scores and ranks, and the pool's token bookkeeping the selective policies
share (`tokenselect`, `clo`): which request owns each block (`block_owners`), each token's position
(`token_positions`), the most tokens one request can own (`request_token_bound`), and the static tiers of
a gather's size (`tier_index`, `union_tiers`).

Scoring reads every K row (or key metadata) of the pool once per layer unless the cache hits, each block
against its owner's query only; the scores and the top-k then run per request over its own tokens
(`TokenSpace`: [B, n_kv, T] with T the most tokens one request owns, not the batch's pool: at batch 8 the
top-k alone over the batch's pool cost 2 ms a layer on an H100). Token ids are in the pool's block-id
space: block id * block_tokens + offset in the block."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvoffload.policies.selection.choose import NEG_INF


def block_owners(tables):
    """[num_blocks] int32: the request owning each block of the pool (block-id order), -1 where none."""
    if tables.owner is not None:  # built with the tables (`BlockAllocator.device_tables`)
        return tables.owner
    out = []
    for table, count, first in zip(tables.table, tables.count, tables.first_pos):
        B, M = table.shape
        slot = jnp.where(jnp.arange(M, dtype=jnp.int32)[None] < count[:, None], table, first.shape[0])
        req = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, M))
        out.append(jnp.full(first.shape, -1, jnp.int32).at[slot.reshape(-1)].set(req.reshape(-1), mode="drop"))
    return jnp.concatenate(out)


@dataclasses.dataclass(frozen=True)
class TokenSpace:
    """The token space a selection scores and ranks, per request: [B, T] over its own pool blocks.

    Scoring: every pool block is scored once, against its owner's query (``owner_rows``: no request scores
    another's blocks: 1x the flops of the pool, not B x), as per-block values [num_blocks, C, blk];
    ``per_request`` lays them out per request. Two layouts:
    * per request (``blocks`` given, batch > 1 with a known bound): each request's blocks in ascending
      block-id order, padded to R = the most blocks one request owns (`request_token_bound`), T = R * blk;
      the top-k runs over T, not over the batch's pool, and ``token_ids`` maps a slot back to its pool token.
    * the pool (``blocks`` None: batch 1, or no bound): T = N, every pool token, the request's valid (at
      batch 1 the request owns the pool: nothing to gather, the scores as computed).
    Either way a request's own tokens come in ascending pool token order, so the top-k (ties to the lower
    index) picks the same tokens in both layouts, and in the pool of the request alone."""

    owner: jax.Array  # [num_blocks] int32: each block's request (-1: free)
    blocks: jax.Array | None  # [B, R] int32: each request's blocks, ascending (0 past its count); None: the pool
    valid: jax.Array  # [B, R] (per request) or [B, num_blocks] (the pool) bool: the request owns the block
    blk: int

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def owner_rows(self, x):
        """[num_blocks, ...]: per block its owner's row of x [B, ...] (request 0's where free)."""
        if self.batch == 1:
            return jnp.broadcast_to(x, (self.owner.shape[0],) + x.shape[1:])
        return x[jnp.maximum(self.owner, 0)]

    def token_valid(self):
        """[B, T] bool: the slot holds one of the request's tokens."""
        return jnp.repeat(self.valid, self.blk, axis=1)

    def per_request(self, x):
        """[B, C, T] f32 from per-block values x [num_blocks, C, blk], -inf where the request owns no token."""
        n, C, blk = x.shape
        if self.blocks is None:
            y = jnp.swapaxes(x, 0, 1).reshape(1, C, n * blk)
        else:
            y = jnp.swapaxes(x[self.blocks], 1, 2).reshape(self.batch, C, -1)  # [B, R, C, blk] -> [B, C, R blk]
        return jnp.where(self.token_valid()[:, None], y.astype(jnp.float32), NEG_INF)

    def token_ids(self):
        """[B, T] int32: the pool token (block id * blk + offset) of each slot; None for the pool's own space."""
        if self.blocks is None:
            return None
        return (self.blocks[..., None] * self.blk + jnp.arange(self.blk, dtype=jnp.int32)).reshape(self.batch, -1)

    def positions(self, tables):
        """[T] (the pool) or [B, T] int32: each slot's token position (``token_positions``)."""
        pos = token_positions(tables, self.blk)
        ids = self.token_ids()
        return pos if ids is None else pos[ids]


jax.tree_util.register_dataclass(TokenSpace, data_fields=["owner", "blocks", "valid"], meta_fields=["blk"])


def token_space(tables, blk: int, request_blocks: int = 0) -> TokenSpace:
    """The selection's token space for these tables (`TokenSpace`): per request, R = request_blocks blocks
    each, where the batch has more than one request and R is known and below the pool's blocks; else the
    pool's. request_blocks must bound every request's blocks (the slots' sizes rest on the same bound)."""
    owner = block_owners(tables)
    B, n = tables.count[0].shape[0], owner.shape[0]
    mine = owner[None] == jnp.arange(B, dtype=jnp.int32)[:, None]  # [B, num_blocks]
    if B == 1 or not 0 < request_blocks < n:
        return TokenSpace(owner=owner, blocks=None, valid=mine, blk=blk)
    blocks = jax.vmap(lambda m: jnp.nonzero(m, size=request_blocks, fill_value=0)[0].astype(jnp.int32))(mine)
    valid = jnp.arange(request_blocks)[None] < jnp.sum(mine, axis=1, dtype=jnp.int32)[:, None]
    return TokenSpace(owner=owner, blocks=blocks, valid=valid, blk=blk)


def token_positions(tables, blk):
    """[N] int32: the position of every token of the pool's token space (0 for free blocks)."""
    first = jnp.concatenate(tables.first_pos)
    return (first[:, None] + jnp.arange(blk, dtype=jnp.int32)[None]).reshape(-1)


def sorted_positions(sorted_rows, values):
    """[R, V] int32: per row, jnp.searchsorted(sorted_rows[r], values[r]) (side left). Unrolled: the default
    'scan' method is an XLA while loop, which on the GPU runs its ~log2(n) iterations from the host, each
    waiting for the device (measured 0.45 ms per call at n = 3.3K on an H200, the larger part of a clo layer's
    host time); unrolled it is straight-line device code."""
    return jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"))(sorted_rows, values).astype(jnp.int32)


def tier_index(sizes, most):
    """The lax.switch branch for a gather of `most` rows: 0 (nothing) when most == 0, else 1 + the first of the
    ascending static `sizes` that holds it (a comparison count: no searchsorted loop)."""
    below = sum((jnp.asarray(most) > c).astype(jnp.int32) for c in sizes)
    return jnp.where(most == 0, 0, 1 + below).astype(jnp.int32)


UNION_TIER = 4  # the X-row gathers take K, 4K, 16K, ... rows (up to the whole union's bound), the smallest that fits


def union_tiers(K: int, n_kv: int, N: int) -> list:
    """Static sizes of the X-row gather: K rows per (request, head) make a union of at most min(n_kv K, N) tokens."""
    cap = max(1, min(n_kv * K, N))
    sizes, c = [], max(1, min(K, cap))
    while c < cap:
        sizes.append(c)
        c *= UNION_TIER
    return sizes + [cap]


def request_token_bound(layout, batch: int) -> int:
    """The most pool tokens one request can own in this layout: what every per-request buffer (selection
    indices, row buffers, a whole-context head's selection) is sized by. From the planner
    (`PoolLayout.request_blocks`: the longest prompt's full blocks plus one block per lockstep flush); for a
    layout that does not say, every prompt block (as if one request held them all) plus its share of the
    generated blocks."""
    if layout.request_blocks:
        return layout.block_tokens * min(layout.num_blocks, layout.request_blocks)
    prompt = layout.start(layout.prompt_extents)
    gen = layout.num_blocks - prompt
    return layout.block_tokens * min(layout.num_blocks, prompt + -(-gen // max(1, batch)))


def pool_block_tokens(pool) -> int:
    """blk of a layer's extents (whichever it stores: K/V [E, n_kv, blk, d] or X [E, blk, H])."""
    for ext, axis in ((pool.k, 2), (pool.v, 2), (pool.x, 1)):
        if ext[0] is not None:
            return jax.tree.leaves(ext[0])[0].shape[axis]
    raise ValueError("a layer with no extents")
