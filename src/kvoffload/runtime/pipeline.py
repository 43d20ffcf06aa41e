"""The layer pipeline: prefill into the block pool and decode layer by layer, for every pool policy.

One loop for all layered policies, each a set of hooks (`hooks.LayerHooks`). The loop is driven from Python: for
work item n (layer i of GPU batch g) it first issues item n+D-1's transfers (eager ``device_put`` of whole arrays:
the only transfers that overlap the jitted compute dispatched after them), then item n's jitted program
(`step.StepRun`).

The pipeline owns what all policies share: weights (resident or streamed, W_K/W_V first: `weights`), the new
token's q/k/v and its GPU tail (`layer`), the tail's flush into the pool (`flush`), schedules (``row``: each GPU
batch through every layer; ``column``: every GPU batch through layer i before layer i+1, zig-zag, each layer's
weights fetched once per step), how far transfers run ahead (item n+D-1's transfers are issued before item n's
program, D = ``sync_depth``; before issuing item m the host waits for item m-D-1's program, so at most D+1 items'
buffers are alive) and the step record (`cost`).

Attention of a layer (`attention`): the extents in order (``ops.paged_decode_attention`` over each extent's block
tables, folded into an fp32 accumulator with ``ops.merge_attention_into``), then the GPU tail. A device pool runs
the same programs over the same blocks, so a policy that moves the same blocks gives its logits bit for bit.

int4 host storage (``host_dtype="int4"``): every K, V and X extent of a host pool is a ``QuantizedInt`` (uint8
codes, float32 step and min per group; along d for K/V, along H for X), quantized on the GPU on its way to the host
(prefill's extents, each flushed block), fetched as it is and dequantized to the compute dtype inside the layer
program (`attention.native_extent`). GPU-resident extents, K extents a policy keeps on the GPU and the GPU tails
stay in the model's dtype: they never cross PCIe. A policy reading selected rows in place dequantizes those rows.

State (`state`): `DecodeState` is a pytree (pool arrays, tails, tables) with host bookkeeping (the allocator,
counters, the step records) as static fields; a step takes it and returns a new one.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.config import UnsupportedModelError
from kvoffload.device import memory as M
from kvoffload.device import sharding as S
from kvoffload.runtime.cost import RunCost, array_bytes, tree_bytes
from kvoffload.runtime.layer import sliding_layers
from kvoffload.runtime.flush import Flush
from kvoffload.runtime.hooks import GroupPlan, LayerHooks
from kvoffload.runtime.options import EXTENT_MB_PER_DEVICE, PipelineOptions
from kvoffload.runtime.prefill import Prefill
from kvoffload.runtime.state import DecodeState, GroupState
from kvoffload.runtime.step import StepRun, decode_inputs, decode_logits
from kvoffload.runtime.weights import WeightPlacement, without_layers


RECORDS_KEPT = 1024  # step records a DecodeState keeps without PipelineOptions.trace (a long generation's grew a
# tuple copied whole every step)


class LayerPipeline(WeightPlacement, Prefill, Flush, RunCost):
    """Prefill and decode for one model and one policy's hooks. Holds only what is fixed for a run
    (options, memory placement, the cost model); everything that changes per step is in the state. Its jobs
    live one per module (weights, prefill, flush, costs), as bases that reach each other through
    self; this class holds the run's fixed state, the small device values shared by every step and the
    decode step."""

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

    # -- decode ------------------------------------------------------------------------------
    def decode_step(self, model, state: DecodeState, tokens):
        with S.context(self.mesh):
            return self._decode_step(model, state, tokens)

    def _decode_step(self, model, state: DecodeState, tokens):
        """One token for every request: the plans, the inputs, the work items, the logits, the tails advanced
        (and flushed every blk steps), the step record."""
        self._in_use.clear()  # the last step's allocators
        now = time.perf_counter()
        records = self._timed_records(state, now)
        fam_params = without_layers(self.params(model))
        layers = self.layers(model)
        tokens = jnp.asarray(tokens, jnp.int32)
        groups = list(state.groups)
        plans = self._plans(model, groups)
        hs, positions, after = self._inputs(model.config, fam_params, tokens, groups)
        run = StepRun(self, model, groups, plans, layers, hs, positions)
        moved = run.run()
        logits = [decode_logits(model.config, fam_params, h) for h in hs]
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, 0)
        new_groups, d2h, flushed = self._advance(groups, run.tails, after)
        moved.update(self.hooks.step_record(self, new_groups))
        rec = self.record(model, state, plans, moved, d2h)
        rec["flushed"] = flushed  # this step's tails became pool blocks (its time includes the writes)
        records += (rec,)
        if not self.opts.trace:  # a trace file holds every step; the state the last RECORDS_KEPT
            records = records[-RECORDS_KEPT:]
        return logits, DecodeState(groups=tuple(new_groups), batch=state.batch, step=state.step + 1,
                                   records=records, step_started=now)

    @staticmethod
    def _timed_records(state: DecodeState, now: float) -> tuple:
        """The state's records, the last one given its step's time (from its start to now)."""
        records = state.records
        if state.step_started is not None and records:
            records = records[:-1] + ({**records[-1], "time_s": now - state.step_started},)
        return records

    def _plans(self, model, groups) -> list:
        """The policy's plan of each GPU batch for this step (a host pool's sliding layers skip the extents that
        left every window)."""
        cfg = model.config
        plans = [self.hooks.plan_group(self, model, gr) for gr in groups]
        self.sliding_layers = sliding_layers(cfg)
        if self.host_pool and cfg.has_sliding_layers:
            plans = [self.window_plan(cfg, gr, plan) for gr, plan in zip(groups, plans)]
        return plans

    def _inputs(self, cfg, fam_params, tokens, groups):
        """Per GPU batch: the new tokens' hidden states and positions, and (next positions, tail lengths) after
        this step, one program each."""
        hs, positions, after = [], [], []
        for gr in groups:
            rows_tokens = tokens if len(groups) == 1 else tokens[gr.rows[0]:gr.rows[1]]
            h, pos, nxt_pos, nxt_len = decode_inputs(cfg, fam_params, rows_tokens, gr.next_positions, gr.tail_len)
            hs.append(h)
            positions.append(pos)
            after.append((nxt_pos, nxt_len))
        return hs, positions, after

    def _advance(self, groups, tails, after):
        """(new groups, device->host bytes, whether a flush ran): each group with the step's tails, slots and
        counters, flushed where its tails hold a new block of every request."""
        new_groups, d2h, flushed = [], 0, False
        for gr, tl, (nxt_pos, nxt_len) in zip(groups, tails, after):
            gr = dataclasses.replace(gr, tail_k=tuple(tl["k"]), tail_v=tuple(tl["v"]), tail_x=tuple(tl["x"]),
                                     slots=tuple(tl["slots"]), next_positions=nxt_pos,
                                     tail_len=nxt_len, n_gen=gr.n_gen + 1, since_flush=gr.since_flush + 1)
            if gr.since_flush == gr.layout.block_tokens:
                gr, nbytes = self.flush(gr)
                d2h, flushed = d2h + nbytes, True
            new_groups.append(gr)
        return new_groups, d2h, flushed

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
                where["host" if getattr(a.sharding, "memory_kind", None) == "pinned_host" else "gpu"] += array_bytes(a)
            tail = tree_bytes((gr.tail_k[i], gr.tail_v[i], gr.tail_x[i]))
            slots = gr.tail_k[i].shape[2] * gr.size if gr.tail_k[i] is not None else 1
            out[kind] = {"layers": sum(1 for s in self.sliding_layers if s == flag),
                         "pool_bytes_per_token": {k: v / tokens for k, v in where.items()},
                         "tail_bytes_per_token": tail / slots}
            if not self.host_pool:
                fetched = "nothing (device pool)"
            elif self.hooks.device_layer(self, i):
                fetched = "nothing (a device layer: its blocks stay in GPU memory)"
            elif not self.fetches():
                fetched = "no whole extent (the layer program reads the rows it selects in place)"
            else:
                fetched = ("extents holding a block of some request's window; all its tokens stay in the pool "
                           "(masked)") if flag else "every extent in use"
            out[kind]["fetched"] = fetched
            if flag:
                out[kind]["window"] = window
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
        if self.mesh is not None:
            raise UnsupportedModelError(f"policy {self.hooks.name!r} cannot run a model with sliding-window layers: "
                                        "the tensor-parallel attention paths have no sliding-window mask yet "
                                        "(tensor_parallel=1)")

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
        return self.host_pool and self.hooks.capabilities.fetches_extents
