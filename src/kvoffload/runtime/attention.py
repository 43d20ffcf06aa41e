"""Pool attention: what a layer attends (`PoolSources`) and the default attention over it (`attend_pool`): every
extent folded in order into an fp32 accumulator, activation extents recomputed to K/V first; on a mesh whose
activations are split by token, one recompute, one attention and one exchange for all recomputed extents."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.device import sharding as S
from kvoffload.models.transformer import family
from kvoffload.runtime.weights import split_layer


def recompute_extent(cfg, lp, x_ext, first_pos, impl="reference"):
    """K, V extents [E, n_kv, blk, d] recomputed from an activation extent [E, blk, H] through the
    family's recompute_kv (RoPE at each block's positions)."""
    blk = x_ext.shape[1]
    positions = first_pos[:, None] + jnp.arange(blk, dtype=jnp.int32)[None]
    # tensor parallel: X is stored split along H; every device needs all of it for its heads' K/V
    x_ext = S.constrain_replicated(x_ext)
    return family(cfg).recompute_kv(cfg, lp, x_ext, positions, impl=impl)


def _zero_kv(cfg, dtype, x_ext):
    x_ext = x_ext.codes if isinstance(x_ext, ops.QuantizedInt) else x_ext  # [E, blk, ...] either way
    shape = (x_ext.shape[0], cfg.num_kv_heads, x_ext.shape[1], cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True)
class PoolSources:
    """What a layer attends, per extent of the layout (a fixed structure for the whole run, so the
    layer program compiles once): K/V extents (fetched, GPU-resident, or a zero stand-in for an extent
    with no blocks yet) and activation extents (None where the layout stores none), and the number
    of leading extents whose K/V are recomputed from X this step."""

    k: tuple
    v: tuple
    x: tuple
    recompute: Any  # int32 scalar
    prompt_extents: int = 0  # extents [0, p) hold prompt blocks: in use from prefill on (static)
    # activation extents split by token over a mesh (`attend_pool_by_token`): per extent whether this step
    # recomputes it (static, so a mesh's layer program has no conditional: an XLA conditional reads its
    # predicate on the host, and a multi-device launch waits for that read); () on one device
    token_recompute: tuple = ()
    # [B] int32: a sliding-window layer's first attended position this step (`layer_body` sets it), or None
    key_start: Any = None

    @property
    def x_by_token(self) -> bool:
        return bool(self.token_recompute)

    def windowed(self, key_start) -> "PoolSources":
        """These sources for a sliding-window layer whose first attended position is key_start [B] (every
        layer program's sources answer `windowed`: a policy's own sources pass it to the pool they hold)."""
        return dataclasses.replace(self, key_start=key_start)


jax.tree_util.register_dataclass(PoolSources, data_fields=["k", "v", "x", "recompute", "key_start"],
                                 meta_fields=["prompt_extents", "token_recompute"])


def native_extent(a, dtype):
    """A K, V or X extent in the compute dtype: an int4 one (QuantizedInt, a host pool's storage) is
    dequantized here on the GPU, inside the layer program; a native one is returned as it is."""
    return ops.dequantize(a, dtype) if isinstance(a, ops.QuantizedInt) else a


def attend_pool(cfg, lp, q, acc, src: PoolSources, tables, slots, recompute_impl, attention_impl):
    """Folds every extent of the pool into acc, in order (the default hooks' attention). Returns
    (acc, slots): a policy's attention may update its per-layer slots; this one keeps none."""
    if src.x_by_token:
        return attend_pool_by_token(cfg, lp, q, acc, src, tables, recompute_impl, attention_impl), slots
    for e in range(len(src.k)):
        if src.x[e] is None:
            k, v = native_extent(src.k[e], q.dtype), native_extent(src.v[e], q.dtype)
        elif src.k[e] is None and e < src.prompt_extents:  # activations of the prompt: always in use
            k, v = recompute_extent(cfg, lp, native_extent(src.x[e], q.dtype), tables.first_pos[e], recompute_impl)
        elif src.k[e] is None:  # activations only: recomputed once some request has blocks there (a
            # conditional reads its predicate on the host mid-program, so only where usage changes)
            k, v = jax.lax.cond(jnp.any(tables.count[e] > 0),
                                lambda x, f: recompute_extent(cfg, lp, native_extent(x, q.dtype), f, recompute_impl),
                                lambda x, f: _zero_kv(cfg, q.dtype, x), src.x[e], tables.first_pos[e])
        else:  # both stored: this step's split decides (one branch runs)
            k, v = jax.lax.cond(e < src.recompute,
                                lambda x, kk, vv, f: recompute_extent(cfg, lp, native_extent(x, q.dtype), f,
                                                                      recompute_impl),
                                lambda x, kk, vv, f: (native_extent(kk, q.dtype), native_extent(vv, q.dtype)),
                                src.x[e], src.k[e], src.v[e], tables.first_pos[e])
        window = {} if src.key_start is None else dict(first_pos=tables.first_pos[e], start=src.key_start)
        part = ops.paged_decode_attention(q, k, v, tables.table[e], tables.count[e], impl=attention_impl, **window)
        acc = ops.merge_attention_into(acc, part)
    return acc, slots


def attend_pool_by_token(cfg, lp, q, acc, src: PoolSources, tables, recompute_impl, attention_impl):
    """attend_pool on a mesh whose activation extents are split by token (`sharding.X_TOKEN_SPEC`): the
    extents this step recomputes (`PoolSources.token_recompute`, static) together through
    `attend_act_by_token` (one exchange for all of them), then the others' K/V as there (each device its
    heads; an extent not in use has an empty table), in extent order."""
    rec = [e for e in range(len(src.k)) if src.token_recompute[e]]
    if rec:
        pick = lambda field: tuple(field[e] for e in rec)  # noqa: E731
        acc = attend_act_by_token(cfg, lp, q, acc, pick(src.x), pick(tables.first_pos), pick(tables.table),
                                  pick(tables.count), recompute_impl, attention_impl)
    for e in range(len(src.k)):
        if not src.token_recompute[e] and src.k[e] is not None:
            part = ops.paged_decode_attention(q, native_extent(src.k[e], q.dtype), native_extent(src.v[e], q.dtype),
                                              tables.table[e], tables.count[e], impl=attention_impl)
            acc = ops.merge_attention_into(acc, part)
        # else: recomputed above, or activations alone of an extent no request has blocks in: nothing to attend
    return acc


def attend_act_by_token(cfg, lp, q, acc, x_exts, first_pos, tables, counts, recompute_impl, attention_impl):
    """acc with the attention over activation extents folded in, on a mesh where each extent [E, blk, H] is
    split by token (each device holds blk / N tokens of every block, whole along H): each device lays its
    slices of the extents end to end, recomputes the K/V of every head for its tokens (RoPE at their
    positions) from W_K / W_V whole (replicated where weights stay on the GPU, gathered once per layer where
    they stream: `gathers_kv`) and attends every query head over them in one paged kernel call
    (blk / N-token blocks, the extents' tables joined: `ops.join_block_tables`); one all-to-all hands each
    device the N partial (out, lse) of its heads, which it folds into its part of acc in token order. One
    recompute, one attention and one exchange per layer program whatever the number of extents (each per
    extent cost launches, and an N=4 mesh's step is host-bound). No X crosses between devices. x_exts,
    first_pos, tables, counts: one entry per extent."""
    from jax.sharding import PartitionSpec as P

    n = S.context_size()
    kv_only, _ = split_layer(lp)
    heads = P(None, S.MODEL)

    def local(q, acc, xs, first_pos, lp_kv, tables, counts):
        # the extents laid end to end: one recompute and one paged attention for all of them (per extent
        # each cost a GEMM, the kernel and a fold: launches, which bound an N=4 mesh's step)
        xs = [native_extent(x, q.dtype) for x in xs]
        x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, 0)
        pos0 = first_pos[0] if len(xs) == 1 else jnp.concatenate(first_pos, 0)
        t = x.shape[1]
        positions = pos0[:, None] + jax.lax.axis_index(S.MODEL) * t + jnp.arange(t, dtype=jnp.int32)[None]
        k, v = family(cfg).recompute_kv(cfg, lp_kv, x, positions, impl=recompute_impl)
        table, count = ops.join_block_tables(tables, counts, [a.shape[0] for a in xs])
        mine = ops.paged_decode_attention(q, k, v, table, count, impl=attention_impl)
        # [N, B, heads / N, d + 1]: entry j is device j's partial over its tokens, for this device's heads
        both = jnp.concatenate([mine[0].astype(jnp.float32), mine[1][..., None]], -1)
        parts = jax.lax.all_to_all(both[None], S.MODEL, 2, 0, tiled=True)
        for j in range(n):
            acc = ops.merge_attention_into(acc, (parts[j, ..., :-1], parts[j, ..., -1]))
        return acc

    rep = S.REPLICATED
    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(rep, (heads, heads), S.X_TOKEN_SPEC, rep, rep, rep, rep),
                         out_specs=(heads, heads), check_vma=False)(q, acc, tuple(x_exts), tuple(first_pos), kv_only,
                                                                    tuple(tables), tuple(counts))
