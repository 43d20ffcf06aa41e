"""A selection's rows: where the selected tokens' K/V rows come from inside a layer program (`HostRows`:
gathered from the pool's extents, device or pinned host memory read in place, or recomputed from
activation rows, store=act: `act_rows`), the layer program's sources (`SelectSources`) and attention over
the row buffers (`rows_attention`). Shared by `tokenselect` and `clo`.

Why gather rather than masked paged attention: masked paged attention reads every block of the
request (K and V of the whole context: no saving at all); the gather reads the K selected rows of K
and V per (request, head), writes them once and the attention reads them again: 3 * K rows against
the context's S rows (K = 2048 of S = 128K: ~1/20 of the bytes). A kernel reading the rows straight
from the extents would read K rows once (future work, with a paged scoring kernel: see the report).

Top-k over activations (store=act): the selected tokens' K/V recomputed from their X rows, X being per
token and shared by every head, so a request's X rows are those of the union of its heads' selections."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.runtime.attention import native_extent
from kvoffload.policies.selection.space import (
    pool_block_tokens,
    sorted_positions,
    tier_index,
    token_positions,
    union_tiers,
)


@dataclasses.dataclass(frozen=True)
class SelectSources:
    """The layer program's sources: the pool (as every policy's) and each request's tail length
    before this step's token (to count how many recent tokens the tail already covers)."""

    pool: object  # PoolSources
    tail_len: jax.Array  # [B] int32
    # static: the most blocks one request owns (`request_token_bound` / blk), the size of the per-request
    # token space the selection scores and ranks (`TokenSpace`); 0: not known (the whole pool's space)
    request_blocks: int = 0

    def windowed(self, key_start) -> "SelectSources":
        """A sliding-window layer's sources (`PoolSources.windowed`): the pool's attention masks keys before
        key_start; such a layer is a device layer and attends its pool as `full` does (`attend_pool`)."""
        return dataclasses.replace(self, pool=self.pool.windowed(key_start))


jax.tree_util.register_dataclass(SelectSources, data_fields=["pool", "tail_len"],
                                 meta_fields=["request_blocks"])


def recompute_rows(cfg, lp, x, positions, want_k: bool, impl="reference"):
    """(k or None, v) [B, n_kv, T, d] of activation rows x [B, T, H] at positions [B, T] (RoPE on K at each
    token's own position, through the family's recompute_kv); want_k False: V alone (K is on the GPU)."""
    from kvoffload.models.transformer import family

    if want_k:
        return family(cfg).recompute_kv(cfg, lp, x, positions, impl=impl)
    return ops.recompute_kv(x, None, None, lp.wv, lp.bv, n_kv=cfg.num_kv_heads)


def act_rows(cfg, lp, acts, blk, positions, indices, valid, want_k, dtype, impl="reference"):
    """(rows, x_rows): the K and V rows (want_k) or the V rows, each [B, n_kv, K, d] in dtype, of the tokens
    indices [B, n_kv, K] where valid, recomputed on the GPU from activation rows gathered from the X extents
    acts [E_e, blk, H] (host memory: `ops.gather_pool_rows`, zero-copy on the GPU). X is per token, shared by every
    head: a request's rows are those of the union of its heads' valid tokens (x_rows [B] of them), gathered
    once, in the smallest of `union_tiers` that holds the largest union (a ``lax.switch``; none when empty).
    positions [N]: each token of the pool's token space its position (RoPE; OPT's X carries its learned
    position already, added by the embedding)."""
    B, n_kv, K = indices.shape
    N = positions.shape[0]
    rows_b = jnp.arange(B)[:, None]
    mask = jnp.zeros((B, N), bool).at[rows_b, jnp.where(valid, indices, N).reshape(B, -1)].set(True, mode="drop")
    count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    rank = jnp.where(mask, jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1, N)
    d = cfg.head_dim
    sizes = union_tiers(K, n_kv, N)

    def tier(c):
        def run():
            union = jnp.full((B, c), -1, jnp.int32).at[rows_b, rank].set(
                jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)), mode="drop")  # ascending, then -1
            x = native_extent(ops.gather_pool_rows(acts, union, blk), dtype)
            k, v = recompute_rows(cfg, lp, x, positions[jnp.maximum(union, 0)], want_k, impl)
            keyed = jnp.where(union >= 0, union, jnp.int32(2 ** 30))
            at = jnp.minimum(sorted_positions(keyed, indices.reshape(B, -1)), c - 1).reshape(B, n_kv, K, 1)
            return tuple(jnp.take_along_axis(a, at, axis=2).astype(dtype) for a in ((k, v) if want_k else (v,)))
        return run

    zeros = lambda: tuple(jnp.zeros((B, n_kv, K, d), dtype) for _ in range(2 if want_k else 1))  # noqa: E731
    most = jnp.max(count)
    return jax.lax.switch(tier_index(sizes, most), [zeros] + [tier(c) for c in sizes]), count


