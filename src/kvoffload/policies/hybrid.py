"""`hybrid`: HybridServe. Weights and context live in host memory; part of every request's context is
stored as KV blocks (fetched) and part as ACT blocks (activations X, fetched and turned back into K/V
on the GPU while the next transfers run), and some ACT blocks stay on the GPU when its memory allows
(recomputed every step, never moved).

* Host block allocation (plan/hybrid.py `algorithm1`, the paper's Algorithm 1): how many KV and ACT
  blocks the host memory budget holds so that PCIe time (weights + blocks) and GPU time (recompute +
  attention + MLP) balance; ``act_share`` forces the host ACT:KV split (0: KV-only, 1: ACT-only).
* Per-request block classes at extent granularity: the pool is `full`'s own extents, each tagged with
  one class (plan/hybrid.py `hybrid_layouts`), so every block lands where `full`'s allocator puts it;
  the tags keep every request's blocks near the global shares as its context grows, prompt and
  generated tokens alike: within W / 2 blocks for one request and two classes, 2 W in general (W: the
  most blocks one request has in one extent; `hybrid_layouts`).
* Mini-batches (`pack_mini_batches`): requests are packed greedily into mini-batches that fit the GPU
  transfer buffer (#KV_max, #ACT_max) without raising F_b = max(balance, 1/balance); the mini-batches
  are the pipeline's GPU batches, run in the column (zig-zag) schedule so each layer's weights cross
  PCIe once per step. They are formed at prefill from every request's blocks at the end of the
  generation, per class its share of them (the whole-extent counts depend on the mini-batches' layouts;
  the engine decodes a fixed batch in lockstep, so per-step packing would find the same bins; each
  step's record reports every mini-batch's real blocks and balance, `used_blocks` the layouts' totals).
* Attention: each extent of the mini-batch's pool in order -- ACT extents recomputed
  (`recompute_extent`), KV extents as fetched, GPU-resident ones in place -- folded into one
  accumulator: the same partial sums over the same blocks in the same order as `full` with the same
  GPU batches, so at any split the logits are `full`'s (bit for bit in fp32 where recomputing an
  extent's K/V rounds as the prefill's projection did: MHA on XLA CPU, the real models' shapes).
* Tensor parallelism (tensor_parallel=N): the shared pipeline's mesh runtime (K/V extents split by KV head,
  ACT extents by token: each device regenerates every head of its tokens, `attend_act_by_token`; weight
  shards streamed); the plan prices one device (`BlockRates.of` on the pipeline's per-device shape) within
  its share of the budgets.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvoffload.runtime.hooks import GroupPlan, LayerHooks
from kvoffload.plan.hybrid import (
    BlockAllocation,
    BlockRates,
    algorithm1,
    balance_batch,
    balance_factor,
    buffer_capacities,
    hybrid_layouts,
    pack_mini_batches,
    request_blocks,
)
from kvoffload.plan.memory import weight_bytes_per_device
from kvoffload.policies.base import register_policy
from kvoffload.policies.layered import LayeredPolicy
from kvoffload.policies.options import Option

GB = 1e9
# "balance": this batch's blocks split to minimise the predicted step (plan/hybrid.py balance_batch);
# "algorithm1": the host ratio of the paper's Algorithm 1 for the host budget, applied to the batch
ALLOCATIONS = ("balance", "algorithm1")


@dataclasses.dataclass
class HybridPlan:
    """What the policy decided at prefill (reported by describe())."""

    allocation: BlockAllocation  # Algorithm 1 for the host budget (capacity)
    used: dict  # blocks of each class this batch holds at the end of the generation
    classes: tuple
    rows: list  # mini-batches
    kv_max: float
    act_max: float
    host_budget_bytes: float  # one device's (under tensor parallelism: its share, `sharding.device_budgets`)
    gpu_budget_bytes: float
    max_requests: int  # requests of this batch's mean length the host budget holds at this allocation
    rates: BlockRates
    layouts: list  # the mini-batches' classed pool layouts

    def to_json(self) -> dict:
        return {"allocation": self.allocation.to_json(), "used_blocks": self.used,
                "classes": [dataclasses.asdict(c) for c in self.classes], "mini_batches": self.rows,
                "kv_max": self.kv_max, "act_max": self.act_max, "host_budget_gb": self.host_budget_bytes / GB,
                "gpu_budget_gb": self.gpu_budget_bytes / GB, "max_requests": self.max_requests,
                "block_rates": self.rates.to_json()}


class HybridHooks(LayerHooks):
    name = "hybrid"
    kinds = ("kv", "act")
    x_split = "token"  # on a mesh each device recomputes every head of its ACT blocks' tokens

    def __init__(self, act_share=None, gpu_blocks="auto", mini_batch_gb=0.5, host_budget_gb=None, allocation="balance"):
        if act_share is not None and not 0.0 <= float(act_share) <= 1.0:
            raise ValueError(f"act_share must be in [0, 1] (0: KV-only, 1: ACT-only) or None, got {act_share}")
        if gpu_blocks != "auto" and int(gpu_blocks) < 0:
            raise ValueError(f"gpu_blocks must be 'auto' or >= 0, got {gpu_blocks!r}")
        if float(mini_batch_gb) <= 0:
            raise ValueError(f"mini_batch_gb must be > 0, got {mini_batch_gb}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        self.allocation = allocation
        self.act_share = None if act_share is None else float(act_share)
        self.gpu_blocks = gpu_blocks if gpu_blocks == "auto" else int(gpu_blocks)
        self.mini_batch_gb = float(mini_batch_gb)
        self.host_budget_gb = None if host_budget_gb is None else float(host_budget_gb)
        self.plan: HybridPlan | None = None
        self._info: dict = {}

    # -- budgets -----------------------------------------------------------------------------
    def _budgets(self, pipe, model, dtype):
        """(host, GPU) bytes one device's blocks may use: the machine's host memory (less the streamed
        weights) split over its devices, and one device's GPU memory (`sharding.device_budgets`; the
        budgets as given on one device)."""
        from kvoffload.device import memory as M
        from kvoffload.device import sharding as S

        o = pipe.opts
        # the weight shards of every device this process drives (replicated fields once per device)
        wb = weight_bytes_per_device(model.config, dtype, model.params, pipe.tp, pipe.replicate_kv(model))
        shards = S.local_size(pipe.mesh)
        if self.host_budget_gb is not None:
            host = self.host_budget_gb * GB
        elif o.host_memory_limit_gb is not None:
            host = o.host_memory_limit_gb * GB
        else:
            avail = M.available_host_bytes() or 0
            cap = M.host_pool_cap_bytes(pipe.dev.platform) if pipe.host_kind == "pinned_host" else None
            weights = (model.config.num_layers * wb.per_layer * shards
                       if o.offload_weights and not M.on_host(model.params.layers) else 0)
            host = max(0.0, (min(avail, cap) if cap else avail) * 0.9 - weights)
        gpu = (o.gpu_memory_limit_gb * GB if o.gpu_memory_limit_gb is not None
               else (M.available_device_bytes(pipe.dev) or 0) * 0.9)
        return S.device_budgets(host, gpu, pipe.mesh, pipe.dev.platform)

    # -- prefill: allocation, mini-batches, layouts -------------------------------------------
    def group_rows(self, pipe, model, lengths, capacity, t_pad=None):
        self.plan = self._plan(pipe, model, model.params.layers[0].wk.dtype, lengths, capacity, t_pad)
        return self.plan.rows

    def pool_layouts(self, pipe, model, dtype, rows, lengths, capacity):
        if self.plan is None or self.plan.rows != list(rows):
            self.plan = self._plan(pipe, model, dtype, lengths, capacity)
        return list(self.plan.layouts)

    def _layouts(self, pipe, model, dtype, classes, rows, lengths, capacity):
        return hybrid_layouts(model.config, dtype, [lengths[a:z] for a, z in rows], capacity, classes,
                              block_tokens=pipe.opts.block_tokens, extent_mb=pipe.extent_mb)

    def _plan(self, pipe, model, dtype, lengths, capacity, t_pad=None) -> HybridPlan:
        cfg, o = model.config, pipe.opts
        blk, L = o.block_tokens, cfg.num_layers
        lengths = np.asarray(lengths, np.int64)
        flushes = max(0, int(capacity) - int(lengths.max())) // blk
        n_blocks = lengths // blk + flushes  # each request's blocks at the end of the generation
        rates = BlockRates.of(pipe.cost, pipe.shape(model), blk, offload_weights=o.offload_weights,
                              batch=len(lengths), weight_share=1 - pipe.resident(model) / L)
        host_bytes, gpu_bytes = self._budgets(pipe, model, dtype)

        total = int(n_blocks.sum())

        def plan_for(gpu_blocks, gpu_kind):
            alloc = algorithm1(rates, host_bytes, L, gpu_blocks, gpu_kind, act_share=self.act_share)
            if self.allocation == "balance" or self.act_share is not None:
                planned = balance_batch(rates, total, L, host_bytes, gpu_blocks, gpu_kind, act_share=self.act_share)
            else:  # Algorithm 1's host ratio for this batch, GPU-resident blocks first
                g = min(gpu_blocks, total)
                a = int(round((total - g) * alloc.act_share_host))
                planned = BlockAllocation(kv_host=total - g - a, act_host=a, gpu=g, gpu_kind=gpu_kind, reason=alloc.reason)
            classes = planned.classes()
            # packed on each request's expected blocks per class (its share of them): the layouts, and so
            # the whole-extent counts, depend on the packing
            per_req = n_blocks[:, None] * np.asarray([c.share for c in classes])[None, :]
            kv_h, act_h, act_all = class_columns(classes, per_req)
            kv_max, act_max = buffer_capacities(rates, self.mini_batch_gb * GB, planned.act_share_host)
            rows = pack_mini_batches(kv_h, act_h, act_all, kv_max, act_max, rates)
            layouts = self._layouts(pipe, model, dtype, classes, rows, lengths, capacity)
            have = request_blocks(layouts, [lengths[a:z] for a, z in rows], flushes)
            kv_h, act_h, act_all = class_columns(classes, have)
            g_have = int(have.sum()) - int(kv_h.sum()) - int(act_h.sum())
            used = BlockAllocation(kv_host=int(kv_h.sum()), act_host=int(act_h.sum()), gpu=g_have, gpu_kind=gpu_kind,
                                   reason=f"{planned.reason}; in whole extents: {int(act_h.sum())} host ACT, "
                                          f"{int(kv_h.sum())} host KV, {g_have} GPU-resident")
            return alloc, used, classes, rows, kv_max, act_max, layouts

        gpu_kind = ("act" if (self.act_share is None and rates.act_gpu_bytes < rates.kv_gpu_bytes) or (self.act_share or 0) > 0
                    else "kv")
        g_blocks = 0 if self.gpu_blocks == "auto" else self.gpu_blocks
        alloc, used, classes, rows, kv_max, act_max, lays = plan_for(g_blocks, gpu_kind)
        if self.gpu_blocks == "auto" and pipe.host_pool:
            # what the GPU holds besides resident blocks (weights in flight, transfer buffers, tails,
            # workspace) at this packing; the rest of the budget holds blocks
            t_pad = t_pad or -(-int(lengths.max()) // blk) * blk
            other = pipe.memory_of(model, lays, lengths, t_pad, capacity).gpu_bytes
            per_block = L * (rates.act_gpu_bytes if gpu_kind == "act" else rates.kv_gpu_bytes)  # native on the GPU
            g_cap = max(0, int((gpu_bytes - other) // per_block))
            g_blocks = g_cap
            for attempt in range(12):  # whole extents round the share: hold the real count to the cap
                if not g_blocks:
                    break
                alloc, used, classes, rows, kv_max, act_max, lays = plan_for(g_blocks, gpu_kind)
                if used.gpu <= g_cap:
                    break
                # step down by the excess; when the rounding keeps overshooting, by 10% more each time
                g_blocks = max(0, g_blocks - (used.gpu - g_cap) if attempt < 3 else min(g_blocks - (used.gpu - g_cap),
                                                                                      int(g_blocks * 0.9)))
            else:
                g_blocks = 0
            if not g_blocks:
                alloc, used, classes, rows, kv_max, act_max, lays = plan_for(0, gpu_kind)
        per_req_bytes = float(np.mean(n_blocks)) * L * (
            alloc.act_share_host * rates.act_bytes + (1 - alloc.act_share_host) * rates.kv_bytes)
        # (max_requests: at Algorithm 1's allocation for the host budget)
        max_req = int((host_bytes // per_req_bytes) if per_req_bytes else 0) + int(alloc.gpu // max(1, np.mean(n_blocks)))
        return HybridPlan(allocation=alloc, used={"kv_host": used.kv_host, "act_host": used.act_host,
                                                  "gpu": used.gpu, "gpu_kind": used.gpu_kind, "reason": used.reason,
                                                  "predicted_layer_s": used.predicted_layer_s(rates)},
                          classes=classes, rows=rows, kv_max=kv_max, act_max=act_max, host_budget_bytes=host_bytes,
                          gpu_budget_bytes=gpu_bytes, max_requests=max_req, rates=rates, layouts=lays)

    # -- per step ----------------------------------------------------------------------------
    def plan_group(self, pipe, model, gr):
        lay = gr.layout
        key = (gr.rows, lay, int(gr.alloc.num_free))
        if key not in self._info:
            in_use = gr.alloc.blocks_in_use(lay)
            modes, counts = [], {"kv_host": 0, "act_host": 0, "act_gpu": 0, "kv_gpu": 0}
            for e in range(lay.num_extents):
                kind = "kv" if lay.has("kv", e) else "act"
                if lay.on_device(e):
                    modes.append("dev")
                    counts[f"{kind}_gpu"] += int(in_use[e])
                elif in_use[e]:
                    modes.append("kv" if kind == "kv" else "x")
                    counts[f"{kind}_host"] += int(in_use[e])
                else:
                    modes.append("skip")
            rates = self.plan.rates if self.plan is not None else None
            info = {"rows": list(gr.rows), **counts}
            if rates is not None:
                info["balance_F"] = balance_factor(rates, counts["kv_host"], counts["act_host"],
                                                   counts["act_host"] + counts["act_gpu"])
            self._info[key] = (tuple(modes), info)
        modes, info = self._info[key]
        return GroupPlan(used_extents=gr.used_extents, modes=modes, groups_info=info,
                         note=self.plan.allocation.reason if self.plan is not None else "")


def class_columns(classes, per_req):
    """Per request: host KV, host ACT and all ACT (host and GPU-resident) blocks, from [B, classes] counts."""
    col = {(c.kind, c.device): per_req[:, i] for i, c in enumerate(classes)}
    zero = np.zeros(len(per_req), per_req.dtype)
    act_h = col.get(("act", False), zero)
    return col.get(("kv", False), zero), act_h, act_h + col.get(("act", True), zero)


@register_policy("hybrid")
class HybridPolicy(LayeredPolicy):
    host_pool = True
    hook_options = (
        Option("act_share", "float", "share of blocks stored as activations (0: KV only, 1: ACT only); "
               "none: the planner's", low=0, high=1),
        Option("gpu_blocks", "int", "GPU-resident activation blocks per layer; auto: what GPU memory holds",
               low=0, words=("auto",)),
        Option("mini_batch_gb", "float", "GPU workspace per mini-batch, GB", low=0, low_open=True),
        Option("host_budget_gb", "float", "host memory for the blocks, GB; none: the machine's", low=0,
               low_open=True),
        Option("allocation", "choice", "how block shares are chosen: balanced split or the paper's Algorithm 1",
               choices=ALLOCATIONS),
    )
    # HybridServe offloads the weights too and switches mini-batches at layer granularity
    defaults = {"offload_weights": True, "schedule": "column"}
    host_dtypes = ("native", "int4")  # int4: host KV and ACT blocks quantized, GPU-resident blocks native

    def make_hooks(self, act_share=None, gpu_blocks="auto", mini_batch_gb=0.5, host_budget_gb=None,
                   allocation="balance"):
        return HybridHooks(act_share=act_share, gpu_blocks=gpu_blocks, mini_batch_gb=mini_batch_gb,
                           host_budget_gb=host_budget_gb, allocation=allocation)

    def describe(self, state=None) -> dict:
        d = super().describe(state)
        plan = self.pipeline.hooks.plan
        if plan is not None:
            d["hybrid"] = plan.to_json()
        if self.pipeline.tp > 1:
            d["tensor_parallel"] = self.tensor_parallel_summary(state)
        return d
