"""`offload`: the whole KV cache in pinned host memory; layer i+1's K/V fetched while layer i computes
(the FlexGen / HF-offload baseline, done well). Shares the runtime of `kvpr` (offload/runtime.py)."""

from __future__ import annotations

import dataclasses

from kvoffload.offload.runtime import OffloadRuntime, RuntimeOptions
from kvoffload.policies.base import Policy, register_policy


_MAIN = {"schedule", "offload_weights", "split_point", "gpu_batches", "profile", "trace"}


class _OffloadBase(Policy):
    kvpr = False

    def __init__(self, schedule: str = "row", offload_weights: bool = False, split_point: int | None = None,
                 gpu_batches: int = 1, profile: str | None = None, trace: str | None = None, **extra):
        """schedule 'row' | 'column'; offload_weights: stream weights layer by layer from host memory;
        split_point: forced KVPR split l in host slots (None: the scheduler; ignored by `offload`);
        gpu_batches: GPU batches the batch is cut into (column schedule); profile: a JSON profile from
        `kvoffload profile` (default: built-in rough numbers); trace: write a per-step trace JSON here.
        Advanced (keyword): flush_block, split_bucket, sync_depth, objective ('pipelined' | 'row' |
        'column'), check_memory, host_memory_limit_gb, gpu_memory_limit_gb."""
        if split_point is not None and not self.kvpr and int(split_point) != 0:
            raise ValueError("policy 'offload' fetches all K/V (split point 0); use policy 'kvpr' for split points")
        known = {f.name for f in dataclasses.fields(RuntimeOptions)} - {"kvpr"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for policy {self.name!r}; known: schedule, offload_weights, "
                             f"split_point, gpu_batches, profile, trace, {', '.join(sorted(known - _MAIN))}")
        extra = {k: v for k, v in extra.items() if v is not None}  # None: the default
        self.options = RuntimeOptions(kvpr=self.kvpr, schedule=schedule or "row", offload_weights=bool(offload_weights),
                                      split_point=None if split_point is None else int(split_point),
                                      gpu_batches=int(gpu_batches or 1), profile=profile, trace=trace, **extra)
        self.runtime = OffloadRuntime(self.options)

    def prefill(self, model, tokens, lengths, capacity):
        return self.runtime.prefill(model, tokens, lengths, capacity)

    def decode_step(self, model, state, tokens):
        return self.runtime.decode_step(model, state, tokens)

    def describe(self) -> dict:
        o = self.options
        d = {"policy": self.name, "schedule": o.schedule, "offload_weights": o.offload_weights,
             "gpu_batches": o.gpu_batches, "host_memory": self.runtime.host_note,
             "cost_model": self.runtime.cost.source}
        if self.runtime.memory_plan is not None:
            d["memory_plan"] = self.runtime.memory_plan.describe()
        if self.runtime.last_plan is not None:
            d["last_step"] = dict(self.runtime.last_plan)
        return d


@register_policy("offload")
class OffloadPolicy(_OffloadBase):
    kvpr = False
