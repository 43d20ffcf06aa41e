"""The layer pipeline: prefill into the block pool and decode layer by layer, for every pool policy.

One loop for all layered policies (`full`, `offload`, `kvpr`; `hybrid`, `clo` and `tokenselect` plug in
the same way). The loop is driven from Python: for work item n (layer i of GPU batch g) it first issues
item n+1's transfers (eager ``device_put`` of whole arrays: the only transfers that overlap the jitted
compute dispatched after them), then item n's jitted compute. A policy is a set of `LayerHooks`:

* ``split_store`` -- at prefill: which extents hold K/V and which activations;
* ``plan_group``  -- once per step and GPU batch, on the host: what each layer will need (which extents
  to fetch, which to recompute, a selection to run first) and what to record;
* ``fetch``       -- the host arrays layer i needs, as (early, late): early transfers (activations to
  recompute from) are issued right after W_K/W_V, late ones (K/V) after the rest of the weights;
* ``sources``     -- the layer program's inputs, a structure fixed for the run (so it compiles once);
* ``attend``      -- a pure function inside the layer's one jitted program: fold the sources (fetched,
  recomputed, GPU-resident) into the attention accumulator, in extent order;
* ``init_slots``  -- the policy's own state carried from step to step in `GroupState.slots`;
* ``speculate``   -- before layer i's program, from its input hidden state: may update layer i+1's slots
  (clo's speculative prefetch: a guessed selection whose rows move while layer i computes).

The pipeline owns what all policies share: weights (resident or streamed, W_K/W_V first), the new
token's q/k/v and its GPU tail, the tail's flush into the pool, schedules (``row``: each GPU batch through
every layer; ``column``: every GPU batch through layer i before layer i+1, zig-zag, each layer's weights
fetched once per step), how far transfers run ahead (item n+D-1's transfers are issued before item n's
program, D = ``sync_depth``; before issuing item m the host waits for item m-D-1's program, so at most D+1
items' buffers are alive), and the step record.

Attention of a layer: the extents in order (``ops.paged_decode_attention`` over each extent's block
tables, folded into an fp32 accumulator with ``ops.merge_attention_into``), then the GPU tail. `full`
runs the same programs over the same pool in device memory, so an offloading policy that moves the
same blocks gives `full`'s logits bit for bit.

int4 host storage (``host_dtype="int4"``, offload, kvpr, hybrid, clo, tokenselect kv=split): every K, V and X extent of a host
pool is a ``QuantizedInt`` (uint8 codes, float32 step and min per group; along d for K/V, along H for
X), quantized on the GPU on its way to the host (prefill's extents, each flushed block: its three
arrays written in place), fetched as it is in the same eager ``device_put`` list and dequantized to the
compute dtype inside the layer program (`native_extent`) before the paged attention or
`recompute_extent`. GPU-resident extents (hybrid's device classes) and the GPU tails stay in the
model's dtype: they never cross PCIe, so quantizing them would cost accuracy and save no transfer; so do
K extents a policy keeps on the GPU (`keys_on_device`). clo and tokenselect fetch no extent: their layer
program gathers the selected rows of the quantized extents and dequantizes those rows.

State: `DecodeState` is a pytree (pool arrays, tails, tables) with host bookkeeping (the allocator,
counters, the step records) as static fields; a step takes it and returns a new one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.errors import KVOffloadError
from kvoffload.config import UnsupportedModelError
from kvoffload.models.common import attention_window
from kvoffload.models.transformer import family, layer_prefill, layer_prefill_chunked
from kvoffload.device import memory as M
from kvoffload.device import sharding as S
from kvoffload.plan.memory import prefill_chunk_rows, weight_bytes_per_device
from kvoffload.runtime.pool import (
    BlockAllocator,
    BlockTables,
    PoolLayout,
    allocate_prompts_aligned,
    extent_sources,
    gather_act_extent,
    gather_kv_extent,
    quantize_blocks,
    write_stored_blocks_many,
    write_stored_blocks_strided,
)

KV_FIELDS = S.KV_FIELDS
SCHEDULES = ("row", "column")


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def split_layer(lp):
    """(W_K/W_V part, the rest) of one layer's params (same dataclass, other fields None)."""
    fields = [f.name for f in dataclasses.fields(lp)]
    kv = dataclasses.replace(lp, **{f: None for f in fields if f not in KV_FIELDS})
    rest = dataclasses.replace(lp, **{f: None for f in fields if f in KV_FIELDS})
    return kv, rest


def join_layer(kv, rest):
    return dataclasses.replace(rest, **{f: getattr(kv, f) for f in KV_FIELDS if hasattr(kv, f)})


def without_layers(params):
    return dataclasses.replace(params, layers=())


# ---------------------------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------------------------


def _register(cls, meta):
    data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))
    return cls


@dataclasses.dataclass(frozen=True)
class GroupState:
    """One GPU batch: its share of the pool, block tables, GPU tail and the policy's slots."""

    pool_k: tuple  # [layer][extent] K extents [E, n_kv, blk, d] (None where not stored)
    pool_v: tuple
    pool_x: tuple  # [layer][extent] activation extents [E, blk, H] (None where not stored)
    tables: BlockTables  # per extent, shared by all layers
    tail_k: tuple  # [layer] [b, n_kv, 2 blk, d]: each request's partial block and the newest tokens
    tail_v: tuple
    tail_x: tuple  # [layer] [b, 2 blk, H] or None
    tail_len: Any  # [b] int32: valid tail slots
    slots: tuple  # [layer] the policy's per-request / per-head state (a pytree each), or () if none
    # host bookkeeping (static)
    rows: tuple  # (start, stop) in the whole batch
    layout: PoolLayout
    alloc: BlockAllocator
    tail_base: tuple  # per request: prompt tokens kept in the tail (len % blk)
    n_gen: int  # tokens generated so far (appended to the tail)
    since_flush: int  # generated tokens in the tail (a block is flushed every blk of them)
    # the looped layers' tails, slots and pool as one `LayerStack` (`PipelineOptions.loop_layers`; their entries
    # above are then None), or None
    stack: Any = None
    # [b] int32: the next token's positions (prompt length + n_gen), advanced on the device by each step's input
    # program: a Python int there was a host->device copy a step (~1 ms of an H200 host's step, traced). It and
    # tail_len start committed, as that program's outputs are (else the first step's programs compile twice)
    next_positions: Any = None

    @property
    def size(self) -> int:
        return self.rows[1] - self.rows[0]

    def slots_by_layer(self) -> tuple:
        """Every layer's slots (() where the policy keeps none); a looped layer's copied out of the stack as
        arrays of its own (statistics and checks, not a step's path)."""
        if self.stack is None or not self.slots:
            return self.slots
        return tuple(self.layer_slot(i) for i in range(len(self.slots)))

    def layer_slot(self, i: int):
        """Layer i's slots (`slots_by_layer`'s entry i)."""
        stk = self.stack
        if stk is None or i < stk.first:
            return self.slots[i]
        j = i - stk.first
        fixed = None if stk.fixed is None else jax.tree.map(lambda a: a[j], stk.fixed)
        return join_slots(stk.attend, unstack_layer(stk.st, j)[2], fixed)

    @property
    def used_extents(self) -> int:
        return self.alloc.used_extents(self.layout)


_register(GroupState, ("rows", "layout", "alloc", "tail_base", "n_gen", "since_flush"))


@dataclasses.dataclass(frozen=True)
class DecodeState:
    groups: tuple  # of GroupState
    batch: int
    step: int = 0
    records: tuple = ()  # one dict per decode step, the last RECORDS_KEPT (all with a trace; LayerPipeline.record)
    step_started: float | None = None  # host clock at the previous step's start (trace timing)


_register(DecodeState, ("batch", "step", "records", "step_started"))
RECORDS_KEPT = 1024  # step records a DecodeState keeps without PipelineOptions.trace (a long generation's grew a
# tuple copied whole every step)


# ---------------------------------------------------------------------------------------------
# jitted pieces (one program each, reused by every layer, extent and step)
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(cfg, params, tokens, positions):
    return family(cfg).embed(cfg, params, tokens, positions)


_log = logging.getLogger(__name__)  # a token-chunked (long) prefill reports each layer at INFO


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(cfg, params, h):
    return family(cfg).logits(cfg, params, h)


# A decode step's work outside its layer programs, one program each: an eager slice or add is a dispatch of
# its own (~30 us of host on an H100 host), and a host-bound step (clo at b1) pays every one of them.
@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode_inputs(cfg, params, tokens, next_positions, tail_len):
    """(h [B, 1, H], positions [B, 1], the next step's positions, the tail lengths after this step's token) of a
    decode step's new tokens [B] at next_positions [B] (the counters advanced here: no eager add a step)."""
    positions = next_positions[:, None]
    with jax.named_scope("embed"):
        h = family(cfg).embed(cfg, params, tokens[:, None], positions)
    return h, positions, next_positions + 1, tail_len + 1


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode_logits(cfg, params, h):
    with jax.named_scope("logits"):
        return family(cfg).logits(cfg, params, h[:, 0])


@functools.partial(jax.jit, static_argnames=("cfg", "keep_x", "chunk_tokens", "attention_impl"))
def _layer_prefill(cfg, lp, h, positions, lengths, keep_x, chunk_tokens=None, attention_impl="reference"):
    if chunk_tokens:  # token chunks: a chunk's workspace, not the whole prompt's
        return layer_prefill_chunked(cfg, lp, h, positions, lengths, chunk_tokens, keep_x,
                                     attention_impl=attention_impl)
    h, k, v, x = layer_prefill(cfg, lp, h, positions, lengths)
    return h, k, v, (x if keep_x else None)


@functools.partial(jax.jit, donate_argnums=0)
def _put_row_chunk(bufs, outs, start):
    """A row chunk's layer-prefill outputs (h, k, v, x; x may be None) written into the group's buffers in
    place, at row `start`: the chunks' outputs are never all alive beside a concatenation of them."""
    return jax.tree.map(lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, o, start, 0), bufs, outs)


@jax.jit
def _last_hidden(h, lengths):
    return jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]


def put_rows(tail, new, at, axis):
    """tail[r] with new[r] written at index at[r] along axis (of the per-row array)."""
    return jax.vmap(lambda t, n, i: jax.lax.dynamic_update_slice_in_dim(t, n, i, axis))(tail, new.astype(tail.dtype), at)


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


def layer_body(cfg, lp, h, positions, tail_k, tail_v, tail_x, tail_len, sources, tables, slots, slots_fixed, attend,
               options):
    """One decode layer (`layer_step`'s program): the new token's q/k/v (k/v and x written into the GPU tail at
    each request's tail_len), the policy's attention over its sources (`attend`, a pure function
    folding sources into an fp32 accumulator and updating the layer's slots), the tail folded last,
    output projection and MLP. slots_fixed: the slots' part the program never writes (`split_slots`), or None.
    Returns (h, tail_k, tail_v, tail_x, slots), slots without that part."""
    if slots_fixed is not None:
        slots = attend.join_slots(slots, slots_fixed)
    fam = family(cfg)
    # named scopes: a profile's kernels map to these parts (`kvoffload.profile`; the policy's attend names its
    # own parts inside "pool_attention")
    with jax.named_scope("qkv"):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        tail_k = put_rows(tail_k, k, tail_len, 1)
        tail_v = put_rows(tail_v, v, tail_len, 1)
        if tail_x is not None:
            tail_x = put_rows(tail_x, x, tail_len, 0)
        q = q[:, :, 0]
    recompute_impl, attention_impl = options
    window = attention_window(cfg, lp)
    if window is not None:  # a sliding layer (pool sources only: `sliding_refusal`): keys at positions > p - window
        sources = dataclasses.replace(sources, key_start=positions[:, 0] - window + 1)
    with jax.named_scope("pool_attention"):
        acc, slots = attend(cfg, lp, q, ops.empty_attention(q), sources, tables, slots, recompute_impl,
                            attention_impl)
    with jax.named_scope("tail_attention"):
        # tail slot j holds position p - tail_len + j (the new token at j = tail_len)
        tail_start = None if window is None else tail_len - window + 1
        o, _ = ops.merge_attention_into(acc, ops.decode_attention(q, tail_k, tail_v, tail_len + 1, start=tail_start,
                                                                  impl=attention_impl))
    with jax.named_scope("out_mlp"):
        h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o.astype(h.dtype)[:, :, None]))
    if slots_fixed is not None:
        slots = attend.split_slots(slots)[0]
    return h, tail_k, tail_v, tail_x, slots


# One decode layer, one program (`layer_body`): the tails and the slots are donated; the slots' fixed part is
# read only, and not returned: each output costs the host a few us a call (~2.3 us on a CPU); 15 of a clo layer's
# 32 outputs were fixed (Quest int8, 4 extents; 17 with a replayed draw).
layer_step = functools.partial(jax.jit, static_argnames=("cfg", "attend", "options"),
                               donate_argnames=("tail_k", "tail_v", "tail_x", "slots"))(layer_body)


def split_slots(attend, slot):
    """(the part of slot a layer program changes, the part it only reads or None): `attend.split_slots` where
    the policy has one (host side, per call: it must be cheap)."""
    split = getattr(attend, "split_slots", None)
    return (slot, None) if split is None or slot is None else split(slot)


def join_slots(attend, slot, fixed):
    return slot if fixed is None else attend.join_slots(slot, fixed)


