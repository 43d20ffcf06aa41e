"""The hook protocol: what a policy on the layer pipeline implements (a `LayerHooks` subclass), `Capabilities`,
what its hooks declare about how the pool is stored and read, and `GroupPlan`, what its plan of a GPU batch
returns.

Nothing is required: the defaults are a complete policy that attends every extent in use from the pool as it is
(a device pool) or fetched whole (a host pool). A policy sets ``name`` and overrides what it changes. Every method
gets the `LayerPipeline` (``pipe``: its options, mesh and helpers) first.

Declared (class attributes, or properties of the policy's own options)
  ``name``                  the policy's name in messages and traces.
  ``kinds``                 what the pool may store: ("kv",), ("kv", "act"); `split_store` says where.
  ``x_split``               on a mesh, how activation extents are split: "hidden" (along H) or "token".
  ``extent_mb_per_device``  MiB of K per extent on each device where the options give none (None: the default).
  ``capabilities``          a `Capabilities`: where a host pool keeps K, whether decode moves whole extents. The
                            runtime reads its fields (``hooks.capabilities.keys_on_device``); a policy whose
                            answer depends on its options gives a property.

At prefill, fixed for the run (the layout first, then the parts that read it)
  ``group_rows(pipe, model, lengths, capacity, t_pad)``   -> the GPU batches, row ranges [(start, stop)].
  ``pool_layouts(pipe, model, dtype, rows, lengths, capacity)`` -> one `PoolLayout` per GPU batch.
  ``split_store(pipe, model, layout, lengths)``            -> the layout with its kv / act extent ranges.
  ``layer_parts(pipe, layer)``    -> which of "k", "v", "x" a layer stores (None: all the layout holds).
  ``device_layer(pipe, layer)``   -> whether a host pool keeps this layer's blocks in device memory.
  ``init_slots(pipe, model, layout, batch)`` -> the policy's own state, one pytree per layer, or ().
  ``keys_written(pipe, slots, extent, k_blocks, at)`` -> the slots after K blocks entered the pool (also at each
                                  flush).
  ``recomputes(pipe, model)``     -> whether the run may recompute K/V from activations (a method: a policy may
                                  decide it from the model's shape).

Each step, on the host (cheap: they run per GPU batch or per layer)
  ``plan_group(pipe, model, group)`` -> a `GroupPlan`: extents in use, how many to recompute, or per-extent modes.
  ``fetch(pipe, group, plan, layer)`` -> (early, late) host arrays to move: early (X) right after W_K / W_V, late
                                  (K/V) after the rest of the weights.
  ``sources(pipe, group, plan, layer, fetched)`` -> the layer program's sources (a structure fixed for the run, so
                                  the program compiles once): `PoolSources` by default. A sliding-window layer's
                                  program gives `attend` ``sources.windowed(key_start)`` (its window's first
                                  position per request): a policy's own sources pass it on to their `PoolSources`.
  ``token_recompute(pipe, group, plan, layer)`` -> on a token-split mesh, per extent whether it is recomputed.
  ``speculate(pipe, model, group, layer, h, positions, slot)`` -> layer `layer`'s slots after work dispatched
                                  before layer - 1's program (default: unchanged).
  ``step_record(pipe, groups)``   -> what the policy adds to the step record (device values, never read here).

Inside the layer program (traced; a pure function)
  ``attend(cfg, lp, q, acc, sources, tables, slots, recompute_impl, attention_impl)`` -> (acc, slots): the sources
                                  folded into the fp32 accumulator in extent order, the layer's slots updated. It
                                  may carry ``split_slots(slots)`` -> (moving, fixed) and ``join_slots(moving,
                                  fixed)``: the part the program only reads is passed but not returned.

For the memory plan
  ``slot_memory(pipe, model, layouts, batch)`` -> GPU bytes of the slots by part name.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kvoffload.runtime.attention import PoolSources, attend_pool
from kvoffload.runtime.pool import PoolLayout
from kvoffload.runtime.state import GroupState


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a policy's hooks declare about how its pool is stored and read, fixed for a run (the defaults: K and
    V where the layout puts them, host extents fetched whole)."""

    # a host pool keeps its K extents in device memory (the model's dtype: prefill places them there, a flush
    # writes them as computed, the memory plan counts them on the GPU), V alone on the host: keys scored on the
    # GPU, the selected values read in place by the layer program
    keys_on_device: bool = False
    # decode moves whole host extents to the device (transfer buffers in the memory plan, the step's lookahead
    # and waits); False where the layer program reads only selected rows of the host pool in place
    fetches_extents: bool = True


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

    def layer_modes(self, pipe, layout: PoolLayout, layer: int) -> tuple:
        """extent_modes as layer `layer` gets its extents (a sliding layer: sliding_modes, where set)."""
        if self.sliding_modes and pipe.sliding_layers[layer]:
            return self.sliding_modes
        return self.extent_modes(pipe, layout)

    def extent_modes(self, pipe, layout: PoolLayout) -> tuple:
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
    extent from the pool as it is (device memory: attended in place; host memory: fetched whole)."""

    name = "pool"
    kinds = ("kv",)  # what the pool can store (split_store says where)
    # on a mesh, how activation extents are split: "token" (each device recomputes every head's K/V of its
    # tokens: `attend_act_by_token`; the extents' K/V are attended whole, by `attend_pool`) or "hidden"
    # (along H: single X rows readable on every device, for policies that gather rows)
    x_split = "hidden"
    # MiB of K per extent on each device where PipelineOptions.extent_mb is not given (None:
    # EXTENT_MB_PER_DEVICE, the unit a fetching policy moves, shared with a device pool for the same blocks)
    extent_mb_per_device: float | None = None
    capabilities = Capabilities()  # what the runtime may assume of this policy's pool (a property where options decide)

    def recomputes(self, pipe, model) -> bool:
        """Whether this run may recompute K/V from activation extents (on a token-split mesh each device then
        keeps W_K / W_V whole when the weights stay on the GPU)."""
        return "act" in self.kinds

    def plan_group(self, pipe, model, group: GroupState) -> GroupPlan:
        return GroupPlan(used_extents=group.used_extents)

    def fetch(self, pipe, group: GroupState, plan: GroupPlan, layer: int):
        """(early, late) lists of host arrays to move for this layer (empty for a device pool)."""
        modes = plan.layer_modes(pipe, group.layout, layer)
        early = [group.pool_x[layer][e] for e, m in enumerate(modes) if m == "x"]
        late = []
        for e, m in enumerate(modes):
            if m == "kv":
                late += [group.pool_k[layer][e], group.pool_v[layer][e]]
        return early, late

    attend = staticmethod(attend_pool)  # the pure function the layer program folds the sources with

    def layer_parts(self, pipe, layer: int) -> tuple | None:
        """Which of its extents' parts layer `layer` stores, of "k", "v", "x", where the layout holds that
        kind (a selective policy storing activations: X in place of V, or of K and V, per layer); None:
        every part the layout says. Fixed at prefill (`pool_layouts` runs first)."""
        return None

    def device_layer(self, pipe, layer: int) -> bool:
        """Whether layer `layer` of a host pool keeps all its K/V blocks in device memory, in the model's dtype
        (a layer whose every head attends its whole context each step, as a device pool does: its
        blocks never go to the host, the flush writes them in place). Fixed at prefill (`pool_layouts` runs
        first). Default: no layer."""
        return False

    def init_slots(self, pipe, model, layout: PoolLayout, batch: int) -> tuple:
        """The policy's own state, one pytree per layer (per-request / per-head: selections, cached
        queries, GPU cache buffers), carried in the group's state from step to step; `attend` gets its
        layer's and returns the new one. () for none. Made before prefill's layers run."""
        return ()

    def keys_written(self, pipe, slots: tuple, extent: int, k_blocks: tuple, at) -> tuple:
        """Layers' slots after K blocks entered the pool: per layer (slots[j], k_blocks[j]), K blocks
        [n, n_kv, blk, d] (device memory, the model's dtype) written to extent `extent` at slots at [n] (host
        ints, the same for every layer; entries outside the extent are dropped, as `write_blocks` does). Called at
        prefill (one layer, every extent, at = 0..E-1) and at each flush (every layer called one by one, at
        once: a policy should update them in a few programs, not a few per layer), only where the policy keeps
        slots: GPU-side retrieval metadata of keys that may live on the host (page bounds, hash codes).
        Default: unchanged."""
        return slots

    def speculate(self, pipe, model, group: GroupState, layer: int, h, positions, slot):
        """Layer `layer`'s slots after a speculative step dispatched before layer `layer` - 1's program, with h
        the input hidden state of layer `layer` - 1 and positions the new token's (a selective policy: a guessed
        selection from an approximate query, its rows fetched while layer `layer` - 1 computes). Default:
        unchanged."""
        return slot

    def step_record(self, pipe, groups) -> dict:
        """What the policy adds to a step's record, from the groups' state after the step (device values,
        never read on the host here: a step does not wait for the device). Default: nothing."""
        return {}

    def slot_memory(self, pipe, model, layouts, batch: int) -> dict:
        """GPU bytes of the slots (`init_slots`) by part name, for the memory plan. Default: none."""
        return {}

    def sources(self, pipe, group: GroupState, plan: GroupPlan, layer: int, fetched):
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

    def token_recompute(self, pipe, group: GroupState, plan: GroupPlan, layer: int) -> tuple:
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

    def group_rows(self, pipe, model, lengths, capacity: int, t_pad: int | None = None) -> list:
        """The GPU batches: contiguous row ranges (start, stop) of the batch (default: gpu_batches
        ranges of equal size). t_pad: the prompts' padded length (what prefill's workspace holds)."""
        b = len(lengths)
        g = min(pipe.opts.gpu_batches, b)
        bounds = np.linspace(0, b, g + 1).astype(int)
        return [(int(bounds[i]), int(bounds[i + 1])) for i in range(g)]

    def pool_layouts(self, pipe, model, dtype, rows, lengths, capacity: int) -> list:
        """Each GPU batch's pool layout (default: `plan_pool`'s extents, then `split_store`)."""
        from kvoffload.plan.memory import plan_pool

        # the whole model's config, not one device's: each device moves its heads' share of every extent; with
        # a given extent_mb the extents hold the same blocks as on one device (same split units, same programs
        # over the same blocks), by default they are N times one device's (`PipelineOptions.extent_mb`)
        plan = plan_pool(model.config, dtype, [lengths[a:z] for a, z in rows], capacity,
                         block_tokens=pipe.opts.block_tokens, extent_mb=pipe.extent_mb,
                         host_dtype="int4" if pipe.int4 else "native")
        return [self.split_store(pipe, model, lay, lengths[a:z]) for lay, (a, z) in zip(plan.layouts, rows)]

    def split_store(self, pipe, model, layout: PoolLayout, lengths) -> PoolLayout:
        """Which extents hold which kinds (default: every kind everywhere)."""
        n = layout.num_extents
        return dataclasses.replace(layout, kv_extents=(0, n) if "kv" in self.kinds else (0, 0),
                                   act_extents=(0, n) if "act" in self.kinds else (0, 0))
