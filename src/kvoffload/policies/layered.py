"""The base of every policy that runs on the layer pipeline (runtime/pipeline.py): options, prefill,
decode_step and describe, shared; a subclass supplies its hooks and where the pool lives."""

from __future__ import annotations

import dataclasses
import inspect

from kvoffload import ops
from kvoffload.errors import warn_accuracy
from kvoffload.runtime.hooks import LayerHooks
from kvoffload.runtime.options import SCHEDULES, PipelineOptions
from kvoffload.runtime.pipeline import LayerPipeline
from kvoffload.paths import check_output_file
from kvoffload.plan.cost import HOST_DTYPES, INT4_K_QUANTS
from kvoffload.policies.base import Policy
from kvoffload.policies.options import Option, PolicyOptionError, parse_options

# The options every pipeline policy takes: one per field of PipelineOptions (the field holds the default).
PIPELINE_OPTIONS = (
    Option("schedule", "choice", "row: one GPU batch a step; column: gpu_batches GPU batches per layer",
           choices=SCHEDULES),
    Option("offload_weights", "bool", "stream the weights layer by layer from host memory"),
    Option("resident_layers", "int", "with offload_weights: the first N layers' weights stay on the GPU", low=0),
    Option("gpu_batches", "int", "column schedule: GPU batches per decode step", low=1),
    Option("block_tokens", "int", "tokens per pool block (a power of two)", low=1),
    Option("extent_mb", "float", "MiB of K (or V) per extent; none: a per-device default", low=0, low_open=True),
    Option("sync_depth", "int", "pipeline items issued ahead of the one computing (0: synchronous)", low=0),
    Option("attention_impl", "choice", "decode attention: Pallas kernel, XLA reference, or auto", choices=ops.IMPLS),
    Option("prefill_workspace_gb", "float", "prefill row chunks keep their workspace under this many GB", low=0,
           low_open=True),
    Option("prefill_chunk_tokens", "int", "prefill each layer in chunks of this many tokens; none: whole prompt",
           low=1),
    Option("prefill_attention_impl", "choice", "chunked prefill attention", choices=ops.PREFILL_IMPLS),
    Option("recompute_impl", "choice", "K/V recomputation from X: kernel, XLA reference, or auto",
           choices=ops.IMPLS),
    Option("profile", "path", "a JSON machine profile written by `kvoffload profile`"),
    Option("trace", "path", "write a per-step trace (JSON) to this file"),
    Option("check_memory", "bool", "refuse a plan that does not fit host or GPU memory"),
    Option("host_memory_limit_gb", "float", "host memory the plan may use; none: what the machine has", low=0,
           low_open=True),
    Option("gpu_memory_limit_gb", "float", "GPU memory the plan may use; none: what the device has", low=0,
           low_open=True),
    Option("host_dtype", "choice", "how the host pool stores K/V and activations", choices=HOST_DTYPES),
    Option("int4_group_size", "int", "int4: elements per quantization group", low=1),
    Option("int4_k_quant", "choice", "int4: how K is scaled (token, channel, int8 codes, native dtype)",
           choices=INT4_K_QUANTS),
    Option("tensor_parallel", "int", "split heads, weights and the host pool over the first N devices", low=1),
    Option("mesh", "object", "a jax.sharding.Mesh with a 'model' axis (in place of tensor_parallel)"),
)