# ---------------------------------------------------------------------------------------------
# a step's looped layers as one program (docs/ARCHITECTURE.md "A step in one program")
# ---------------------------------------------------------------------------------------------

# slot fields holding a selection's row buffers [B, n_kv, K, d]: stacked along their rows, not sliced (`LayerRows`)
ROW_BUFFER_FIELDS = ("k_rows", "v_rows")


@dataclasses.dataclass(frozen=True)
class StackedLayers:
    """What n consecutive decode layers change in a step, stacked for `loop_layers` (which donates it): tails
    [n, ...] and the slots' moving part (leaves [n, ...], except the row buffers of `ROW_BUFFER_FIELDS`: every
    layer's along the rows of one [B, n_kv, n K, d] array, K = `rows`, so they are refilled and attended in place).
    The weights ([n, ...], read in place by index: `models.common.layer_weights`) and the slots' fixed part
    ([n, ...]) travel beside it, read only. `stack_layers` builds it and the fixed part; `layer_slots` gives a
    layer's back."""

    tail_k: jax.Array
    tail_v: jax.Array
    moving: Any
    rows: int = 0  # static: K, each layer's row-buffer rows (0: no row buffers)


_register(StackedLayers, ("rows",))


def _buffers(slots):
    return [f for f in ROW_BUFFER_FIELDS if getattr(slots, f, None) is not None]


def _without_buffers(slots):
    fields = _buffers(slots)
    return dataclasses.replace(slots, **dict.fromkeys(fields)) if fields else slots


def stack_layers(attend, tails_k, tails_v, slots, rows_in_place: bool = True):
    """(StackedLayers, fixed slots) of per-layer tails and whole slots, one entry per layer, all of one program
    (`program_key`); copies (the per-layer arrays stay the caller's). fixed is None where the policy's slots have
    no read-only part (`split_slots`). rows_in_place=False stacks the row buffers [n, ...] like the other slots
    (sliced in the loop, so copied out and back: for measuring that). The weights: `models.common.stack_trees`."""
    from kvoffload.models.common import stack_trees as stack

    split = [split_slots(attend, sl) for sl in slots]
    moving = [m for m, _ in split]
    fields = _buffers(moving[0]) if moving[0] is not None and rows_in_place else []  # None: a policy without slots
    rows = int(getattr(moving[0], fields[0]).shape[2]) if fields else 0
    st = stack([_without_buffers(m) for m in moving] if fields else moving)
    if fields:
        st = dataclasses.replace(st, **{f: jnp.concatenate([getattr(m, f) for m in moving], axis=2) for f in fields})
    fixed = None if split[0][1] is None else stack([f for _, f in split])
    return StackedLayers(tail_k=stack(tails_k), tail_v=stack(tails_v), moving=st, rows=rows), fixed


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """A GPU batch's layers first..L-1 run as one `loop_layers` program (`PipelineOptions.loop_layers`): their
    tails and moving slots (`StackedLayers`), fixed slots ([n, ...], or None) and pool extents holding every
    looped layer's blocks (`stacked_extent`; 1-byte arrays padded past 4 GiB, `addressable_rows`). A policy
    reading rows by token id (`LayerHooks.reads_rows`) gets ONE extent a kind, layer j's extents one after
    another from block j x sum(blocks) (its token ids then shift by a layer's tokens); a policy attending blocks
    through the tables gets one stacked extent per extent of the layout, layer j's part of extent e at block
    j x blocks[e] (its tables shift by that). The group's per-layer entries of these layers are None;
    `GroupState.slots_by_layer` gives their slots back."""

    st: StackedLayers
    fixed: Any
    pool_k: tuple
    pool_v: tuple
    first: int = 0  # static: the first looped layer
    blocks: tuple = ()  # static: a layer's blocks in each extent of the layout
    by_rows: bool = False  # static: one extent a kind, read at token ids + j x sum(blocks) x blk
    attend: Any = None  # static: the policy's attend (joins the fixed slots back)

    @property
    def layers(self) -> int:
        return int(self.st.tail_k.shape[0])

    def extent_of(self, e: int):
        """(stacked extent, base, stride): layer j's block s of the layout's extent e is block base + s + j x stride
        of that stacked extent."""
        if self.by_rows:
            return 0, sum(self.blocks[:e]), sum(self.blocks)
        return e, 0, self.blocks[e]


_register(LayerStack, ("first", "blocks", "by_rows", "attend"))


@dataclasses.dataclass(frozen=True)
class LayerRows:
    """One layer's row buffer [B, n_kv, K, d] held inside `stacked` [B, n_kv, R, d], the buffers of several layers
    along the rows, the layer's at rows [offset, offset + K): what a step looping over stacked layers gives a
    layer for its selection's buffers, so the refill kernel writes them in place (tokenselect's `HostRows.refill`) and sparse
    attention reads them in place (at slot ids + offset). A dynamic slice of a stacked [n, ...] buffer would be
    copied out and back by XLA every layer (2 x 25.6 MiB a layer at 128K: H200, 2026-11-28).
    Anything reading it as an array (`__jax_array__`) gets the layer's rows."""

    stacked: jax.Array
    offset: jax.Array  # [] int32
    rows: int  # K (static)

    shape = property(lambda self: tuple(self.stacked.shape[:2]) + (self.rows, self.stacked.shape[3]))
    dtype = property(lambda self: self.stacked.dtype)
    ndim = 4

    def __jax_array__(self):
        return jax.lax.dynamic_slice_in_dim(self.stacked, self.offset, self.rows, axis=2)

    def astype(self, dtype):
        return self if jnp.dtype(dtype) == self.dtype else self.__jax_array__().astype(dtype)

    def with_stacked(self, stacked) -> "LayerRows":
        return LayerRows(stacked=stacked, offset=self.offset, rows=self.rows)


jax.tree_util.register_dataclass(LayerRows, data_fields=["stacked", "offset"], meta_fields=["rows"])


def layer_slots(st: StackedLayers, j):
    """Layer j's moving slots (j traced inside the loop): sliced leaves, row buffers as `LayerRows` (in place)."""
    fields = _buffers(st.moving) if st.rows else []
    sliced = jax.tree.map(lambda a: a[j], _without_buffers(st.moving) if fields else st.moving)
    if not fields:
        return sliced
    off = jnp.asarray(j, jnp.int32) * st.rows
    return dataclasses.replace(sliced, **{f: LayerRows(getattr(st.moving, f), off, st.rows) for f in fields})


def with_layer_slots(st: StackedLayers, j, slots):
    """st's moving slots with layer j's replaced by slots (`layer_slots`' form: a row buffer's `LayerRows`
    already holds the whole updated array)."""
    if not st.rows:
        return jax.tree.map(lambda a, x: a.at[j].set(x), st.moving, slots)
    fields = _buffers(st.moving)
    out = jax.tree.map(lambda a, x: a.at[j].set(x), _without_buffers(st.moving), _without_buffers(slots))
    return dataclasses.replace(out, **{f: getattr(slots, f).stacked for f in fields})


def unstack_layer(st: StackedLayers, j: int):
    """(tail_k, tail_v, moving slots) of layer j as arrays of its own (statistics readers, checks)."""
    slots = jax.tree.map(lambda a: jnp.asarray(a) if isinstance(a, LayerRows) else a, layer_slots(st, j),
                         is_leaf=lambda a: isinstance(a, LayerRows))
    return st.tail_k[j], st.tail_v[j], slots


def stacked_extent(exts):
    """One extent of extents of one block shape (K or V extents as the pool stores them: arrays or int4
    `QuantizedInt`s) one after another in the order given, where the first lives (host extents through host
    memory); a 1-byte array of 2-4 GiB padded past 4 GiB (`addressable_rows`: the Triton lowering's 32-bit
    offsets; the padding is never read). None where they hold none."""
    from kvoffload.pallas.common import addressable_rows

    if exts[0] is None:
        return None
    leaves = jax.tree.leaves(exts[0])
    on_host = leaves[0].sharding.memory_kind not in (None, "device")
    n_rows = sum(jax.tree.leaves(x)[0].shape[0] for x in exts)
    rows = max([addressable_rows(n_rows, a[0].nbytes) for a in leaves if a.dtype.itemsize == 1], default=n_rows)

    def join(*parts):
        like = parts[0]
        if not on_host:  # device memory: one XLA concatenate
            pad = [jnp.zeros((rows - n_rows,) + like.shape[1:], like.dtype, device=like.sharding)] if rows > n_rows else []
            return jnp.concatenate(list(parts) + pad)
        out = np.zeros((rows,) + like.shape[1:], like.dtype)  # host: filled part by part, placed once
        at = 0
        for a in parts:
            out[at:at + a.shape[0]] = np.asarray(a)
            at += a.shape[0]
        return jax.device_put(out, like.sharding)

    return jax.tree.map(join, *exts)


def _layer_fixed(fixed, j):
    """Layer j's fixed slots, sliced (a policy's `layer_fixed` may read some in place instead)."""
    return jax.tree.map(lambda a: a[j], fixed)


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "options", "row_stride", "table_stride",
                                             "linear_by_index"), donate_argnames=("st",))
def loop_layers(cfg, lp, st: StackedLayers, fixed, h, positions, tail_len, sources, tables, attend, options,
                row_stride: int = 0, table_stride: tuple = (), linear_by_index: bool = True):
    """The layers of st as one program: a `fori_loop` over `layer_body` with the policy's attend, its weights
    lp [n, ...] by index (linear_by_index: `layer_weights`; else sliced, which XLA copies out), its row buffers
    in place, its fixed slots sliced (or as the policy's `layer_fixed` gives them). sources' pool holds every
    layer's blocks (`LayerStack`): a selection policy
    reads layer j's rows at token ids + j x row_stride (`SelectSources.row_offset`), a policy attending whole
    blocks through the block tables gets extent e's shifted by j x table_stride[e]. The host issues the whole
    stack in one call. Returns (h, st) with st's tails and slots updated (st donated)."""
    from kvoffload.models.common import layer_weights

    def body(j, carry):
        h, now = carry
        lw = layer_weights(lp, j) if linear_by_index else jax.tree.map(lambda a: a[j], lp)
        src = dataclasses.replace(sources, row_offset=(j * row_stride).astype(jnp.int32)) if row_stride else sources
        tbl = tables if not table_stride else dataclasses.replace(
            tables, table=tuple(t + j * stride for t, stride in zip(tables.table, table_stride)))
        fx = None if fixed is None else getattr(attend, "layer_fixed", _layer_fixed)(fixed, j)
        h, k, v, _, m = layer_body(cfg, lw, h, positions, now.tail_k[j], now.tail_v[j], None, tail_len, src, tbl,
                                   layer_slots(now, j), fx, attend, options)
        return h, dataclasses.replace(now, tail_k=now.tail_k.at[j].set(k), tail_v=now.tail_v.at[j].set(v),
                                      moving=with_layer_slots(now, j, m))

    return jax.lax.fori_loop(0, st.tail_k.shape[0], body, (h, st))


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "options"), donate_argnames=("tail_k", "tail_v", "tail_x", "slots"))
def layers_step(cfg, lp, h, positions, tail_k, tail_v, tail_x, tail_len, sources, tables, slots, slots_fixed, attend,
                options):
    """Consecutive decode layers in one program (`PipelineOptions.layers_per_program`): lp, tail_k, tail_v,
    tail_x, sources, slots and slots_fixed are tuples, one entry per layer, run in order by `layer_body`; one call
    of the host instead of one per layer. Returns (h, tail_k, tail_v, tail_x, slots), the same tuples updated."""
    out = ([], [], [], [])
    for args in zip(lp, tail_k, tail_v, tail_x, sources, slots, slots_fixed):
        lp_i, tk, tv, tx, src, sl, fx = args
        h, tk, tv, tx, sl = layer_body(cfg, lp_i, h, positions, tk, tv, tx, tail_len, src, tables, sl, fx, attend,
                                       options)
        for lst, val in zip(out, (tk, tv, tx, sl)):
            lst.append(val)
    return (h,) + tuple(tuple(lst) for lst in out)


def program_key(tree):
    """What decides a layer program's compilation: the tree's structure and every leaf's shape, dtype and memory
    kind. Consecutive layers with equal keys can share one `layers_step` program."""
    leaves, treedef = jax.tree.flatten(tree)
    # the dtype objects themselves (hashable): str(dtype) cost ~150 us a clo layer, ~5 ms a 32-layer step (CPU)
    return treedef, tuple((a.shape, a.dtype, a.sharding.memory_kind) if isinstance(a, jax.Array) else
                          (getattr(a, "shape", None), getattr(a, "dtype", type(a))) for a in leaves)


def distinct_arrays(tree):
    """tree with every array that appears more than once replaced by copies after its first appearance: the
    layer programs donate the slots, so two layers (or two fields) sharing one array would see it deleted."""
    seen = set()

    def one(a):
        if not isinstance(a, jax.Array):
            return a
        if id(a) in seen:
            return jnp.copy(a)
        seen.add(id(a))
        return a
    return jax.tree.map(one, tree)


def _pop(tail, blk, axis):
    """(the first blk tail slots of every request, the tail shifted left by blk)."""
    block = jax.lax.slice_in_dim(tail, 0, blk, axis=axis + 1)
    rest = jax.lax.slice_in_dim(tail, blk, tail.shape[axis + 1], axis=axis + 1)
    return block, jnp.concatenate([rest, jnp.zeros_like(block)], axis=axis + 1)


