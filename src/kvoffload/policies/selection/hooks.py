"""`SelectionHooks`: the layer hooks the selective policies build on (`tokenselect`'s `TokenSelectHooks`,
`clo`'s `CloHooks`): the pool read in place (large extents, `IN_PLACE_EXTENT_MB`), ``kv=split`` placement (a
host pool whose extents are given to the layer program as they are, "dev": nothing fetched), the store per
layer (store=kv|act|auto: V (or K/V) rows or activations X, `choose_stores`), the selection's static size
(`static_budget`), the slots committed and their memory, the layer program's sources (`SelectSources`) and
the replayed cache decision (`replay_hit_rate`).

A subclass gives its `attend` (with token_budget, token_ratio, token_min, num_sink, num_recent and
page_size), its slots (`slot_maker`, `slot_specs`, `slot_parts`), `name`, `option_error` and, for a host
pool, where K lives (`capabilities`' keys_on_device); with heads that select their whole context,
`persistent_for_stores`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.device import sharding as S
from kvoffload.runtime.attention import PoolSources
from kvoffload.runtime.hooks import Capabilities, LayerHooks
from kvoffload.runtime.layer import sliding_layers
from kvoffload.policies.options import PolicyOptionError
from kvoffload.policies.selection.cache import device_shapes, place_slots, replay_rates
from kvoffload.policies.selection.rows import SelectSources
from kvoffload.policies.selection.space import request_token_bound, union_tiers

IN_PLACE_EXTENT_MB = 1024.0  # the default extent of a pool read in place (`SelectionHooks.extent_mb_per_device`)


def tree_nbytes(tree) -> int:
    """Bytes of a pytree's arrays (or their shapes, from eval_shape)."""
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


