"""A decode's state: `GroupState` (one GPU batch's pool arrays, tables, tails and a policy's slots, with host
bookkeeping as static fields), `DecodeState` (all of them and the step records), and the split of a layer's slots
into the part its program changes and the part it only reads (`split_slots`, `join_slots`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

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
    # [b] int32: the next token's positions (prompt length + n_gen), advanced on the device by each step's input
    # program: a Python int there was a host->device copy a step (~1 ms of an H200 host's step, traced). It and
    # tail_len start committed, as that program's outputs are (else the first step's programs compile twice)
    next_positions: Any = None

    @property
    def size(self) -> int:
        return self.rows[1] - self.rows[0]

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