@functools.partial(jax.jit, static_argnames=("blk", "axes"), donate_argnums=(0,))
def _pop_blocks(tails, blk, axes):
    """`_pop` of each of several tails (token axis of a row axes[i]) in one program: (blocks, tails)."""
    popped = [_pop(t, blk, a) for t, a in zip(tails, axes)]
    return tuple(b for b, _ in popped), tuple(t for _, t in popped)


@functools.partial(jax.jit, static_argnames=("specs",))
def _quantize_many(blocks, specs):
    """`quantize_blocks(b, *spec)` of each block array in one program (a flush's every layer)."""
    return tuple(quantize_blocks(b, *spec) for b, spec in zip(blocks, specs))


@functools.partial(jax.jit, static_argnames=("blk", "slots", "axis"))
def _tail_from_prompt(a, start, blk, slots, axis):
    """Each request's slots [start, start + blk) of a prefill array (axis = the token axis of a row),
    placed at the front of a tail of `slots` slots."""
    part = jax.vmap(lambda t, s: jax.lax.dynamic_slice_in_dim(t, s, blk, axis))(a, start)
    if slots <= blk:
        return jax.lax.slice_in_dim(part, 0, slots, axis=axis + 1)
    pad = [(0, 0)] * part.ndim
    pad[axis + 1] = (0, slots - blk)
    return jnp.pad(part, pad)


# ---------------------------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What a policy decided for one GPU batch this step (host side)."""

    used_extents: int  # extents [0, n) hold blocks
    recompute_extents: int = 0  # extents [0, r) attended from recomputed K/V
    note: str = ""
    # per extent, how the layer gets it (derived from the two counts above when empty):
    # "dev" the pool's own array (device memory), "kv" K/V fetched, "x" activations fetched (recomputed),
    # "skip" no blocks in use (a zero stand-in, empty tables)
    modes: tuple = ()
    groups_info: dict | None = None  # what the policy wants in the step record for this GPU batch
    # a host pool with sliding-window layers: those layers' modes, "skip" where every block of the extent has
    # left its request's window (`LayerPipeline.window_plan`; the window mask ignores their keys anyway)
    sliding_modes: tuple = ()

    def layer_modes(self, pipe: "LayerPipeline", layout: PoolLayout, layer: int) -> tuple:
        """extent_modes as layer `layer` gets its extents (a sliding layer: sliding_modes, where set)."""
        if self.sliding_modes and pipe.sliding_layers[layer]:
            return self.sliding_modes
        return self.extent_modes(pipe, layout)

    def extent_modes(self, pipe: "LayerPipeline", layout: PoolLayout) -> tuple:
        if self.modes:
            return self.modes
        out = []
        for e in range(layout.num_extents):
            if not pipe.host_pool or layout.on_device(e):
                out.append("dev")
            elif e < self.recompute_extents:
                out.append("x")
            elif e < self.used_extents:
                out.append("kv")
            else:
                out.append("skip")
        object.__setattr__(self, "modes", tuple(out))  # computed once per step and GPU batch
        return self.modes


class LayerHooks:
    """A policy's part of the layer loop (see the module doc). The default hooks attend every used
    extent from the pool as it is (device memory: `full`; host memory: fetched whole: `offload`)."""

    name = "pool"
    kinds = ("kv",)  # what the pool can store (split_store says where)
    # on a mesh, how activation extents are split: "token" (each device recomputes every head's K/V of its
    # tokens: `attend_act_by_token`; the extents' K/V are attended whole, by `attend_pool`) or "hidden"
    # (along H: single X rows readable on every device, for policies that gather rows)
    x_split = "hidden"
    # MiB of K per extent on each device where PipelineOptions.extent_mb is not given (None:
    # EXTENT_MB_PER_DEVICE, the unit a fetching policy moves, shared with `full` for the same blocks)
    extent_mb_per_device: float | None = None

    def recomputes(self, pipe: "LayerPipeline", model) -> bool:
        """Whether this run may recompute K/V from activation extents (on a token-split mesh each device then
        keeps W_K / W_V whole when the weights stay on the GPU)."""
        return "act" in self.kinds

    def plan_group(self, pipe: "LayerPipeline", model, group: GroupState) -> GroupPlan:
        return GroupPlan(used_extents=group.used_extents)

    def sliding_refusal(self, pipe: "LayerPipeline") -> str | None:
        """Why this policy cannot run a model with sliding-window layers, or None: the default attention
        (`attend_pool`) masks each extent's keys older than a sliding layer's window."""
        return None

    def fetch(self, pipe: "LayerPipeline", group: GroupState, plan: GroupPlan, layer: int):
        """(early, late) lists of host arrays to move for this layer (empty for a device pool)."""
        modes = plan.layer_modes(pipe, group.layout, layer)
        early = [group.pool_x[layer][e] for e, m in enumerate(modes) if m == "x"]
        late = []
        for e, m in enumerate(modes):
            if m == "kv":
                late += [group.pool_k[layer][e], group.pool_v[layer][e]]
        return early, late

    attend = staticmethod(attend_pool)  # the pure function the layer program folds the sources with

    def keys_on_device(self, pipe: "LayerPipeline") -> bool:
        """Whether a host pool keeps its K extents in device memory, V alone on the host (tokenselect
        kv=split: keys scored on the GPU, the selected values read in place by the layer program)."""
        return False

    def layer_parts(self, pipe: "LayerPipeline", layer: int) -> tuple | None:
        """Which of its extents' parts layer `layer` stores, of "k", "v", "x", where the layout holds that
        kind (clo / tokenselect kv=split with store=act: X in place of V, or of K and V, per layer); None:
        every part the layout says. Fixed at prefill (`pool_layouts` runs first)."""
        return None

    def device_layer(self, pipe: "LayerPipeline", layer: int) -> bool:
        """Whether layer `layer` of a host pool keeps all its K/V blocks in device memory, in the model's dtype
        (clo: a layer whose every head is persistent attends its whole context each step, as `full` does: its
        blocks never go to the host, the flush writes them in place). Fixed at prefill (`pool_layouts` runs
        first). Default: no layer."""
        return False

    def init_slots(self, pipe: "LayerPipeline", model, layout: PoolLayout, batch: int) -> tuple:
        """The policy's own state, one pytree per layer (per-request / per-head: selections, cached
        queries, GPU cache buffers), carried in the group's state from step to step; `attend` gets its
        layer's and returns the new one. () for none. Made before prefill's layers run."""
        return ()

    def keys_written(self, pipe: "LayerPipeline", slots: tuple, extent: int, k_blocks: tuple, at) -> tuple:
        """Layers' slots after K blocks entered the pool: per layer (slots[j], k_blocks[j]), K blocks
        [n, n_kv, blk, d] (device memory, the model's dtype) written to extent `extent` at slots at [n] (host
        ints, the same for every layer; entries outside the extent are dropped, as `write_blocks` does). Called at
        prefill (one layer, every extent, at = 0..E-1) and at each flush (every layer called one by one, at
        once: a policy should update them in a few programs, not a few per layer), only where the policy keeps
        slots: GPU-side retrieval metadata of keys that may live on the host (clo's Quest pages, HATA codes).
        Default: unchanged."""
        return slots

    def keys_written_stacked(self, pipe: "LayerPipeline", stack: "LayerStack", extent: int, k_blocks, at):
        """`keys_written` for a `LayerStack`'s looped layers at once: their fixed slots ([n, ...]) after the new
        K blocks k_blocks [n, b, n_kv, blk, d] went to slots `at` of extent `extent` (entries >= its size
        elsewhere). Default: unchanged (a policy whose `keys_written` keeps metadata must say how it is stacked)."""
        if type(self).keys_written is not LayerHooks.keys_written:
            raise NotImplementedError(f"{type(self).__name__} keeps key metadata but has no keys_written_stacked")
        return stack.fixed

    def loop_refusal(self, pipe: "LayerPipeline") -> str | None:
        """What `PipelineOptions.loop_layers` needs that this policy's options do not give (completing "loop_layers
        needs ..."), or None."""
        return None

    def reads_rows(self, pipe: "LayerPipeline") -> bool:
        """Whether the layer program reads the pool's rows by token id (`SelectSources.row_offset`: a looped step
        then keeps every layer's blocks in one extent a kind) rather than whole blocks through the tables."""
        return False

    def speculates(self, pipe: "LayerPipeline") -> bool:
        """Whether `speculate` dispatches work between layer programs (then layers do not share a program)."""
        return False

    def speculate(self, pipe: "LayerPipeline", model, group: GroupState, layer: int, h, positions, slot):
        """Layer `layer`'s slots after a speculative step dispatched before layer `layer` - 1's program, with h
        the input hidden state of layer `layer` - 1 and positions the new token's (clo: a guessed selection
        from an approximate query, its rows fetched while layer `layer` - 1 computes). Default: unchanged."""
        return slot

    def step_record(self, pipe: "LayerPipeline", groups) -> dict:
        """What the policy adds to a step's record, from the groups' state after the step (device values,
        never read on the host here: a step does not wait for the device). Default: nothing."""
        return {}

    def fetches_extents(self, pipe: "LayerPipeline") -> bool:
        """Whether decode moves whole host extents (transfer buffers in the memory plan); False where the
        layer program reads only selected rows of the host pool in place (clo, tokenselect kv=split)."""
        return True

    def slot_memory(self, pipe: "LayerPipeline", model, layouts, batch: int) -> dict:
        """GPU bytes of the slots (`init_slots`) by part name, for the memory plan. Default: none."""
        return {}

    def sources(self, pipe: "LayerPipeline", group: GroupState, plan: GroupPlan, layer: int, fetched):
        """The layer program's sources: the pool's own arrays for a device pool; for a host pool the
        fetched arrays in place of the extents in use and zero stand-ins for the rest (their tables
        are empty). Built from per-layout templates: this runs once per layer and step."""
        rec = pipe.scalar(plan.recompute_extents)
        tok = self.token_recompute(pipe, group, plan, layer)
        if not pipe.host_pool:
            return PoolSources(k=group.pool_k[layer], v=group.pool_v[layer], x=group.pool_x[layer], recompute=rec,
                               prompt_extents=group.layout.prompt_extents, token_recompute=tok)
        early, late = fetched
        ks, vs, xs = (list(t) for t in pipe.stand_ins(group, layer))
        ie, il = iter(early), iter(late)
        for e, m in enumerate(plan.layer_modes(pipe, group.layout, layer)):
            if m == "dev":
                ks[e], vs[e], xs[e] = group.pool_k[layer][e], group.pool_v[layer][e], group.pool_x[layer][e]
            elif m == "x":
                xs[e] = next(ie)
            elif m == "kv":
                ks[e], vs[e] = next(il), next(il)
        return PoolSources(k=tuple(ks), v=tuple(vs), x=tuple(xs), recompute=rec,
                           prompt_extents=group.layout.prompt_extents, token_recompute=tok)

    def token_recompute(self, pipe: "LayerPipeline", group: GroupState, plan: GroupPlan, layer: int) -> tuple:
        """On a mesh with activations split by token: per extent whether this step recomputes its K/V from X
        (fetched X; a device extent's X alone where a request has blocks, or with its K/V below the plan's
        split), the static form of `attend_pool`'s conditionals. () elsewhere. The layer program compiles once
        per distinct tuple (a new split, an activation-only extent coming into use)."""
        if not pipe.x_by_token:
            return ()
        lay, xs, ks = group.layout, group.pool_x[layer], group.pool_k[layer]
        modes = plan.extent_modes(pipe, lay) if pipe.host_pool else ("dev",) * lay.num_extents
        # which extents hold blocks: only a device extent needs it (a fetched one's mode says)
        in_use = pipe.extents_in_use(group) if "dev" in modes else None
        return tuple(m == "x" if m != "dev" else
                     xs[e] is not None and bool(in_use[e]) and (ks[e] is None or e < plan.recompute_extents)
                     for e, m in enumerate(modes))

    def group_rows(self, pipe: "LayerPipeline", model, lengths, capacity: int, t_pad: int | None = None) -> list:
        """The GPU batches: contiguous row ranges (start, stop) of the batch (default: gpu_batches
        ranges of equal size). t_pad: the prompts' padded length (what prefill's workspace holds)."""
        b = len(lengths)
        g = min(pipe.opts.gpu_batches, b)
        bounds = np.linspace(0, b, g + 1).astype(int)
        return [(int(bounds[i]), int(bounds[i + 1])) for i in range(g)]

    def pool_layouts(self, pipe: "LayerPipeline", model, dtype, rows, lengths, capacity: int) -> list:
        """Each GPU batch's pool layout (default: `plan_pool`'s extents, then `split_store`)."""
        from kvoffload.plan.memory import plan_pool

        # the whole model's config, not one device's: each device moves its heads' share of every extent; with
        # a given extent_mb the extents hold the same blocks as on one device (same split units, same programs
        # over the same blocks), by default they are N times one device's (`PipelineOptions.extent_mb`)
        plan = plan_pool(model.config, dtype, [lengths[a:z] for a, z in rows], capacity,
                         block_tokens=pipe.opts.block_tokens, extent_mb=pipe.extent_mb,
                         host_dtype="int4" if pipe.int4 else "native")
        return [self.split_store(pipe, model, lay, lengths[a:z]) for lay, (a, z) in zip(plan.layouts, rows)]

    def split_store(self, pipe: "LayerPipeline", model, layout: PoolLayout, lengths) -> PoolLayout:
        """Which extents hold which kinds (default: every kind everywhere)."""
        n = layout.num_extents
        return dataclasses.replace(layout, kv_extents=(0, n) if "kv" in self.kinds else (0, 0),
                                   act_extents=(0, n) if "act" in self.kinds else (0, 0))


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


