"""The base of every policy that runs on the layer pipeline (offload/pipeline.py): options, prefill,
decode_step and describe, shared; a subclass supplies its hooks and where the pool lives."""

from __future__ import annotations

import dataclasses

from kvoffload.offload.pipeline import LayerHooks, LayerPipeline, PipelineOptions
from kvoffload.policies.base import Policy


class LayeredPolicy(Policy):
    host_pool = True  # the pool in pinned host memory (False: device memory)
    extra_options: tuple = ()  # options the policy's hooks take (beside PipelineOptions)
    host_dtypes: tuple = ("native",)  # the host_dtype values its hooks support (int4: offload, kvpr, hybrid)
    # int4 K scales unless int4_k_quant is given: per channel of each block where whole blocks move (RULER on
    # SmolLM2 at 7K: -4.42 points per token, +1.07 per channel; BENCHMARKS); per token where single rows are
    # gathered (clo, tokenselect: a channel-scaled row would bring its block's scales, 13x its bytes at d 64)
    int4_k_quant_default: str = "channel"

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(sorted({f.name for f in dataclasses.fields(PipelineOptions)} | set(cls.extra_options)))

    def __init__(self, **options):
        known = {f.name for f in dataclasses.fields(PipelineOptions)}
        unknown = sorted(set(options) - known - set(self.extra_options))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for policy {self.name!r}; it takes: "
                             f"{', '.join(sorted(known | set(self.extra_options)))}")
        pipe_opts = {k: v for k, v in options.items() if k in known and v is not None}  # None: the default
        pipe_opts.setdefault("int4_k_quant", self.int4_k_quant_default)
        hook_opts = {k: v for k, v in options.items() if k in self.extra_options}
        self.options = PipelineOptions(**pipe_opts)
        if self.options.host_dtype not in self.host_dtypes:
            raise ValueError(
                f"policy {self.name!r} keeps its block pool in device memory; host_dtype applies to host pools "
                "(use 'offload', 'kvpr' or 'hybrid')" if not self.host_pool else
                f"policy {self.name!r} does not support host_dtype={self.options.host_dtype!r} yet (it supports "
                f"{list(self.host_dtypes)}; int4 host storage runs in 'offload', 'kvpr' and 'hybrid')")
        self.pipeline = LayerPipeline(self.make_hooks(**hook_opts), self.options, host_pool=self.host_pool)

    def make_hooks(self, **hook_options) -> LayerHooks:
        hooks = LayerHooks()
        hooks.name = self.name
        return hooks

    def prefill(self, model, tokens, lengths, capacity):
        return self.pipeline.prefill(model, tokens, lengths, capacity)

    def decode_step(self, model, state, tokens):
        return self.pipeline.decode_step(model, state, tokens)

    def release(self, state, rows):
        """Frees the pool blocks of finished requests."""
        return self.pipeline.release(state, rows)

    def tensor_parallel_summary(self, state=None) -> dict:
        """On a mesh: its size, how activations are split, the collective fit, and what the last step's plan
        costs each device between the devices to recompute (predicted, every layer of the step: the merge of
        partial softmaxes with X split by token, the all-gather of X split along H) (kvpr, hybrid)."""
        pipe = self.pipeline
        tp = {"devices": pipe.tp, "x_split": "token" if pipe.x_by_token else "hidden",
              "collective_fit": pipe.cost.describe_all_gather()}
        if state is not None and state.records:
            rec = state.records[-1]
            tp.update(exchange_bytes_per_step=rec["bytes_gather"], exchange_s_per_step=rec["predicted_gather_s"],
                      predicted_step_s=rec["predicted_s"], recompute_extents=rec["recompute_extents"],
                      recompute_tokens=rec["recompute_tokens"], used_extents=rec["used_extents"])
        return tp

    def describe(self, state=None) -> dict:
        o = self.options
        d = {"policy": self.name, "schedule": o.schedule, "offload_weights": o.offload_weights,
             "gpu_batches": o.gpu_batches, "block_tokens": o.block_tokens, "extent_mb": self.pipeline.extent_mb,
             "pool": "pinned host" if self.host_pool else "device", "host_memory": self.pipeline.host_note,
             "host_dtype": o.host_dtype if self.host_pool else "native",
             "cost_model": self.pipeline.cost.source,
             "layers_per_program": self.pipeline.layers_per_program(), "loop_layers": o.loop_layers}
        if self.pipeline.memory_plan is not None:
            d["memory_plan"] = self.pipeline.memory_plan.describe()
        if state is not None:
            lay = state.groups[0].layout
            d["layout"] = {"extent_blocks": lay.extent_blocks, "num_extents": lay.num_extents,
                           "kv_extents": lay.kv_extents, "act_extents": lay.act_extents}
            if any(self.pipeline.sliding_layers):  # what each kind of layer keeps where
                d["layer_kinds"] = self.pipeline.layer_kinds(state, self.pipeline.window)
            stk = state.groups[0].stack
            if stk is not None:  # layers [first, L) run as one program a step
                d["looped_layers"] = [stk.first, stk.first + stk.layers]
            if state.records:
                d["last_step"] = dict(state.records[-1])
        return d
