"""A decode's state: `GroupState` (one GPU batch's pool arrays, tables, tails and a policy's slots, with host
bookkeeping as static fields), `DecodeState` (all of them and the step records), and the stacked form of a run
of layers that one `loop_layers` program decodes (`StackedLayers`, `LayerStack`, `LayerRows`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.runtime.pool import BlockAllocator, BlockTables, PoolLayout


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


def split_slots(attend, slot):
    """(the part of slot a layer program changes, the part it only reads or None): `attend.split_slots` where
    the policy has one (host side, per call: it must be cheap)."""
    split = getattr(attend, "split_slots", None)
    return (slot, None) if split is None or slot is None else split(slot)


def join_slots(attend, slot, fixed):
    return slot if fixed is None else attend.join_slots(slot, fixed)


# ---------------------------------------------------------------------------------------------
# the stacked state of looped layers (`loop.loop_layers`; docs/ARCHITECTURE.md "Execution modes")
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
    layer for its selection's buffers, so the refill kernel writes them in place and sparse
    attention reads them in place (at slot ids + offset). A dynamic slice of a stacked [n, ...] buffer would be
    copied out and back by XLA every layer.
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