EXTENT_MB_PER_DEVICE = 64.0  # the default extent: MiB of K per device of the mesh (PipelineOptions.extent_mb)


class LoopLayersError(KVOffloadError, ValueError):
    """`PipelineOptions.loop_layers` asked of a run it cannot loop (names what to change)."""


@dataclasses.dataclass
class PipelineOptions:
    schedule: str = "row"
    offload_weights: bool = False
    # with offload_weights: the first N layers' weights stay in GPU memory (never moved; the rest stream)
    resident_layers: int = 0
    gpu_batches: int = 1
    block_tokens: int = 64
    # about this many MiB of K (or V) per extent, in the model's dtype (plan_pool). None: EXTENT_MB_PER_DEVICE
    # on each device of the mesh (64 on one, 256 on four): each device then moves copies of one GPU's size.
    # With 64 on four H100s kvpr's X moved as 16 copies of 4 MiB a layer and its host spent ~15 ms a step
    # issuing them; 256 made it 4 copies: 65.5 / 85.5 ms a step against 96.3 (OPT-6.7B b64 P512, 4x H100:
    # BENCHMARKS, tensor parallel). Give a number to plan a mesh's pool like one device's (same blocks, same bits).
    extent_mb: float | None = None
    sync_depth: int = 3
    attention_impl: str = "auto"
    # prefill runs a GPU batch in row chunks whose attention / MLP workspace stays under this
    prefill_workspace_gb: float = 2.0
    # prefill each layer in chunks of this many tokens (None: the whole prompt at once): the workspace
    # is a chunk's (long contexts: a 1M-token Llama-3-8B prompt's MLP intermediate alone is 28 GB), and
    # the prefill waits for each layer's extents to reach the host before the next layer, so one layer's
    # K/V is on the GPU at a time
    prefill_chunk_tokens: int | None = None
    # the chunked prefill's attention (ops.PREFILL_IMPLS): "auto" is cuDNN's flash attention on a GPU for
    # 16-bit models (580 TFLOP/s on an H100 at a 1M-token prompt), else "reference", XLA's online softmax
    # over 1024-key blocks (its fp32 scores go through memory: 93 s per Llama-3-8B layer at 1M tokens on
    # an H200, ~13x cuDNN); "kernel" is the Pallas flash kernel (273 TFLOP/s)
    prefill_attention_impl: str = "auto"
    # XLA's matmuls (cuBLAS) recompute 64-token blocks at 583 TFLOP/s on an H200, the fused Pallas
    # kernel at 412 (profile of 2026-11-26): "reference" is the faster path here
    recompute_impl: str = "reference"
    profile: str | None = None
    trace: str | None = None
    check_memory: bool = True
    host_memory_limit_gb: float | None = None
    gpu_memory_limit_gb: float | None = None
    # how a host pool stores K/V and activation blocks: "native" (the model's dtype) or "int4" (group
    # quantization: packed codes plus a float32 step and min per int4_group_size elements of a head's d
    # (K/V) or of H (X), ~1/4 of bf16's bytes): quantized when a block is written to the host, moved as
    # it is, dequantized on the GPU. GPU-resident blocks and the GPU tails stay in the model's dtype.
    host_dtype: str = "native"
    int4_group_size: int = 64
    # how int4 K is scaled: "token" (groups of int4_group_size along each token's head_dim, like V and X)
    # or "channel" (KIVI: a step and min per channel over each block's block_tokens tokens; keys have outlier
    # channels that per-token groups stretch over the other channels' range; same bytes as token's g64 at blk 64)
    # or "int8" (int8 codes in per-token groups: where single rows are gathered, K at ~2x int4's bytes; per-token
    # int4 K loses accuracy there, per-channel scales come per block) or "native" (K in the model's dtype)
    int4_k_quant: str = "token"
    # tensor parallelism over heads (device/sharding.py): N devices (the first N of jax.devices()), or a
    # jax.sharding.Mesh with a 'model' axis; weights, K/V and the host pool split by head over it
    tensor_parallel: int = 1
    mesh: Any = None
    # decode up to this many consecutive layers in one program where the step issues no transfers (a device
    # pool, or a host pool read in place: clo, tokenselect kv=split; no offloaded weights, no speculative
    # prefetch) and the layers' programs have the same shapes: one host call per group of layers instead of
    # one per layer. Elsewhere 1. Default 1: on an H100 at 128K, 2-8 per program changed no policy's step beyond
    # the run-to-run swing and 32 doubled it (the host's time is per kernel and leaf, not per call, and a
    # layer per call overlaps its host work with the previous layer's GPU work); bit-equal on the CPU, same
    # tokens on a GPU (XLA fuses a multi-layer program differently).
    layers_per_program: int = 1
    # run each GPU batch's longest run of trailing layers with one program's shapes (clo: layers 1..L-1; full:
    # all) as ONE `loop_layers` program, a fori_loop over their state stacked at the end of the prefill: one host
    # call a step for those layers instead of one each (clo at 128K b1 on an H200: 3.4-3.9 ms of host a step and
    # 1.19-1.21x `full`, where the calls took 14-23 ms of host and 1.17-1.65x). Needs a step that moves nothing between layers (as layers_per_program),
    # one device, K/V extents all in one memory (no stored activations); keeps a stacked copy of the
    # looped layers' weights, read by layer index (`models.common.layer_weights`, the stacked-linear kernel; above
    # `ops.FEW_ROWS_MAX` rows other bits than the per-layer calls' XLA matmuls, so compare a looped policy with a
    # looped `full`). GPU memory: one more copy of the looped layers' weights.
    loop_layers: bool = False

    def __post_init__(self):
        from kvoffload.plan.cost import HOST_DTYPES, INT4_K_QUANTS

        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.host_dtype not in HOST_DTYPES:
            raise ValueError(f"host_dtype must be one of {HOST_DTYPES}, got {self.host_dtype!r}")
        self.int4_group_size = int(self.int4_group_size)
        if self.int4_k_quant not in INT4_K_QUANTS:
            raise ValueError(f"int4_k_quant must be one of {INT4_K_QUANTS}, got {self.int4_k_quant!r}")
        if self.int4_group_size < 1:
            raise ValueError(f"int4_group_size must be >= 1, got {self.int4_group_size}")
        self.gpu_batches = int(self.gpu_batches)
        self.resident_layers = int(self.resident_layers)
        if self.resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {self.resident_layers}")
        self.block_tokens = int(self.block_tokens)
        self.sync_depth = int(self.sync_depth)
        self.extent_mb = None if self.extent_mb is None else float(self.extent_mb)
        if isinstance(self.layers_per_program, bool) or int(self.layers_per_program) != self.layers_per_program \
                or self.layers_per_program < 1:
            raise ValueError(f"layers_per_program must be an integer >= 1, got {self.layers_per_program!r}")
        self.layers_per_program = int(self.layers_per_program)
        if not isinstance(self.loop_layers, bool):
            raise ValueError(f"loop_layers must be true or false, got {self.loop_layers!r}")
        if self.gpu_batches < 1:
            raise ValueError(f"gpu_batches must be >= 1, got {self.gpu_batches}")
        if self.block_tokens < 1 or self.block_tokens & (self.block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {self.block_tokens}")
        if self.extent_mb is not None and self.extent_mb <= 0:
            raise ValueError(f"extent_mb must be > 0, got {self.extent_mb}")
        if self.prefill_attention_impl not in ops.PREFILL_IMPLS:
            raise ValueError(f"prefill_attention_impl must be one of {ops.PREFILL_IMPLS}, "
                             f"got {self.prefill_attention_impl!r}")
        if self.prefill_chunk_tokens is not None:
            self.prefill_chunk_tokens = int(self.prefill_chunk_tokens)
            if self.prefill_chunk_tokens < 1:
                raise ValueError(f"prefill_chunk_tokens must be >= 1 or None, got {self.prefill_chunk_tokens}")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise S.TensorParallelError(f"tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}")


# ---------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------


class LayerPipeline:
    """Prefill and decode for one model and one policy's hooks. Holds only what is fixed for a run
    (options, memory placement, the cost model); everything that changes per step is in the state."""

    def __init__(self, hooks: LayerHooks, opts: PipelineOptions, host_pool: bool = True):
        self.hooks = hooks
        self.opts = opts
        self.host_pool = host_pool
        self.sliding_layers: tuple = ()  # per layer of the model decoding: a sliding window (set each step)
        self.window = 0  # its sliding layers' window
        self.int4 = host_pool and opts.host_dtype == "int4"  # host K/V/X extents are QuantizedInt
        # tensor parallelism: None on one device (the single-device path); else the mesh every array is
        # placed on (self.rep: replicated there) and a device of it that this process drives
        self.mesh = S.resolve_mesh(opts.tensor_parallel, opts.mesh)
        self.tp = S.size(self.mesh)
        # MiB of K per extent (`PipelineOptions.extent_mb`; by default the hooks' per device, else
        # EXTENT_MB_PER_DEVICE)
        per_device = hooks.extent_mb_per_device or EXTENT_MB_PER_DEVICE
        self.extent_mb = per_device * self.tp if opts.extent_mb is None else opts.extent_mb
        self.dev = M.default_device() if self.mesh is None else S.local_device(self.mesh)
        self.rep = self.dev if self.mesh is None else S.replicated(self.mesh)
        self.tables_at = None if self.mesh is None else self.rep  # block tables: uncommitted on one device
        # activation extents split by token over the mesh (sharding.X_TOKEN_SPEC): each block's tokens in N
        # equal slices
        self.x_by_token = self.tp > 1 and hooks.x_split == "token"
        if self.x_by_token and opts.block_tokens % self.tp:
            raise S.TensorParallelError(
                f"{hooks.name} on {self.tp} devices splits each block's {opts.block_tokens} tokens of activations "
                f"over the devices; block_tokens must be a multiple of tensor_parallel={self.tp}")
        self.host_kind, self.host_note = M.host_memory_kind(self.dev)
        self._sharded_params: dict = {}
        self._cost = None
        self._in_use: dict = {}  # this step's extents_in_use per GPU batch's allocator (`extents_in_use`)
        self._host_layers: dict = {}
        self.memory_plan = None
        self._stand_ins: dict = {}
        self._templates: dict = {}
        self._scalars: dict = {}
        self._loop_weights: dict = {}

    # -- small device values reused every step ------------------------------------------------
    def stand_ins(self, group: GroupState, layer: int):
        """Per extent of the group's layout: zero device arrays shaped like its K, V and X extents
        (None where the layout stores none), allocated once per shape and shared by every extent of
        that shape, every layer and step: what a layer program gets for extents with no blocks in use."""
        key = group.layout  # every layer's extents have the same shapes
        if key not in self._templates:
            def zeros(a):
                k = (a.shape, str(a.dtype))
                if k not in self._stand_ins:
                    self._stand_ins[k] = jnp.zeros(a.shape, a.dtype, device=self.dev if self.mesh is None else
                                                   M.device_sharding(a.sharding))  # K/V by head, X replicated
                return self._stand_ins[k]

            def like(a):  # an int4 extent's stand-in is all-zero codes and scales: it dequantizes to zeros
                return None if a is None else jax.tree.map(zeros, a)

            self._templates[key] = tuple(tuple(like(a) for a in p[layer]) for p in (group.pool_k, group.pool_v, group.pool_x))
        return self._templates[key]

    def extents_in_use(self, group: GroupState):
        """Per extent of group's layout whether a request has blocks there: once per GPU batch and step (the
        allocator changes only at a step's end, by flush), however many layers and callers ask."""
        hit = self._in_use.get(id(group.alloc))
        if hit is None or hit[0] is not group.alloc:  # (the allocator held: an id is never another's here)
            hit = self._in_use[id(group.alloc)] = (group.alloc, group.alloc.extents_in_use(group.layout))
        return hit[1]

    def scalar(self, n: int):
        if n not in self._scalars:
            self._scalars[n] = S.put(np.int32(n), self.rep)
        return self._scalars[n]

    # -- cost model --------------------------------------------------------------------------
    @property
    def cost(self):
        from kvoffload.plan.cost import CostModel

        if self._cost is None:
            self._cost = CostModel.load(self.opts.profile) if self.opts.profile else CostModel.default(self.dev.platform)
        return self._cost

    # -- weights -----------------------------------------------------------------------------
    def resident(self, model) -> int:
        """Layers whose weights stay on the GPU although the others stream (resident_layers)."""
        return min(self.opts.resident_layers, model.config.num_layers) if self.opts.offload_weights else 0

    def params(self, model):
        """The model's parameters as this run places them: as they are on one device; on a mesh sharded
        Megatron-style (device/sharding.py; a no-op for parameters already placed so)."""
        if self.mesh is None:
            return model.params
        key = id(model.params)
        if key not in self._sharded_params:
            S.check_divisible(model.config, self.tp)
            on_host = M.on_host(model.params.layers)
            self._sharded_params = {key: S.shard_params(model.params, self.mesh,
                                                        layers_kind=self.host_kind if on_host else None,
                                                        replicate_kv=self.replicate_kv(model))}
        return self._sharded_params[key]

    def replicate_kv(self, model) -> bool:
        """Whether each device keeps W_K / W_V whole: token-split activations recomputed from resident weights
        (streamed weights move their head shard, gathered whole once per layer over NVLink: `gathers_kv`)."""
        return (self.x_by_token and not self.opts.offload_weights and not M.on_host(model.params.layers)
                and self.hooks.recomputes(self, model))

    def gathers_kv(self, groups, plans, layer: int) -> bool:
        """Whether this step gathers the layer's streamed W_K / W_V head shards whole before its programs: on a
        mesh with activations split by token, where some GPU batch recomputes an extent of the layer (each
        device recomputes every head of its tokens). Once per layer: a gather inside the layer program
        would run again in every GPU batch's program."""
        return (self.x_by_token and self.opts.offload_weights
                and any(any(self.hooks.token_recompute(self, gr, pl, layer)) for gr, pl in zip(groups, plans)))

    def local(self, values):
        """Small host-made values as the programs take them: as they are on one device (uncommitted), on a
        mesh replicated over it (under jax.distributed a process's own arrays cannot enter a global program)."""
        return values if self.mesh is None else S.put(values, self.rep)

    def to_device(self, tree):
        """An eager move to device memory: on a mesh each array keeps its sharding (each device moves
        its shard over its own link)."""
        return M.to_device(tree, self.dev) if self.mesh is None else M.to_kind(tree, "device")

    def to_host(self, tree):
        return M.to_host(tree, self.dev) if self.mesh is None else M.to_host_like(tree, self.host_kind or "device")

    def layers(self, model):
        """Per layer: its weights where the run keeps them (host memory for streamed layers)."""
        layers = self.params(model).layers
        if not self.opts.offload_weights:
            return layers
        r = self.resident(model)
        key = (id(model.params), r)
        if key not in self._host_layers:
            streamed = layers[r:] if M.on_host(layers[r:]) else self.to_host(layers[r:])
            kept = self.to_device(layers[:r]) if r else ()
            self._host_layers = {key: tuple(kept) + tuple(streamed)}
        return self._host_layers[key]

    # -- prefill -----------------------------------------------------------------------------
    def plan(self, model, lengths, t_pad: int, capacity: int):
        """The GPU batches and their pool layouts for prompts of these lengths, the memory plan
        (self.memory_plan), checked against host and GPU memory: raises MemoryPlanError before anything
        is allocated. Returns (rows, layouts)."""
        from kvoffload.plan.memory import check_pool

        cfg, o = model.config, self.opts
        dtype = model.params.layers[0].wk.dtype
        lengths = np.asarray(lengths, np.int64)
        b = len(lengths)
        bad = [n for n in (cfg.head_dim, cfg.hidden_size) if n % o.int4_group_size or n % 2]
        if self.int4 and bad:
            raise ValueError(f"host_dtype='int4' quantizes each head's {cfg.head_dim} K/V values and each token's "
                             f"{cfg.hidden_size} activations in groups of int4_group_size={o.int4_group_size}, "
                             f"which must divide both (and they must be even); choose a divisor of "
                             f"{math.gcd(cfg.head_dim, cfg.hidden_size)}")
        if self.mesh is not None:
            S.check_divisible(cfg, self.tp)
        rows = self.hooks.group_rows(self, model, lengths, capacity, t_pad=t_pad)
        layouts = self.hooks.pool_layouts(self, model, dtype, rows, lengths, capacity)
        self.memory_plan = self.memory_of(model, layouts, lengths, t_pad, capacity)
        if o.check_memory:
            check_pool(S.machine_plan(self.memory_plan, self.mesh, self.dev.platform), o.host_memory_limit_gb,
                       o.gpu_memory_limit_gb, self.host_pool, self.dev,
                       what=f"{self.hooks.name} for batch {b} x {capacity} tokens"
                       + (f" on {self.tp} devices" if self.mesh is not None else ""),
                       resident=M.resident_device_bytes(model.params, self.dev))  # the plan counts the weights
        return rows, layouts

    def device_config(self, model):
        """The model config one device sees (its share of the heads and MLP): what plans and costs count."""
        return S.device_config(model.config, self.tp)

    def memory_of(self, model, layouts, lengths, t_pad: int, capacity: int):
        """The memory plan (`plan.memory.pool_memory`) of these layouts for this run's options (per
        device under tensor parallelism: its heads' K/V and weight shards, activations whole)."""
        from kvoffload.plan.memory import pool_memory

        cfg, o = self.device_config(model), self.opts
        dtype = model.params.layers[0].wk.dtype
        wb = weight_bytes_per_device(model.config, dtype, model.params, self.tp, self.replicate_kv(model))
        gathered = self.x_by_token and o.offload_weights and self.hooks.recomputes(self, model)
        slot_parts = self.hooks.slot_memory(self, model, layouts, len(lengths))
        mem = pool_memory(cfg, dtype, layouts, len(lengths), t_pad, host_pool=self.host_pool,
                          offload_weights=o.offload_weights, weights=wb,
                          kv_gathered=wb.kv_per_layer * (self.tp - 1) if gathered else 0,
                          inflight=max(o.sync_depth + 1, 2), resident_layers=self.resident(model),
                          tail_slots=tail_slots(lengths, capacity, o.block_tokens),
                          tail_x=flush_possible(lengths, capacity, o.block_tokens),
                          prefill_workspace_gb=o.prefill_workspace_gb, prefill_chunk_tokens=o.prefill_chunk_tokens,
                          host_dtype=o.host_dtype, int4_group_size=o.int4_group_size, int4_k_quant=o.int4_k_quant,
                          k_on_device=self.hooks.keys_on_device(self), activation_split=self.tp,
                          x_by_token=self.x_by_token,
                          fetch=self.hooks.fetches_extents(self),
                          layer_parts=[self.hooks.layer_parts(self, i) for i in range(cfg.num_layers)],
                          device_layers=[self.hooks.device_layer(self, i) for i in range(cfg.num_layers)],
                          slots=slot_parts)
        if o.offload_weights and M.on_host(model.params.layers):
            mem.host["weights"] = 0  # already in host memory (counted by MemAvailable)
        if o.loop_layers:
            # `loop_weights`: a stacked copy of (at most) every layer's weights, held while decoding; `stack_group`:
            # the looped layers' pool, tails and slots copied once at the prefill's end (old and new alive together)
            mem.gpu["looped layers' weights (stacked copy)"] = wb.per_layer * cfg.num_layers
            mem.gpu_phase["looped layers' weights (stacked copy)"] = "decode"
            copied = [k for k in mem.gpu if k.startswith("K/V blocks") or k == "GPU tails" or k in slot_parts]
            mem.gpu["state stacked at the prefill's end (transient copy)"] = sum(mem.gpu[k] for k in copied)
            mem.gpu_phase["state stacked at the prefill's end (transient copy)"] = "prefill"
            if mem.host.get("K/V blocks"):
                mem.host["K/V blocks stacked at the prefill's end (transient copy)"] = mem.host["K/V blocks"]
        return mem

    def prefill(self, model, tokens, lengths, capacity):
        with S.context(self.mesh):  # the mesh in context: per_shard kernels (GPU) trace per device
            return self._prefill(model, tokens, lengths, capacity)

    def _prefill(self, model, tokens, lengths, capacity):
        cfg = model.config
        o = self.opts
        b, t_pad = tokens.shape
        dtype = model.params.layers[0].wk.dtype
        lengths_np = np.asarray(lengths, np.int64)
        if cfg.has_sliding_layers:
            self.check_sliding()
        self.sliding_layers, self.window = sliding_layers(cfg), cfg.sliding_window
        rows, layouts = self.plan(model, lengths_np, t_pad, capacity)
        if o.loop_layers:  # before any work: what the loop cannot take
            self.check_loop(layouts)
        fam_params = without_layers(self.params(model))
        layers = self.layers(model)
        lengths = S.put(lengths_np.astype(np.int32), self.rep)  # committed, like a step's outputs
        if self.mesh is not None:  # every process holds the same prompts (jax.distributed: a global array)
            tokens = S.put(tokens, self.rep)
        blk = o.block_tokens
        t_blk = -(-t_pad // blk) * blk
        if t_blk != t_pad:  # whole blocks for the gathers below (pad tokens are never attended)
            tokens = jnp.pad(tokens, ((0, 0), (0, t_blk - t_pad)))
        positions = jnp.broadcast_to(jnp.arange(t_blk, dtype=jnp.int32), (b, t_blk))
        groups = []
        for (a, z), layout in zip(rows, layouts):
            alloc = BlockAllocator(layout.num_blocks, z - a, blk)
            allocate_prompts_aligned(alloc, layout, lengths_np[a:z])
            groups.append(dict(rows=(a, z), layout=layout, alloc=alloc, h=_embed(cfg, fam_params, tokens[a:z], positions[a:z]),
                               pk=[], pv=[], px=[], tk=[], tv=[], tx=[],
                               slots=list(distinct_arrays(self.hooks.init_slots(self, model, layout, z - a))),
                               srcs=[self.local(extent_sources(alloc, layout, e, t_blk // blk))
                                     for e in range(layout.num_extents)],
                               start=self.local(jnp.asarray((lengths_np[a:z] // blk) * blk, jnp.int32))))
        keep_x = any(len(lay.extents_of("act")) for lay in layouts)  # activations stored somewhere
        tail_x = flush_possible(lengths_np, capacity, blk)  # tails keep X only to flush it into blocks
        slots = tail_slots(lengths_np, capacity, blk)
        chunk = prefill_chunk_rows(cfg, dtype, t_blk, o.prefill_workspace_gb, o.prefill_chunk_tokens)
        # token-chunked (long contexts): wait for each layer's extents to reach the host, so one layer's
        # K/V (and its extents) is on the GPU at a time, as the memory plan counts
        depth = 0 if o.prefill_chunk_tokens else o.sync_depth
        pending, t_prefill = [], time.perf_counter()
        for i in range(cfg.num_layers):
            lp = self.to_device(layers[i]) if o.offload_weights else layers[i]
            for gr in groups:
                a, z = gr["rows"]
                bufs = None
                for c in range(a, z, chunk):  # row chunks bound the attention / MLP workspace
                    e = min(z, c + chunk)
                    out = _layer_prefill(cfg, lp, gr["h"][c - a:e - a] if (a, z) != (c, e) else gr["h"],
                                         positions[c:e], lengths[c:e], keep_x, o.prefill_chunk_tokens,
                                         o.prefill_attention_impl)
                    if (a, z) == (c, e):
                        bufs = out
                        break
                    if bufs is None:  # the layer's outputs for the group, filled chunk by chunk
                        bufs = jax.tree.map(lambda t: jnp.zeros((z - a,) + t.shape[1:], t.dtype, device=t.sharding), out)
                    bufs = _put_row_chunk(bufs, out, c - a)
                    del out
                gr["h"], k, v, x = bufs
                del bufs
                pk, pv, px, k_dev = self._extents_from_prefill(gr["layout"], gr["srcs"], gr["alloc"], k, v, x, dtype,
                                                               self.hooks.layer_parts(self, i),
                                                               self.hooks.device_layer(self, i))
                if gr["slots"]:
                    for e, ke in enumerate(k_dev):
                        if ke is not None:
                            gr["slots"][i], = self.hooks.keys_written(self, (gr["slots"][i],), e, (ke,),
                                                                    np.arange(ke.shape[0]))
                del k_dev
                gr["pk"].append(pk), gr["pv"].append(pv), gr["px"].append(px)
                gr["tk"].append(_tail_from_prompt(k, gr["start"], blk, slots, 1))
                gr["tv"].append(_tail_from_prompt(v, gr["start"], blk, slots, 1))
                parts = self.hooks.layer_parts(self, i)
                keep_tx = keep_x and tail_x and (parts is None or "x" in parts)  # X only where the layer stores it
                tx = _tail_from_prompt(x, gr["start"], blk, slots, 0) if keep_tx else None
                if tx is not None and self.mesh is not None:  # split along H (a flush moves a block to its extent's split)
                    tx = M.transfer(tx, S.x_shardings(tx, self.mesh, "device"))
                gr["tx"].append(tx)
                pending.append((gr["tk"][-1], pk, pv, px) if o.prefill_chunk_tokens else gr["tk"][-1])
                if (o.sync_depth or o.prefill_chunk_tokens) and len(pending) > depth:  # bound the device copies alive
                    jax.block_until_ready(pending.pop(0))
                if o.prefill_chunk_tokens:  # each layer waited for above: minutes per layer at 1M tokens
                    _log.info("prefill: layer %d/%d of rows %d-%d on the host after %.1f s", i + 1, cfg.num_layers,
                              a, z, time.perf_counter() - t_prefill)
        states, logits = [], []
        for gr in groups:
            a, z = gr["rows"]
            lens = lengths_np[a:z]
            logits.append(_logits(cfg, fam_params, _last_hidden(gr["h"], lengths[a:z])))
            states.append(GroupState(
                pool_k=tuple(gr["pk"]), pool_v=tuple(gr["pv"]), pool_x=tuple(gr["px"]),
                tables=gr["alloc"].device_tables(gr["layout"], self.tables_at), tail_k=tuple(gr["tk"]), tail_v=tuple(gr["tv"]),
                tail_x=tuple(gr["tx"]), tail_len=S.put(np.asarray(lens % blk, np.int32), self.rep),
                slots=tuple(gr["slots"]),
                rows=(a, z), layout=gr["layout"], alloc=gr["alloc"], tail_base=tuple(int(n) for n in lens % blk),
                n_gen=0, since_flush=0, next_positions=lengths[a:z]))
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, 0)
        if o.loop_layers:
            states = [self.stack_group(model, gr) for gr in states]
        return logits, DecodeState(groups=tuple(states), batch=b)

    def layer_kinds(self, state: DecodeState, window: int) -> dict:
        """Per kind of layer (sliding, global): how many, and the bytes per token of pool capacity one such layer
        keeps in host and in GPU memory (K, V and X extents as stored) and in its GPU tail per tail slot, from the
        first GPU batch's arrays; and what a step fetches of a host pool for it."""
        gr = state.groups[0]
        lay = gr.layout
        tokens = max(1, lay.num_blocks * lay.block_tokens)
        out = {}
        for kind, flag in (("sliding", True), ("global", False)):
            idx = [i for i, s in enumerate(self.sliding_layers) if s == flag and gr.pool_k[i] is not None]
            if not idx:
                continue
            i = idx[0]
            where = {"host": 0, "gpu": 0}
            for a in jax.tree.leaves((gr.pool_k[i], gr.pool_v[i], gr.pool_x[i])):
                where["host" if getattr(a.sharding, "memory_kind", None) == "pinned_host" else "gpu"] += _nbytes(a)
            tail = _tree_bytes((gr.tail_k[i], gr.tail_v[i], gr.tail_x[i]))
            slots = gr.tail_k[i].shape[2] * gr.size if gr.tail_k[i] is not None else 1
            out[kind] = {"layers": sum(1 for s in self.sliding_layers if s == flag),
                         "pool_bytes_per_token": {k: v / tokens for k, v in where.items()},
                         "tail_bytes_per_token": tail / slots}
            if flag:
                out[kind].update(window=window, fetched=("extents holding a block of some request's window; all its "
                                                         "tokens stay in the pool (masked)") if self.host_pool else
                                 "nothing (device pool; the window's blocks attended)")
            else:
                out[kind]["fetched"] = "every extent in use" if self.host_pool else "nothing (device pool)"
        return out

    def window_plan(self, cfg, gr: GroupState, plan: GroupPlan) -> GroupPlan:
        """plan with the sliding layers' modes: an extent whose every block ends before its request's window
        (the new token's position - window + 1) is not fetched for them (a zero stand-in; the window mask
        drops those blocks from the tables, so the result is the same)."""
        alloc, lay, blk = gr.alloc, gr.layout, gr.layout.block_tokens
        pos = np.asarray([len(t) for t in alloc.tables]) * blk + np.asarray(gr.tail_base) + gr.since_flush
        start = pos - cfg.sliding_window + 1
        owner = alloc.owner
        live = (owner >= 0) & (alloc.first_pos + blk > start[np.maximum(owner, 0)])
        modes = list(plan.extent_modes(self, lay))
        for e, m in enumerate(modes):
            if m in ("kv", "x") and not live[lay.start(e):lay.start(e + 1)].any():
                modes[e] = "skip"
        return dataclasses.replace(plan, sliding_modes=tuple(modes))

    def check_sliding(self):
        """One clear UnsupportedModelError where this run cannot give a model with sliding-window layers the right
        answer (before any work)."""
        why = self.hooks.sliding_refusal(self)
        if why is None and self.mesh is not None:
            why = "the tensor-parallel attention paths have no sliding-window mask yet (tensor_parallel=1)"
        if why is None and self.opts.loop_layers:
            why = "loop_layers stacks layers of one kind; sliding and global layers differ (loop_layers=False)"
        if why:
            raise UnsupportedModelError(f"policy {self.hooks.name!r} cannot run a model with sliding-window layers: "
                                        f"{why}")

    # -- layers looped in one program (PipelineOptions.loop_layers) ----------------------------
    def check_loop(self, layouts):
        """One clear LoopLayersError where `loop_layers` cannot run this plan."""
        why = None
        if self.mesh is not None:
            why = "one device (the looped weights are read by layer index; tensor_parallel=1)"
        elif self.fetches() or self.opts.offload_weights or self.hooks.speculates(self):
            why = ("a step that moves nothing between layers: a device pool or one read in place (clo, tokenselect "
                   "kv=split), weights on the GPU (no offload_weights), no speculative prefetch")
        elif any(lay.extents_of("act") or len({lay.on_device(e) for e in range(lay.num_extents)}) > 1
                 for lay in layouts):
            why = "K/V extents only, all in one memory (no stored activations)"
        else:
            why = self.hooks.loop_refusal(self)
        if why:
            raise LoopLayersError(f"loop_layers needs {why}")

    def stack_group(self, model, gr: GroupState) -> GroupState:
        """gr with its longest run of trailing layers of one program's shapes (`program_key`) as one `LayerStack`:
        tails, slots and pool extents copied into stacked arrays (host extents through host memory), the
        per-layer entries then None. Once, at the end of the prefill."""
        L, n_ext = model.config.num_layers, gr.layout.num_extents
        if any(x is not None for x in gr.tail_x):
            raise LoopLayersError("loop_layers needs no stored activations (the tails hold X)")
        slot = (lambda i: gr.slots[i]) if gr.slots else (lambda i: None)  # noqa: E731
        keys = [program_key((gr.tail_k[i], gr.tail_v[i], slot(i), gr.pool_k[i], gr.pool_v[i])) for i in range(L)]
        first = L - 1
        while first and keys[first - 1] == keys[-1]:
            first -= 1
        if L - first < 2:
            raise LoopLayersError("loop_layers: the last two layers' programs differ (persistent heads?): "
                                  "nothing to loop over")
        idx = range(first, L)
        st, fixed = stack_layers(self.hooks.attend, [gr.tail_k[i] for i in idx], [gr.tail_v[i] for i in idx],
                                 [slot(i) for i in idx])
        by_rows = self.hooks.reads_rows(self)
        if by_rows:  # one extent: layer after layer, each layer's extents in block-id order
            pool_k = (stacked_extent([gr.pool_k[i][e] for i in idx for e in range(n_ext)]),)
            pool_v = (stacked_extent([gr.pool_v[i][e] for i in idx for e in range(n_ext)]),)
        else:  # extent by extent
            pool_k = tuple(stacked_extent([gr.pool_k[i][e] for i in idx]) for e in range(n_ext))
            pool_v = tuple(stacked_extent([gr.pool_v[i][e] for i in idx]) for e in range(n_ext))
        stk = LayerStack(st=st, fixed=fixed, pool_k=pool_k, pool_v=pool_v, first=first,
                         blocks=tuple(gr.layout.size(e) for e in range(n_ext)), by_rows=by_rows,
                         attend=self.hooks.attend)
        none, no_ext = (None,) * (L - first), ((None,) * n_ext,) * (L - first)
        return dataclasses.replace(
            gr, stack=stk, tail_k=gr.tail_k[:first] + none, tail_v=gr.tail_v[:first] + none,
            slots=gr.slots[:first] + none if gr.slots else (), pool_k=gr.pool_k[:first] + no_ext,
            pool_v=gr.pool_v[:first] + no_ext)

    def loop_weights(self, model, first: int):
        """The weights of layers first..L-1 stacked [n, ...] (a copy, made once per model and first layer)."""
        from kvoffload.models.common import stack_trees

        key = (id(model.params), first)
        if key not in self._loop_weights:
            self._loop_weights = {key: stack_trees(self.layers(model)[first:])}
        return self._loop_weights[key]

    def run_stack(self, model, gr: GroupState, plan: GroupPlan, h, positions, stk: LayerStack):
        """(h, stk) after gr's looped layers, one `loop_layers` call (`LayerStack` says how layer j's blocks are
        found)."""
        o, blk = self.opts, gr.layout.block_tokens
        pool_x = gr.pool_x[:stk.first] + ((None,) * len(stk.pool_k),)
        view = dataclasses.replace(gr, pool_k=gr.pool_k[:stk.first] + (stk.pool_k,),
                                   pool_v=gr.pool_v[:stk.first] + (stk.pool_v,), pool_x=pool_x)
        src = self.hooks.sources(self, view, plan, stk.first, ([], []))
        h, st = loop_layers(model.config, self.loop_weights(model, stk.first), stk.st, stk.fixed, h, positions,
                            gr.tail_len, src, gr.tables, self.hooks.attend, (o.recompute_impl, o.attention_impl),
                            row_stride=sum(stk.blocks) * blk if stk.by_rows else 0,
                            table_stride=() if stk.by_rows else stk.blocks)
        return h, dataclasses.replace(stk, st=st)

    def flush_stack(self, gr: GroupState, stk: LayerStack, slots: dict):
        """(stk, device->host bytes) with every looped layer's oldest blk tail tokens written as the new blocks
        (slots: per extent touched, each request's slot there, >= its size where its block is elsewhere): one
        pop, one quantization and one write program per stacked extent for all looped layers; the policy's key
        metadata updated (`LayerHooks.keys_written_stacked`)."""
        blk, layout = gr.layout.block_tokens, gr.layout
        (bk, bv), (tail_k, tail_v) = _pop_blocks((stk.st.tail_k, stk.st.tail_v), blk, (2, 2))  # [n, b, n_kv, blk, d]
        dev_layer = {self.hooks.device_layer(self, stk.first + j) for j in range(stk.layers)}
        if len(dev_layer) != 1:  # stack_group loops only layers of one program, whose pools share a memory
            raise LoopLayersError("loop_layers: looped layers differ in where their blocks live")
        on_dev = dev_layer.pop()
        pk, pv, nbytes, fixed = list(stk.pool_k), list(stk.pool_v), 0, stk.fixed
        popped, kinds = {True: bk, False: bv}, ((pk, True), (pv, False))
        native = {(e, key): self._stores_native(layout, e, on_dev, key) for e in slots for key in (True, False)}
        # blocks bound for host memory: int4 / int8 made once for all looped layers, K and V in one program
        want = sorted({key for e in slots for pool, key in kinds if pool[stk.extent_of(e)[0]] is not None
                       and not native[e, key] and self.host_spec(key) is not None})
        made = dict(zip(want, _quantize_many(tuple(popped[k] for k in want), tuple(self.host_spec(k) for k in want))))
        for e, at in slots.items():
            share = float(np.mean(at < layout.size(e)))  # of the blocks written, those in extent e
            x, base, stride = stk.extent_of(e)
            ids = np.where(at < layout.size(e), at + base, -1)
            for pool, key in kinds:
                if pool[x] is None:
                    continue
                w = popped[key] if native[e, key] else made.get(key, popped[key])
                pool[x] = write_stored_blocks_strided(pool[x], w, ids, stride)
                nbytes += 0 if native[e, key] else int(_tree_bytes(w) * share)
            fixed = self.hooks.keys_written_stacked(self, dataclasses.replace(stk, fixed=fixed), e, bk, at)
        st = dataclasses.replace(stk.st, tail_k=tail_k, tail_v=tail_v)
        return dataclasses.replace(stk, st=st, fixed=fixed, pool_k=tuple(pk), pool_v=tuple(pv)), nbytes

    def _stores_native(self, layout: PoolLayout, e: int, device_layer: bool, key: bool) -> bool:
        """Whether extent e of a layer stores a flushed K (key) or V block as computed: a device extent or
        layer, or K the policy keeps on the device; else as `host_spec` says."""
        return layout.on_device(e) or device_layer or (key and self.hooks.keys_on_device(self))

    def _extents_from_prefill(self, layout: PoolLayout, srcs, alloc, k, v, x, dtype, parts=None, on_device=False):
        """One layer's extents: prompt blocks gathered from the prefill's K/V/X, the rest empty; and the
        K extents as computed in device memory, before quantization and placement (for `keys_written`).
        parts: the layer's stored parts (`LayerHooks.layer_parts`; None: all the layout holds). on_device:
        every extent of the layer stays in device memory as computed (`LayerHooks.device_layer`)."""
        keeps = (lambda part: parts is None or part in parts)  # noqa: E731
        blk = layout.block_tokens
        n_kv, d = k.shape[1], k.shape[3]
        hdim = x.shape[2] if x is not None else None  # activations kept only where the layout stores them
        used = alloc.used_extents(layout)
        k_dev_kept = self.hooks.keys_on_device(self)
        pk, pv, px, k_dev = [], [], [], []
        for e in range(layout.num_extents):
            src, valid = srcs[e]
            E = layout.size(e)
            # a host extent as the pool stores it: quantized here, on its way to the host, for int4
            to_host = not (layout.on_device(e) or on_device)
            stored = lambda a, h=to_host: self.host_form(a) if h else a  # noqa: E731
            stored_k = lambda a, h=to_host and not k_dev_kept: self.host_form(a, key=True) if h else a  # noqa: E731
            if layout.has("kv", e):
                if e < used:
                    k_dev.append(gather_kv_extent(k, src, valid, blk))
                    pv.append(stored(gather_kv_extent(v, src, valid, blk)))
                else:
                    k_dev.append(jnp.zeros((E, n_kv, blk, d), dtype))
                    pv.append(stored(jnp.zeros((E, n_kv, blk, d), dtype)))
                pk.append(stored_k(k_dev[-1]))
                pk[-1], pv[-1] = (pk[-1] if keeps("k") else None), (pv[-1] if keeps("v") else None)
            else:
                pk.append(None), pv.append(None), k_dev.append(None)
            if layout.has("act", e) and keeps("x"):
                px.append(stored(gather_act_extent(x, src, valid, blk) if e < used else jnp.zeros((E, blk, hdim), dtype)))
            else:
                px.append(None)
        # committed, like the written extents a flush returns (else each first write recompiles); host
        # extents in one asynchronous device->host put of the layer's extents
        on_host = [self.host_pool and not (layout.on_device(e) or on_device) for e in range(layout.num_extents)]
        on_host = ([False] * len(on_host) if self.hooks.keys_on_device(self) else on_host) + on_host * 2  # K, V, X
        pick = lambda want: [(a if h == want else None) for a, h in zip(pk + pv + px, on_host)]  # noqa: E731
        n = layout.num_extents
        if self.mesh is None:
            host = M.to_host(pick(True), self.dev) if any(on_host) else pick(True)
            dev = jax.device_put(pick(False), M.device_sharding(self.dev))
        else:  # K/V by KV head (each device stores and moves its heads' blocks), X by token or along H
            kv_s, tok = S.kv_sharding(self.mesh), self.x_by_token  # (device/sharding.py)
            hp, dp = pick(True), pick(False)
            host = (M.to_host(hp[:2 * n], kv_s) + M.transfer(hp[2 * n:], S.x_shardings(hp[2 * n:], self.mesh,
                                                                                         self.host_kind, tok))
                    ) if any(on_host) else hp
            dev = (M.transfer(dp[:2 * n], M.device_sharding(kv_s))
                   + M.transfer(dp[2 * n:], S.x_shardings(dp[2 * n:], self.mesh, "device", tok)))
        both = [hh if h else dd for hh, dd, h in zip(host, dev, on_host)]
        return tuple(both[:n]), tuple(both[n:2 * n]), tuple(both[2 * n:]), k_dev

    # -- decode ------------------------------------------------------------------------------
    def _items(self, n_layers, n_groups):
        if self.opts.schedule == "row":
            return [(i, g) for g in range(n_groups) for i in range(n_layers)]
        items = []
        for i in range(n_layers):
            order = range(n_groups) if i % 2 == 0 else range(n_groups - 1, -1, -1)  # zig-zag
            items += [(i, g) for g in order]
        return items

    def fetches(self) -> bool:
        """Whether a decode step moves pool extents to the device (a host pool the policy does not read in place)."""
        return self.host_pool and self.hooks.fetches_extents(self)

    def layers_per_program(self) -> int:
        """Layers one decode program may run (`PipelineOptions.layers_per_program`) where the step issues no
        transfers between layers and nothing is speculated between them; else 1."""
        if self.fetches() or self.opts.offload_weights or self.hooks.speculates(self):
            return 1
        return self.opts.layers_per_program

    def decode_step(self, model, state: DecodeState, tokens):
        with S.context(self.mesh):
            return self._decode_step(model, state, tokens)

    def _decode_step(self, model, state: DecodeState, tokens):
        cfg, o = model.config, self.opts
        self._in_use.clear()  # the last step's allocators
        now = time.perf_counter()
        records = state.records
        if state.step_started is not None and records:
            records = records[:-1] + ({**records[-1], "time_s": now - state.step_started},)
        fam_params = without_layers(self.params(model))
        layers = self.layers(model)
        tokens = jnp.asarray(tokens, jnp.int32)
        groups = list(state.groups)
        plans = [self.hooks.plan_group(self, model, gr) for gr in groups]
        self.sliding_layers = sliding_layers(cfg)
        if self.host_pool and cfg.has_sliding_layers:
            plans = [self.window_plan(cfg, gr, plan) for gr, plan in zip(groups, plans)]
        hs = []
        positions = []
        after = []  # per group: (next positions, tail lengths) after this step
        for gr in groups:
            rows_tokens = tokens if len(groups) == 1 else tokens[gr.rows[0]:gr.rows[1]]
            h, pos, nxt_pos, nxt_len = _decode_inputs(cfg, fam_params, rows_tokens, gr.next_positions, gr.tail_len)
            hs.append(h)
            positions.append(pos)
            after.append((nxt_pos, nxt_len))
        tails = [dict(k=list(gr.tail_k), v=list(gr.tail_v), x=list(gr.tail_x), slots=list(gr.slots)) for gr in groups]
        stacks = [gr.stack for gr in groups]  # looped layers (PipelineOptions.loop_layers), or None
        items = self._items(cfg.num_layers, len(groups))
        weights: dict = {}
        fetched: dict = {}
        done_h: list = []
        resident = self.resident(model)
        moved = {"bytes_x": 0, "bytes_kv": 0, "bytes_w": 0, "arrays": 0}
        issued = 0
        # layers whose streamed W_K / W_V are gathered whole before their first program. The gather is a program
        # of the compute stream that waits for the weights' copy: dispatched at issue time (items ahead) it
        # would hold every program dispatched after it until that copy lands, serialising copy and compute
        # (OPT-13B col at N=4 on 4x H100: 651.5 ms a step so, 361.4 dispatched before the first program)
        to_gather: set = set()

        def issue(n):
            i, g = items[n]
            if not moves:
                fetched[n] = ([], [])
                return
            if o.offload_weights and i not in weights:
                kv, rest = split_layer(layers[i])
                if i < resident:  # in GPU memory already
                    weights[i] = [kv, (rest,)]
                else:
                    weights[i] = [self.to_device(kv), rest]  # W_K / W_V first
                    moved["bytes_w"] += _tree_bytes(layers[i])
                if self.gathers_kv(groups, plans, i):  # whole on every device, once for all GPU batches
                    to_gather.add(i)
            early, late = self.hooks.fetch(self, groups[g], plans[g], i)
            early_d = self.to_device(early) if early else []
            if o.offload_weights and not isinstance(weights[i][1], tuple):
                weights[i][1] = (self.to_device(weights[i][1]),)
            late_d = self.to_device(late) if late else []
            moved["bytes_x"] += _tree_bytes(early)
            moved["bytes_kv"] += _tree_bytes(late)  # as stored: int4 codes and scales
            moved["arrays"] += len(jax.tree.leaves((early, late)))
            fetched[n] = (early_d, late_d)

        # a device pool moves nothing, nor does a host pool read in place (clo, tokenselect kv=split: the layer
        # programs gather selected rows themselves): no transfer buffers to bound, the host never waits in the step
        fetches = self.fetches()
        # nothing to move (a device pool, a host pool read in place; weights on the GPU): the hooks' fetch
        # lists are empty, so `issue` skips asking for them (Python per layer on a host-bound step's path)
        moves = fetches or o.offload_weights
        fuse = self.layers_per_program()
        attend = self.hooks.attend
        pending: dict = {g: [] for g in range(len(groups))}  # fused: (layer, weights, sources) not yet run
        pending_key: dict = {}

        def run_pending(g):
            """Group g's pending layers in one `layers_step` program."""
            batch, gr, tl = pending[g], groups[g], tails[g]
            if not batch:
                return
            idx = [b[0] for b in batch]
            moving, fixed = zip(*(split_slots(attend, tl["slots"][i] if tl["slots"] else None) for i in idx))
            hs[g], ks, vs, xs, sls = layers_step(
                cfg, tuple(b[1] for b in batch), hs[g], positions[g], tuple(tl["k"][i] for i in idx),
                tuple(tl["v"][i] for i in idx), tuple(tl["x"][i] for i in idx), gr.tail_len,
                tuple(b[2] for b in batch), gr.tables, moving, fixed, attend, (o.recompute_impl, o.attention_impl))
            for j, i in enumerate(idx):
                tl["k"][i], tl["v"][i], tl["x"][i] = ks[j], vs[j], xs[j]
                if tl["slots"]:
                    tl["slots"][i] = join_slots(attend, sls[j], fixed[j])
            pending[g] = []

        sync_depth = o.sync_depth if moves else 0
        # XLA starts a host->GPU copy only after every program dispatched before it (its allocator is
        # synchronised with the compute stream), so a copy overlaps only programs dispatched after it:
        # item n+k's copies are issued before item n's program, k = lookahead. With k = 1 a layer's first
        # item (weights and blocks) could not start copying until the previous item's program ended, and
        # copies sharing the link across XLA's copy streams finished together: 18% of an OPT-30B step
        # idle on an H100. At most `window` items' buffers are alive: before issuing item m the host waits
        # for item m - window's program (an item already dispatched, so the GPU never runs dry).
        lookahead = max(1, sync_depth - 1)
        window = sync_depth + 1
        last_item = {it[0]: m for m, it in enumerate(items)}
        # fetched arrays and streamed weights stay referenced until their program is known finished (a
        # buffer freed at dispatch would be handed to the next copy, which would then wait for it)
        keep: dict = {}
        retired = 0
        for n, (i, g) in enumerate(items):
            while issued < min(n + lookahead + 1, len(items)):
                if sync_depth and issued - window >= 0:
                    jax.block_until_ready(done_h[issued - window])
                    while retired <= issued - window:
                        keep.pop(retired, None), keep.pop((retired, "w"), None)
                        retired += 1
                issue(issued)
                issued += 1
            f = fetched.pop(n)
            gr, tl = groups[g], tails[g]
            if stacks[g] is not None and i >= stacks[g].first:  # looped: one program for the stack's layers
                if i == stacks[g].first:
                    if fuse > 1:
                        run_pending(g)
                    hs[g], stacks[g] = self.run_stack(model, gr, plans[g], hs[g], positions[g], stacks[g])
                continue
            if i in to_gather:  # the layer's first program is next: its weights are needed now anyway
                to_gather.discard(i)
                weights[i][0] = S.gather_whole(weights[i][0], self.mesh)
            lp = join_layer(weights[i][0], weights[i][1][0]) if o.offload_weights else layers[i]
            if fuse > 1:  # no transfers, no speculation: queue the layer; equal programs share one call
                src = self.hooks.sources(self, gr, plans[g], i, f)
                key = program_key((lp, src, tl["k"][i], tl["v"][i], tl["x"][i], tl["slots"][i] if tl["slots"] else None))
                if pending[g] and (pending_key[g] != key or len(pending[g]) == fuse):
                    run_pending(g)
                pending[g].append((i, lp, src))
                pending_key[g] = key
                del src, f
                continue
            # (no named scope per layer: every layer runs one cached executable, traced once)
            if tl["slots"] and i + 1 < cfg.num_layers:  # dispatched before layer i's program, from its input
                tl["slots"][i + 1] = self.hooks.speculate(self, model, gr, i + 1, hs[g], positions[g],
                                                          tl["slots"][i + 1])
            src = self.hooks.sources(self, gr, plans[g], i, f)
            slot, fixed = split_slots(attend, tl["slots"][i] if tl["slots"] else None)
            hs[g], tl["k"][i], tl["v"][i], tl["x"][i], slot = layer_step(
                cfg, lp, hs[g], positions[g], tl["k"][i], tl["v"][i], tl["x"][i], gr.tail_len, src, gr.tables,
                slot, fixed, attend, (o.recompute_impl, o.attention_impl))
            if tl["slots"]:
                tl["slots"][i] = join_slots(attend, slot, fixed)
            del src
            done_h.append(hs[g])
            if sync_depth:
                keep[n] = f
            del f
            if o.offload_weights and not any(items[m][0] == i for m in fetched):
                # no issued item needs this layer's weights any more; alive until its last program ends
                w_done = weights.pop(i, None)
                if sync_depth:
                    keep[last_item[i], "w"] = w_done
        for g in pending:
            run_pending(g)
        moved.update(lookahead_items=lookahead)
        logits = [_decode_logits(cfg, fam_params, h) for h in hs]
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, 0)
        new_groups, d2h, flushed = [], 0, False
        for gr, tl, stk, (nxt_pos, nxt_len) in zip(groups, tails, stacks, after):
            gr = dataclasses.replace(gr, tail_k=tuple(tl["k"]), tail_v=tuple(tl["v"]), tail_x=tuple(tl["x"]),
                                     slots=tuple(tl["slots"]), stack=stk, next_positions=nxt_pos,
                                     tail_len=nxt_len, n_gen=gr.n_gen + 1, since_flush=gr.since_flush + 1)
            if gr.since_flush == gr.layout.block_tokens:
                gr, nbytes = self.flush(gr)
                d2h, flushed = d2h + nbytes, True
            new_groups.append(gr)
        moved.update(self.hooks.step_record(self, new_groups))
        rec = self.record(model, state, plans, moved, d2h)
        rec["flushed"] = flushed  # this step's tails became pool blocks (its time includes the writes)
        records += (rec,)
        if not o.trace:  # a trace file holds every step; the state the last RECORDS_KEPT
            records = records[-RECORDS_KEPT:]
        return logits, DecodeState(groups=tuple(new_groups), batch=state.batch, step=state.step + 1,
                                   records=records, step_started=now)

    def flush(self, gr: GroupState):
        """Every request's oldest blk tail tokens become a new pool block (one per request, lockstep)."""
        layout, blk = gr.layout, gr.layout.block_tokens
        alloc = gr.alloc.copy()
        ids = np.asarray([alloc.allocate(r) for r in range(gr.size)])
        ext_of, slot_of = layout.locate(ids)
        pk, pv, px = [list(p) for p in gr.pool_k], [list(p) for p in gr.pool_v], [list(p) for p in gr.pool_x]
        tk, tv, tx = list(gr.tail_k), list(gr.tail_v), list(gr.tail_x)
        layer_slots = list(gr.slots)
        touched = sorted(set(int(e) for e in ext_of))
        # a slot past the extent's end is dropped: one scatter program per extent size
        slots = {e: np.where(ext_of == e, slot_of, layout.size(e)) for e in touched}
        nbytes = 0
        stk = gr.stack
        if stk is not None:  # the looped layers, at once
            stk, nbytes = self.flush_stack(gr, stk, slots)
        n = len(tk) if stk is None else stk.first  # the layers called one by one: all of them at once here
        if n:
            nbytes += self._flush_layers(gr, n, touched, ext_of, slots, (pk, pv, px), (tk, tv, tx), layer_slots)
        return dataclasses.replace(
            gr, pool_k=tuple(tuple(p) for p in pk), pool_v=tuple(tuple(p) for p in pv),
            pool_x=tuple(tuple(p) for p in px), tail_k=tuple(tk), tail_v=tuple(tv), tail_x=tuple(tx),
            tail_len=gr.tail_len - blk, tables=alloc.device_tables(layout, self.tables_at), alloc=alloc, since_flush=0,
            slots=tuple(layer_slots), stack=stk), nbytes

    def _flush_layers(self, gr: GroupState, n: int, touched, ext_of, slots: dict, pools, tails, layer_slots) -> int:
        """`flush` of layers 0..n-1 (pools, tails and layer_slots: lists updated in place): every layer's blocks
        popped in one program, quantized in one, written in one per extent and memory space
        (`write_stored_blocks_many`), their key metadata updated by the policy for all of them at once.
        Returns the device->host bytes."""
        layout, blk = gr.layout, gr.layout.block_tokens
        (pk, pv, px), (tk, tv, tx) = pools, tails
        xs = [i for i in range(n) if tx[i] is not None]
        blocks, new_tails = _pop_blocks(tuple(tk[:n]) + tuple(tv[:n]) + tuple(tx[i] for i in xs), blk,
                                        (1,) * (2 * n) + (0,) * len(xs))
        tk[:n], tv[:n] = new_tails[:n], new_tails[n:2 * n]
        for i, t in zip(xs, new_tails[2 * n:]):
            tx[i] = t
        popped = {"k": blocks[:n], "v": blocks[n:2 * n], "x": dict(zip(xs, blocks[2 * n:]))}
        dev = [self.hooks.device_layer(self, i) for i in range(n)]

        def stores(i, e):  # (kind, extent array, stored as computed) of layer i's arrays in extent e
            out = []
            if layout.has("kv", e):
                out += [(kind, pool[i][e], self._stores_native(layout, e, dev[i], kind == "k"))
                        for kind, pool in (("k", pk), ("v", pv)) if pool[i][e] is not None]
            if layout.has("act", e) and i in popped["x"] and px[i][e] is not None:
                out.append(("x", px[i][e], layout.on_device(e)))  # a layer may store X in place of K / V
            return out

        # blocks bound for host memory in some extent: int4 / int8 made once per layer and kind, on the GPU,
        # before they move, every layer in one program (a flushed block is whole: blk tokens of every request)
        want = sorted({(kind, i) for i in range(n) for e in touched for kind, _, native in stores(i, e)
                       if not native and self.host_spec(kind == "k") is not None})
        made = dict(zip(want, _quantize_many(tuple(popped[k][i] for k, i in want),
                                             tuple(self.host_spec(k == "k") for k, _ in want))))
        nbytes = 0
        for e in touched:
            share = int((ext_of == e).sum()) / gr.size  # of the blocks written, those in extent e
            where, exts, new = [], [], []
            for i in range(n):
                for kind, ext, native in stores(i, e):
                    w = popped[kind][i] if native else made.get((kind, i), popped[kind][i])
                    where.append((kind, i)), exts.append(ext), new.append(w)
                    nbytes += 0 if native else int(_tree_bytes(w) * share)  # device -> host bytes
            for (kind, i), a in zip(where, write_stored_blocks_many(exts, new, slots[e])):
                {"k": pk, "v": pv, "x": px}[kind][i][e] = a
            if layer_slots and layout.has("kv", e):
                layer_slots[:n] = self.hooks.keys_written(self, tuple(layer_slots[:n]), e, popped["k"], slots[e])
        return nbytes

    def release(self, state: DecodeState, rows) -> DecodeState:
        """Frees the pool blocks of finished requests (rows of the whole batch); their later steps
        attend only their tail."""
        groups = []
        for gr in state.groups:
            mine = [r - gr.rows[0] for r in rows if gr.rows[0] <= r < gr.rows[1]]
            if mine:
                alloc = gr.alloc.copy()
                for r in mine:
                    alloc.release(r)
                gr = dataclasses.replace(gr, alloc=alloc, tables=alloc.device_tables(gr.layout, self.tables_at))
            groups.append(gr)
        return dataclasses.replace(state, groups=tuple(groups))

    # -- the step record -------------------------------------------------------------------------
    def record(self, model, state: DecodeState, plans, moved, d2h) -> dict:
        from kvoffload.plan.cost import predict_layers

        gr0, p0 = state.groups[0], plans[0]
        blk = gr0.layout.block_tokens
        works = [self.layer_work(model, gr, p) for gr, p in zip(state.groups, plans)]
        L, r = model.config.num_layers, self.resident(model)
        pred = predict_layers(self.cost, self.shape(model), works, offload_weights=self.opts.offload_weights,
                              layers=L - r)
        if r:  # resident layers move no weights
            kept = predict_layers(self.cost, self.shape(model), works, offload_weights=False, layers=r)
            pred = {k: (v + kept[k] if isinstance(v, float) else v) for k, v in pred.items()}
        rec = {"step": state.step, "context": int(max(gr0.alloc.tables[r].__len__() * blk + gr0.tail_base[r]
                                                         for r in range(gr0.size)) + gr0.n_gen),
               "used_extents": p0.used_extents, "recompute_extents": p0.recompute_extents,
               "split_point": gr0.layout.start(p0.recompute_extents) * blk // max(1, gr0.size),
               "split_reason": p0.note, "recompute_tokens": sum(w.recompute_tokens for w in works), **moved,
               "bytes_d2h": d2h, "bytes_h2d": moved["bytes_x"] + moved["bytes_kv"] + moved["bytes_w"],
               "predicted_s": pred["step_s"], "predicted_transfer_s": pred["transfer_s"],
               "predicted_gpu_s": pred["gpu_s"], "predicted_gather_s": pred["gather_s"],
               "bytes_gather": pred["bytes_gather"], "time_s": None}
        infos = [p.groups_info for p in plans if p.groups_info is not None]
        if infos:
            rec["gpu_batches"] = infos
        if self.opts.trace:
            self.write_trace(self.opts.trace, state.records + (rec,))
        return rec

    def layer_work(self, model, gr: GroupState, plan: GroupPlan):
        """The cost model's view of one GPU batch's layer under this plan."""
        return modes_work(self.shape(model), gr.layout, gr.size, plan.extent_modes(self, gr.layout),
                          gr.alloc.extents_in_use(gr.layout), plan.recompute_extents, attended_tokens(gr))

    def shape(self, model):
        key = id(model.params)
        if getattr(self, "_shape_key", None) != key:
            self._shape_key = key
            # first without whole W_K / W_V: replicate_kv asks the hooks, which may read this shape's bytes per token
            self._shape_val = self._layer_shape(model, False)
            if self.replicate_kv(model):
                self._shape_val = self._layer_shape(model, True)
        return self._shape_val

    def _layer_shape(self, model, replicate_kv: bool):
        """One device's shape: its heads, 1/N of each X, and what recomputing costs between devices."""
        from kvoffload.plan.cost import LayerShape

        lp = model.params.layers[0]
        wb = weight_bytes_per_device(model.config, lp.wk.dtype, model.params, self.tp, replicate_kv)
        return LayerShape.of(model.config, jnp.dtype(lp.wk.dtype).itemsize, wb.per_layer, wb.kv_per_layer,
                             host_dtype="int4" if self.int4 else "native", int4_group_size=self.opts.int4_group_size,
                             tensor_parallel=self.tp, int4_k_quant=self.opts.int4_k_quant,
                             block_tokens=self.opts.block_tokens, x_split="token" if self.x_by_token else "hidden")

    def host_row_bytes(self, d: int, itemsize: int, key: bool = False) -> int:
        """Bytes of one row of d V (key=True: K) values as this pipeline's host pool stores it, what a gathered
        row moves over PCIe: the model's dtype, or int4 codes with a float32 step and min per group (K as
        int4_k_quant says: int8 codes, or the model's dtype with "native")."""
        from kvoffload.plan.cost import stored_bytes

        o = self.opts
        return int(stored_bytes(d, itemsize, "int4" if self.int4 else "native", o.int4_group_size,
                                o.int4_k_quant if key else "token"))

    def host_spec(self, key=False):
        """`quantize_blocks`' (group size, scales, bits) of a K (key=True), V or X block / extent as a host pool
        stores it: int4 (K scaled as int4_k_quant says, V and X per token; int8 K codes with
        int4_k_quant="int8"), or None: as it is (native pools; K with int4_k_quant="native")."""
        k_quant, g = self.opts.int4_k_quant, self.opts.int4_group_size
        if not self.int4 or (key and k_quant == "native"):
            return None
        if key and k_quant == "int8":
            return g, "token", 8
        return g, k_quant if key else "token", 4

    def host_form(self, a, key=False):
        """A K (key=True), V or X block / extent as a host pool stores it (`host_spec`)."""
        spec = self.host_spec(key)
        return a if spec is None else quantize_blocks(a, *spec)

    def write_trace(self, path, records):
        import json
        import os

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"policy": self.hooks.name, "options": {**dataclasses.asdict(dataclasses.replace(self.opts, mesh=None)),
                                                              "mesh": str(self.opts.mesh), "extent_mb": self.extent_mb},
                       "cost_model": self.cost.to_json(), "steps": list(records)}, f, indent=1, default=str)


@functools.lru_cache(maxsize=16)
def sliding_layers(cfg) -> tuple:
    """Per layer whether it attends a sliding window."""
    return tuple(cfg.layer_window(i) is not None for i in range(cfg.num_layers))


def attended_tokens(gr: GroupState) -> int:
    """Tokens the group's next step attends, summed over its requests (pool blocks + tails + new)."""
    blk = gr.layout.block_tokens
    return sum(len(t) for t in gr.alloc.tables) * blk + sum(gr.tail_base) + gr.size * (gr.since_flush + 1)


def extent_work(shape, layout: PoolLayout, batch: int, used: int, recompute: int, tokens: int, fetch: bool = True):
    """The cost model's LayerWork of a layer that recomputes extents [0, recompute) from X and fetches
    K/V of extents [recompute, used) (fetch False: a device pool, nothing moves)."""
    n = layout.num_extents
    modes = tuple("dev" if not fetch else "x" if e < recompute else "kv" if e < used else "skip" for e in range(n))
    in_use = np.arange(n) < used
    return modes_work(shape, layout, batch, modes, in_use, recompute, tokens)


def modes_work(shape, layout: PoolLayout, batch: int, modes, in_use, recompute: int, tokens: int):
    """The cost model's LayerWork of a layer that gets each extent as `modes` says (GroupPlan.modes):
    fetched extents move whole; an extent's K/V are recomputed (whole) when it is fetched as X, or it is
    a device-resident activation extent in use, or it holds both kinds and lies below `recompute`."""
    from kvoffload.plan.cost import LayerWork

    blk = layout.block_tokens
    bytes_kv = bytes_x = 0.0
    transfers = rec_tokens = 0
    for e, m in enumerate(modes):
        size = layout.size(e) * blk
        if m == "kv":
            bytes_kv += size * shape.kv_host_tok  # as the host pool stores it (int4: codes + scales)
            transfers += 2
        elif m == "x":
            bytes_x += size * shape.x_host_tok  # as stored (int4: codes + scales)
            transfers += 1
            rec_tokens += size
        elif m == "dev" and in_use[e] and layout.has("act", e) and (not layout.has("kv", e) or e < recompute):
            rec_tokens += size
    return LayerWork(batch=batch, bytes_kv=bytes_kv, bytes_x=bytes_x, transfers=transfers,
                     recompute_tokens=rec_tokens, attended_tokens=tokens)


def flush_possible(lengths, capacity: int, blk: int) -> bool:
    """Whether a generation up to `capacity` tokens ever flushes a tail block (one every blk steps)."""
    return int(capacity) - int(np.max(lengths, initial=0)) >= blk


def tail_slots(lengths, capacity: int, blk: int) -> int:
    """Slots of a GPU tail: the prompts' partial blocks plus the tokens generated between flushes
    (a block's worth, or fewer when the generation is shorter), a power of two for the kernels."""
    lengths = np.asarray(lengths, np.int64)
    need = int((lengths % blk).max(initial=0)) + min(blk, max(1, int(capacity) - int(lengths.max(initial=0))))
    return min(2 * blk, 1 << max(0, need - 1).bit_length())


def _nbytes(a) -> int:
    return int(a.size * a.dtype.itemsize)


def _tree_bytes(tree) -> int:
    return sum(_nbytes(a) for a in jax.tree.leaves(tree))