def stores_acts(pool) -> bool:
    """Whether a layer's sources hold activation extents in place of its V extents (store=act)."""
    return pool.v[0] is None and pool.x[0] is not None


def rows_attention(q, k_rows, v_rows, num_valid, impl):
    """Attention over a selection's row buffers [B, n_kv, K, d] (the first num_valid valid:
    `ops.rows_attention`)."""
    return ops.rows_attention(q, k_rows, v_rows.astype(k_rows.dtype), num_valid, k_rows.shape[2], impl=impl)


@dataclasses.dataclass(frozen=True)
class HostRows:
    """Where a layer's selected rows come from on the host side (built inside a layer program): gathered
    from the extents of each buffer's part (store=kv: V, or K and V), or recomputed from X rows (store=act,
    `act_rows`: acts, the layer's weights lp and the pool's token positions)."""

    extents: tuple = ()  # per buffer its extents (kv)
    acts: tuple | None = None  # X extents (act)
    cfg: object = None
    lp: object = None
    positions: object = None  # [N] int32
    impl: str = "reference"

    @classmethod
    def of(cls, cfg, lp, pool, tables, parts, impl="reference"):
        """The rows of parts ("v", or "k" and "v") of a layer's sources."""
        if stores_acts(pool):
            return cls(acts=pool.x, cfg=cfg, lp=lp, positions=token_positions(tables, pool_block_tokens(pool)),
                       impl=impl)
        return cls(extents=tuple(pool.k if p == "k" else pool.v for p in parts))

    @staticmethod
    def wanted(indices, num_valid):
        """[B, n_kv, K] bool: the first num_valid entries of each (request, head)."""
        return jnp.arange(indices.shape[-1]) < num_valid[..., None]

    def tokens(self, indices, num_valid):
        """The token ids read: indices for the first num_valid of each row, -1 (read nothing) after."""
        return jnp.where(self.wanted(indices, num_valid), indices, -1)

    def __call__(self, indices, num_valid, dtypes, blk):
        """(rows [B, n_kv, K, d], one per part in `dtypes`, x_rows [B] int32: the X rows read) for indices
        [B, n_kv, K], the first num_valid [B, n_kv] of each (request, head) wanted (the others come back 0 and
        cost no transfer: a hit head's count of 0 moves nothing)."""
        if self.acts is None:  # rows past num_valid are not read (-1: outside every extent; a masked load)
            indices = self.tokens(indices, num_valid)
            rows = tuple(native_extent(ops.gather_pool_rows(ext, indices, blk), dt).astype(dt)
                         for ext, dt in zip(self.extents, dtypes))
            return rows, jnp.zeros(indices.shape[:1], jnp.int32)
        return act_rows(self.cfg, self.lp, self.acts, blk, self.positions, indices, self.wanted(indices, num_valid),
                        len(dtypes) == 2, dtypes[-1], self.impl)

    def refill(self, buffers, indices, num_valid, blk):
        """(buffers, x_rows [B]): each buffer [B, n_kv, K, d] (one per part) with rows [0, num_valid) of every
        (request, head) replaced by the rows of indices [B, n_kv, K] (a head with num_valid 0 keeps its rows;
        rows past num_valid keep theirs, never read). Extents: ``ops.refill_block_rows`` (on the GPU one kernel
        per buffer writing only the replaced rows, in place); X rows: recomputed (``__call__``) and merged."""
        if self.acts is None:
            tokens = self.tokens(indices, num_valid)
            return (tuple(ops.refill_block_rows(buf, ext, tokens, blk) for buf, ext in zip(buffers, self.extents)),
                    jnp.zeros(indices.shape[:1], jnp.int32))
        rows, x_rows = self(indices, num_valid, tuple(b.dtype for b in buffers), blk)
        keep = self.wanted(indices, num_valid)[..., None]
        return tuple(jnp.where(keep, r, buf) for r, buf in zip(rows, buffers)), x_rows