class LayeredPolicy(Policy):
    host_pool = True  # the pool in pinned host memory (False: device memory)
    # the options the policy's hooks take (beside PIPELINE_OPTIONS); their defaults are make_hooks'
    hook_options: tuple[Option, ...] = ()
    defaults: dict = {}  # pipeline options whose default differs for this policy (hybrid: offload_weights)
    streams_weights = True  # False: the policy keeps the weights on the device and refuses offload_weights
    option_error = PolicyOptionError  # the class its option errors have (clo, tokenselect: their own subclass)
    host_dtypes: tuple = ("native",)  # the host_dtype values its hooks support (int4: offload, kvpr, hybrid)
    # int4 K scales unless int4_k_quant is given: per channel of each block where whole blocks move (RULER on
    # SmolLM2 at 7K: -4.42 points per token, +1.07 per channel; BENCHMARKS); per token where single rows are
    # gathered (clo, tokenselect: a channel-scaled row would bring its block's scales, 13x its bytes at d 64)
    int4_k_quant_default: str = "channel"

    @classmethod
    def option_schema(cls) -> dict[str, Option]:
        """name -> Option (with its default) of every option this policy takes: the pipeline's, then its hooks'."""
        fields = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
        defaults = {**fields, "int4_k_quant": cls.int4_k_quant_default, **cls.defaults}
        sig = inspect.signature(cls.make_hooks).parameters
        defaults.update({k: p.default for k, p in sig.items() if p.default is not inspect.Parameter.empty})
        schema = {o.name: o for o in PIPELINE_OPTIONS + cls.hook_options}
        missing = set(fields) - set(schema)
        assert not missing, f"PipelineOptions fields without an Option: {missing}"
        return {k: dataclasses.replace(o, default=defaults.get(k)) for k, o in sorted(schema.items())}

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(cls.option_schema())

    def __init__(self, **options):
        options = {**self.defaults, **parse_options(self.name, self.option_schema(), options, error=self.option_error)}
        if options.get("offload_weights") and not self.streams_weights:
            raise self.option_error(f"policy {self.name!r} keeps the weights on the device; offload_weights is not "
                                    "supported (use 'offload' or 'kvpr' to stream weights)", "offload_weights")
        known = {f.name for f in dataclasses.fields(PipelineOptions)}
        pipe_opts = {k: v for k, v in options.items() if k in known and v is not None}  # None: the default
        pipe_opts.setdefault("int4_k_quant", self.int4_k_quant_default)
        hook_opts = {k: v for k, v in options.items() if k not in known}
        if pipe_opts.get("trace"):  # written after the run: a path that cannot be written fails now, not then
            check_output_file(pipe_opts["trace"], "trace", error=self.option_error)
        self.options = PipelineOptions(**pipe_opts)
        if self.options.host_dtype not in self.host_dtypes:
            raise ValueError(
                f"policy {self.name!r} keeps its block pool in device memory; host_dtype applies to host pools "
                "(use 'offload', 'kvpr' or 'hybrid')" if not self.host_pool else
                f"policy {self.name!r} does not support host_dtype={self.options.host_dtype!r} yet (it supports "
                f"{list(self.host_dtypes)}; int4 host storage runs in 'offload', 'kvpr' and 'hybrid')")
        if self.options.host_dtype == "int4":
            warn_accuracy("host_dtype=int4 is not accepted on held-out RULER data: it lost about 2 points against "
                          "`full` in a held-out check, and the development runs cannot separate its variants "
                          "(BENCHMARKS.md, Quest's budget floor); measure it on your task (docs/EVALUATION.md)")
        self.pipeline = LayerPipeline(self.make_hooks(**hook_opts), self.options, host_pool=self.host_pool)

    def make_hooks(self, **hook_options) -> LayerHooks:
        hooks = LayerHooks()
        hooks.name = self.name
        return hooks

    def prefill(self, model, tokens, lengths, capacity):
        return self.pipeline.prefill(model, tokens, lengths, capacity)

    def decode_step(self, model, state, tokens):
        self.check_step_tokens(model, tokens)
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
             "cost_model": self.pipeline.cost.source}
        if self.pipeline.memory_plan is not None:
            d["memory_plan"] = self.pipeline.memory_plan.describe()
        if state is not None:
            lay = state.groups[0].layout
            d["layout"] = {"extent_blocks": lay.extent_blocks, "num_extents": lay.num_extents,
                           "kv_extents": lay.kv_extents, "act_extents": lay.act_extents}
            if any(self.pipeline.sliding_layers):  # what each kind of layer keeps where
                d["layer_kinds"] = self.pipeline.layer_kinds(state, self.pipeline.window)
            if state.records:
                d["last_step"] = dict(state.records[-1])
        return d