class SelectionHooks(LayerHooks):
    """The hooks a selective policy's pipeline runs (the module's doc): a pool read in place, its extents
    given as they are with kv=split, the store per layer, the slots of `slot_maker` committed and sized."""

    kinds = ("kv",)
    option_error = PolicyOptionError  # the class the policy's option errors have (a subclass gives its own)
    # the layer programs read the pool in place (selected rows; no extent is ever moved whole), so an extent
    # is only an allocation and, per extent, leaves of every layer call (pool arrays, block table, counts, first
    # positions, Quest pages): clo at 128K (Llama-3-8B) has 66 arguments in 4 extents, 42 in one, and on an H100
    # the host's cost of a layer call fell from 574-658 to 477-562 us (BENCHMARKS,
    # host cost). Capped so one extent stays well inside 32-bit element offsets (1M tokens: 2 extents).
    extent_mb_per_device = IN_PLACE_EXTENT_MB

    def __init__(self, attend, split: bool = False, store: str = "kv", replay_hit_rate=None):
        self.attend = attend
        self.split = split  # kv=split: K extents on the device, V extents in the host pool
        self.store = store  # kv | act | auto: per layer, the host pool holds V (or K/V) rows or activations X
        self.stores: tuple = ()  # per layer, decided at prefill (`pool_layouts`)
        # per layer: a device layer (`device_layer`: a sliding-window layer, or every head persistent), decided at
        # prefill (`pool_layouts`)
        self.device_layers: tuple = ()
        self.sliding_layers: tuple = ()  # per layer: a sliding-window layer (a device layer), set with device_layers
        self.store_reasons: tuple = ()
        self.x_row_bytes = 0.0  # one token's X as the host pool stores it
        self.replay_hit_rate = replay_hit_rate  # checked values (a number or one per layer), or None

    def replay_rates(self, cfg) -> np.ndarray | None:
        """[L] the replayed reuse probability per layer, or None (the similarity rule decides)."""
        return replay_rates(self.replay_hit_rate, cfg.num_layers, self.option_error)

    def replay_description(self) -> dict:
        """What describe() says about the cache decision."""
        if self.replay_hit_rate is None:
            return {"cache_decision": "similarity rule"}
        rate = self.replay_hit_rate
        return {"cache_decision": "REPLAYED: each look at a valid cached selection (per request, layer, KV head and "
                                  "step) reuses it with probability replay_hit_rate (a seeded Bernoulli draw on the "
                                  "device); the similarity rule is computed and counted but does not decide",
                "replay_hit_rate": float(rate) if np.ndim(rate) == 0 else [float(x) for x in rate]}

    # -- store=kv|act|auto: which layers keep activations in place of V (or K and V) -----------------
    def persistent_for_stores(self, pipe, model, layout, batch: int, K: int):
        """[L, n_kv] bool: heads that select their whole context (clo's persistent heads; none by default)."""
        return np.zeros((model.config.num_layers, model.config.num_kv_heads), bool)

    def choose_stores(self, pipe, model, layout, batch: int):
        """(stores, reasons) per layer: "kv" or "act". store=auto asks the cost model per layer
        (`plan.split.choose_row_store`: one re-selection's rows as K/V (V) rows or as the X rows of the union
        of the heads' selections plus their recomputation; the union estimated for independent heads, a
        persistent head's being the whole context); store=kv|act as asked, with the cost model's view."""
        from kvoffload.plan.split import choose_row_store, expected_union

        cfg = model.config
        n_kv, L = cfg.num_kv_heads, cfg.num_layers
        K = self.static_budget(layout, batch)
        bound = request_token_bound(layout, batch)
        persistent = self.persistent_for_stores(pipe, model, layout, batch, K)
        forced = self.attend.num_sink + self.attend.num_recent
        # a layer whose every head selects its whole context keeps its K/V blocks on the GPU (`device_layer`), as
        # does a sliding-window layer
        self.device_layers = tuple(bool(p) or s for p, s in zip(persistent.all(1), self.sliding_layers))
        stores, reasons = [], []
        for layer in range(L):
            if self.device_layers[layer]:
                stores.append("kv")
                reasons.append("kv: a sliding-window layer, so its K/V blocks stay on the GPU in the model's dtype and "
                               "it attends its window as `full` does" if cfg.layer_window(layer) is not None else
                               "kv: every head persistent, so the layer's K/V blocks stay on the GPU in the model's "
                               "dtype and it attends them whole, as `full` does")
                continue
            n_p = int(persistent[layer].sum())
            kv_tokens = batch * (n_p * bound + (n_kv - n_p) * K) / n_kv
            x_tokens = batch * (bound if n_p else expected_union(K, bound, n_kv, forced))
            plan = choose_row_store(pipe.cost, pipe.shape(model), k_on_device=self.capabilities.keys_on_device,
                                    kv_tokens=kv_tokens, x_tokens=x_tokens)
            if self.store == "auto":
                stores.append(plan.store), reasons.append(plan.reason)
            else:
                stores.append(self.store)
                reasons.append(f"{self.store}: as asked (store={self.store}); the cost model: {plan.reason}")
        return tuple(stores), tuple(reasons)

    def device_layer(self, pipe, layer) -> bool:
        """A sliding-window layer selects nothing: its K/V blocks stay on the GPU and it attends its window whole,
        with the window mask of `full` (`attend_pool`); so does a layer whose every head is persistent (clo)."""
        return bool(self.device_layers and self.device_layers[layer])

    def pool_layouts(self, pipe, model, dtype, rows, lengths, capacity):
        layouts = super().pool_layouts(pipe, model, dtype, rows, lengths, capacity)
        self.sliding_layers = sliding_layers(model.config)
        if not self.split:  # a device pool: only the sliding layers are device layers (their slots select nothing)
            self.device_layers = self.sliding_layers
            return layouts
        a, z = rows[0]
        self.stores, self.store_reasons = self.choose_stores(pipe, model, layouts[0], z - a)
        self.x_row_bytes = pipe.shape(model).x_host_tok
        if "act" in self.stores:  # activation extents beside K/V ones; each layer keeps its parts (layer_parts)
            layouts = [dataclasses.replace(lay, act_extents=(0, lay.num_extents)) for lay in layouts]
        return layouts

    def layer_parts(self, pipe, layer):
        if not self.stores or "act" not in self.stores:
            return None
        keys = ("k",) if self.capabilities.keys_on_device else ()
        return keys + (("x",) if self.stores[layer] == "act" else ("v",) if keys else ("k", "v"))

    def store_report(self, state=None) -> dict:
        """describe's view of store=kv|act|auto: per layer the choice and why; X rows and bytes read."""
        out = {"store": self.store, "store_per_layer": list(self.stores), "store_reasons": list(self.store_reasons)}
        if state is not None and state.groups and state.groups[0].slots and "act" in self.stores:
            sel = lambda s: getattr(s, "selection", s)  # noqa: E731  (clo's slots hold a SelectionCache)
            rows = [sum(int(np.asarray(sel(gr.slots[i]).x_rows).sum()) for gr in state.groups)
                    for i in range(len(self.stores))]
            out.update(x_rows_fetched=int(sum(rows)), x_bytes_fetched=int(sum(rows) * self.x_row_bytes),
                       x_bytes_fetched_per_layer=[int(r * self.x_row_bytes) for r in rows])
        return out

    @property
    def capabilities(self) -> Capabilities:
        # kv=split reads the selected rows in place (nothing fetched); kv=gpu: a device pool. A subclass says
        # where a host pool's K lives
        return Capabilities(fetches_extents=not self.split)

    def slot_maker(self, pipe, model, layout, batch):
        """A function of no arguments making the slots' arrays (every host-side decision taken before), so
        that `init_slots` runs it and `slot_memory` takes its shapes."""
        raise NotImplementedError

    def slot_specs(self, slot):
        """Where one layer's slots live on a tensor-parallel mesh (PartitionSpecs shaped like slot)."""
        raise NotImplementedError

    def slot_parts(self, slot) -> dict:
        """GPU bytes of one layer's slots by part name (the memory plan's entries)."""
        raise NotImplementedError

    def slot_memory(self, pipe, model, layouts, batch):
        """One device's slot bytes, from their shapes (``jax.eval_shape`` of `slot_maker`'s function: nothing
        allocated; on a mesh each device's share, `slot_specs`), for GPU batches of equal size (the default
        `group_rows`)."""
        b = -(-batch // max(1, len(layouts)))
        out: dict = {}
        for layout in layouts:
            for one in jax.eval_shape(self.slot_maker(pipe, model, layout, b)):
                for k, v in self.slot_parts(device_shapes(one, self.slot_specs(one), pipe.tp)).items():
                    out[k] = out.get(k, 0) + v
        if "act" in self.stores:  # one layer's X rows of the largest union (whole on every device) and their K/V
            cfg = model.config
            p = jnp.dtype(model.params.layers[0].wk.dtype).itemsize
            cap = max(union_tiers(self.static_budget(lay, b), cfg.num_kv_heads, request_token_bound(lay, b))[-1]
                      for lay in layouts)
            kv_tok = S.device_config(cfg, pipe.tp).kv_bytes_per_token
            out["activation-row recompute workspace"] = b * cap * (cfg.hidden_size + kv_tok) * p
        return out

    def plan_group(self, pipe, model, group):
        plan = super().plan_group(pipe, model, group)
        if not self.split:
            return plan
        # every extent as the pool holds it ("dev": the pool's own array, nothing fetched): K in device
        # memory, V in host memory read in place; the cost model then counts no transfer either
        return dataclasses.replace(plan, modes=("dev",) * group.layout.num_extents)

    def static_budget(self, layout, batch: int) -> int:
        """K: the selected tokens per (request, KV head), static for the run (the slots' shape)."""
        a = self.attend
        bound = request_token_bound(layout, batch)
        if a.token_budget is not None:
            k = a.token_budget
        else:  # the ratio of the longest context this layout holds (its tail included)
            k = max(math.ceil(a.token_ratio * (bound + 2 * layout.block_tokens)), a.num_sink + a.num_recent,
                    a.token_min)
        ps = a.page_size
        return max(ps, min(-(-k // ps) * ps, bound))

    def init_slots(self, pipe, model, layout, batch):
        # committed, like a step's outputs (no recompilation); on a mesh split by head (`slot_specs`)
        slots = self.slot_maker(pipe, model, layout, batch)()
        return place_slots(pipe, slots, tuple(self.slot_specs(s) for s in slots))

    def sources(self, pipe, group, plan, layer, fetched):
        if self.split:  # the pool's arrays as they are, as for a device pool (no zero stand-ins: nothing fetched)
            pool = PoolSources(k=group.pool_k[layer], v=group.pool_v[layer], x=group.pool_x[layer],
                               recompute=pipe.scalar(0), prompt_extents=group.layout.prompt_extents)
        else:
            pool = super().sources(pipe, group, plan, layer, fetched)
        return SelectSources(pool=pool, tail_len=group.tail_len,
                             request_blocks=request_token_bound(group.layout, group.size) // group.layout.block_tokens)
