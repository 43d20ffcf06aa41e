"""`kvpr`: KVPR. The pool keeps activation blocks X (the attention input) beside K/V blocks. For layer
i+1, the activation extents [0, r) and the K/V extents [r, n) are fetched while layer i computes; K/V of
extents [0, r) are recomputed on the GPU through the model family's `recompute_kv` and attention runs
over every extent in order, merged exactly. The scheduler picks r each step from the cost model
(plan/cost.py: transfer of layer i+1 against compute of layer i), or a forced split point fixes it.
Tensor-parallel runs split X by token: each device recomputes every head's K/V of its tokens and the
devices exchange partial softmaxes (`pipeline.attend_act_by_token`); the scheduler prices one device
(its heads' K/V, 1/N of X over its link, that exchange: plan/split.py), and `describe` reports it per step.

Stores: ``both`` (X and K/V of every block: r can move every step; twice the host memory) or ``split``
(X of the extents below the split chosen at prefill, K/V above it: KVPR's memory saving, r fixed).
With GQA, when an activation is at least as large as its K/V, recomputing can only add PCIe bytes: the
scheduler stores no activations and runs as `offload`, and says why.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvoffload.runtime.cost import attended_tokens, extent_work
from kvoffload.runtime.hooks import GroupPlan, LayerHooks
from kvoffload.policies.base import register_policy
from kvoffload.policies.layered import LayeredPolicy
from kvoffload.policies.options import Option

STORES = ("both", "split")


class KVPRHooks(LayerHooks):
    name = "kvpr"
    kinds = ("kv", "act")
    x_split = "token"  # on a mesh each device recomputes every head of its tokens (no all-gather of X)

    def __init__(self, split_point=None, kvpr_store="both"):
        if kvpr_store not in STORES:
            raise ValueError(f"kvpr_store must be one of {STORES}, got {kvpr_store!r}")
        if split_point is not None and int(split_point) < 0:
            raise ValueError(f"split_point must be >= 0 or None, got {split_point}")
        self.split_point = None if split_point is None else int(split_point)
        self.store = kvpr_store
        self._cache: dict = {}

    def recomputes(self, pipe, model) -> bool:
        return self.split_point is not None or not self.gqa_reason(pipe, model)

    def gqa_reason(self, pipe, model):
        from kvoffload.plan.split import no_recompute_reason

        return None if self.split_point is not None else no_recompute_reason(pipe.shape(model))

    # -- where X and K/V are stored ------------------------------------------------------------
    def split_store(self, pipe, model, layout, lengths):
        n = layout.num_extents
        if self.gqa_reason(pipe, model):
            return dataclasses.replace(layout, kv_extents=(0, n), act_extents=(0, 0))
        if self.store == "both":
            return dataclasses.replace(layout, kv_extents=(0, n), act_extents=(0, n))
        # split: X below e0, K/V from e0 on; e0 from the scheduler at the prompt's length (or forced)
        from kvoffload.runtime.pool import BlockAllocator, allocate_prompts

        alloc = BlockAllocator(layout.num_blocks, len(lengths), layout.block_tokens)
        allocate_prompts(alloc, lengths)
        used = alloc.used_extents(layout)
        if self.split_point is not None:
            e0 = self._forced_from_alloc(alloc, layout, used)
        else:
            e0, _ = self._best(pipe, model, len(lengths), used, layout, int(np.asarray(lengths).sum()), range(0, used + 1))
        return dataclasses.replace(layout, kv_extents=(e0, n), act_extents=(0, e0))

    def _forced_from_alloc(self, alloc, layout, used) -> int:
        """Extents whose blocks all end at or before the forced split point."""
        end = np.where(alloc.owner >= 0, alloc.first_pos + alloc.block_tokens, 0)
        e = 0
        while e < used and end[layout.start(e):layout.start(e) + layout.size(e)].max(initial=0) <= self.split_point:
            e += 1
        return e

    # -- per step ----------------------------------------------------------------------------
    def plan_group(self, pipe, model, gr):
        n = gr.used_extents
        lay = gr.layout
        reason = self.gqa_reason(pipe, model)
        if reason:
            return GroupPlan(used_extents=n, recompute_extents=0, note=reason)
        # candidates: extents [0, r) all hold X and [r, n) all hold K/V
        lo = 0 if lay.kv_extents[0] == 0 else min(lay.kv_extents[0], n)
        hi = min(lay.act_extents[1], n)
        cands = range(lo, max(lo, hi) + 1) if self.store == "both" else range(min(lay.kv_extents[0], n), min(lay.kv_extents[0], n) + 1)
        if self.split_point is not None:
            r = min(max(self._forced_from_alloc(gr.alloc, lay, n), cands[0]), cands[-1])
            return GroupPlan(used_extents=n, recompute_extents=r,
                             note=f"forced split point {self.split_point}: recompute {r} of {n} extents")
        tokens = attended_tokens(gr)
        key = (n, tuple(cands), gr.size, tokens // (lay.block_tokens * gr.size), lay)
        if key not in self._cache:
            self._cache[key] = self._best(pipe, model, gr.size, n, lay, tokens, cands)
        r, note = self._cache[key]
        return GroupPlan(used_extents=n, recompute_extents=r, note=note)

    def _best(self, pipe, model, batch, used, layout, tokens, cands):
        """(r, reason): the recompute extent count in cands that the scheduler (plan/split.py) picks."""
        from kvoffload.plan.split import choose_split

        sh = pipe.shape(model)
        g = pipe.opts.gpu_batches if pipe.opts.schedule == "column" else 1
        plan = choose_split(pipe.cost, sh, lambda r: [extent_work(sh, layout, batch, used, r, tokens)] * g, list(cands),
                            offload_weights=pipe.opts.offload_weights)
        return plan.r, plan.reason


@register_policy("kvpr")
class KVPRPolicy(LayeredPolicy):
    host_pool = True
    host_dtypes = ("native", "int4")
    hook_options = (
        Option("split_point", "int", "force the recompute split point (extents recomputed); none: the scheduler's",
               low=0),
        Option("kvpr_store", "choice", "both: K/V and X on the host; split: X below the split, K/V above",
               choices=STORES),
    )

    def make_hooks(self, split_point=None, kvpr_store="both"):
        return KVPRHooks(split_point=split_point, kvpr_store=kvpr_store or "both")

    def describe(self, state=None) -> dict:
        """As every layered policy's; under tensor parallelism also the all-gather of the recomputed X that
        the last step's split costs each device (predicted, every layer of the step)."""
        d = super().describe(state)
        if self.pipeline.tp > 1:
            d["tensor_parallel"] = self.tensor_parallel_summary(state)
        return d
