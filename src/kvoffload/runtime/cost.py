"""What a run costs: its memory plan (checked before anything is allocated), the cost model's view of a step
(`LayerWork` per GPU batch) and the step record's predictions beside what moved, and the byte counts."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.device import memory as M
from kvoffload.device import sharding as S
from kvoffload.plan.memory import weight_bytes_per_device
from kvoffload.runtime.hooks import GroupPlan
from kvoffload.runtime.pool import PoolLayout
from kvoffload.runtime.state import DecodeState, GroupState


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


def array_bytes(a) -> int:
    return int(a.size * a.dtype.itemsize)


def tree_bytes(tree) -> int:
    return sum(array_bytes(a) for a in jax.tree.leaves(tree))


class RunCost:
    """`LayerPipeline`'s memory plan, cost model and step record."""

    @property
    def cost(self):
        from kvoffload.plan.cost import CostModel

        if self._cost is None:
            self._cost = CostModel.load(self.opts.profile) if self.opts.profile else CostModel.default(self.dev.platform)
        return self._cost

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
                          k_on_device=self.hooks.capabilities.keys_on_device, activation_split=self.tp,
                          x_by_token=self.x_by_token,
                          fetch=self.hooks.capabilities.fetches_extents,
                          layer_parts=[self.hooks.layer_parts(self, i) for i in range(cfg.num_layers)],
                          device_layers=[self.hooks.device_layer(self, i) for i in range(cfg.num_layers)],
                          slots=slot_parts)
        if o.offload_weights and M.on_host(model.params.layers):
            mem.host["weights"] = 0  # already in host memory (counted by MemAvailable)
        return mem

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

    def write_trace(self, path, records):
        import json
        import os

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"policy": self.hooks.name, "options": {**dataclasses.asdict(dataclasses.replace(self.opts, mesh=None)),
                                                              "mesh": str(self.opts.mesh), "extent_mb": self.extent_mb},
                       "cost_model": self.cost.to_json(), "steps": list(records)}, f, indent=1, default=str)
