"""`PipelineOptions`: how a run of the layer pipeline places, moves and schedules its work. Each option keeps a
one-line reason; the measurements behind the defaults are in docs/ARCHITECTURE.md "Measured facts"."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvoffload import ops
from kvoffload.device import sharding as S
from kvoffload.errors import KVOffloadError

SCHEDULES = ("row", "column")


EXTENT_MB_PER_DEVICE = 64.0  # the default extent: MiB of K per device of the mesh (PipelineOptions.extent_mb)


class LoopLayersError(KVOffloadError, ValueError):
    """`PipelineOptions.loop_layers` asked of a run it cannot loop (names what to change)."""


@dataclasses.dataclass
class PipelineOptions:
    schedule: str = "row"
    offload_weights: bool = False
    # with offload_weights: the first N layers' weights stay in GPU memory (never moved; the rest stream)
    resident_layers: int = 0
    gpu_batches: int = 1
    block_tokens: int = 64
    # about this many MiB of K (or V) per extent, in the model's dtype (plan_pool). None: EXTENT_MB_PER_DEVICE
    # on each device of the mesh (64 on one, 256 on four): each device then moves copies of one GPU's size.
    # With 64 on four H100s kvpr's X moved as 16 copies of 4 MiB a layer and its host spent ~15 ms a step
    # issuing them; 256 made it 4 copies: 65.5 / 85.5 ms a step against 96.3 (OPT-6.7B b64 P512, 4x H100:
    # BENCHMARKS, tensor parallel). Give a number to plan a mesh's pool like one device's (same blocks, same bits).
    extent_mb: float | None = None
    sync_depth: int = 3
    attention_impl: str = "auto"
    # prefill runs a GPU batch in row chunks whose attention / MLP workspace stays under this
    prefill_workspace_gb: float = 2.0
    # prefill each layer in chunks of this many tokens (None: the whole prompt at once): the workspace
    # is a chunk's (long contexts: a 1M-token Llama-3-8B prompt's MLP intermediate alone is 28 GB), and
    # the prefill waits for each layer's extents to reach the host before the next layer, so one layer's
    # K/V is on the GPU at a time
    prefill_chunk_tokens: int | None = None
    # the chunked prefill's attention (ops.PREFILL_IMPLS): "auto" is cuDNN's flash attention on a GPU for
    # 16-bit models (580 TFLOP/s on an H100 at a 1M-token prompt), else "reference", XLA's online softmax
    # over 1024-key blocks (its fp32 scores go through memory: 93 s per Llama-3-8B layer at 1M tokens on
    # an H200, ~13x cuDNN); "kernel" is the Pallas flash kernel (273 TFLOP/s)
    prefill_attention_impl: str = "auto"
    # XLA's matmuls (cuBLAS) recompute 64-token blocks at 583 TFLOP/s on an H200, the fused Pallas
    # kernel at 412 (profile of 2026-11-26): "reference" is the faster path here
    recompute_impl: str = "reference"
    profile: str | None = None
    trace: str | None = None
    check_memory: bool = True
    host_memory_limit_gb: float | None = None
    gpu_memory_limit_gb: float | None = None
    # how a host pool stores K/V and activation blocks: "native" (the model's dtype) or "int4" (group
    # quantization: packed codes plus a float32 step and min per int4_group_size elements of a head's d
    # (K/V) or of H (X), ~1/4 of bf16's bytes): quantized when a block is written to the host, moved as
    # it is, dequantized on the GPU. GPU-resident blocks and the GPU tails stay in the model's dtype.
    host_dtype: str = "native"
    int4_group_size: int = 64
    # how int4 K is scaled: "token" (groups of int4_group_size along each token's head_dim, like V and X)
    # or "channel" (KIVI: a step and min per channel over each block's block_tokens tokens; keys have outlier
    # channels that per-token groups stretch over the other channels' range; same bytes as token's g64 at blk 64)
    # or "int8" (int8 codes in per-token groups: where single rows are gathered, K at ~2x int4's bytes; per-token
    # int4 K loses accuracy there, per-channel scales come per block) or "native" (K in the model's dtype)
    int4_k_quant: str = "token"
    # tensor parallelism over heads (device/sharding.py): N devices (the first N of jax.devices()), or a
    # jax.sharding.Mesh with a 'model' axis; weights, K/V and the host pool split by head over it
    tensor_parallel: int = 1
    mesh: Any = None
    # decode up to this many consecutive layers in one program where the step issues no transfers (a device
    # pool, or a host pool read in place: clo, tokenselect kv=split; no offloaded weights, no speculative
    # prefetch) and the layers' programs have the same shapes: one host call per group of layers instead of
    # one per layer. Elsewhere 1. Default 1: on an H100 at 128K, 2-8 per program changed no policy's step beyond
    # the run-to-run swing and 32 doubled it (the host's time is per kernel and leaf, not per call, and a
    # layer per call overlaps its host work with the previous layer's GPU work); bit-equal on the CPU, same
    # tokens on a GPU (XLA fuses a multi-layer program differently).
    layers_per_program: int = 1
    # run each GPU batch's longest run of trailing layers with one program's shapes (clo: layers 1..L-1; full:
    # all) as ONE `loop_layers` program, a fori_loop over their state stacked at the end of the prefill: one host
    # call a step for those layers instead of one each (clo at 128K b1 on an H200: 3.4-3.9 ms of host a step and
    # 1.19-1.21x `full`, where the calls took 14-23 ms of host and 1.17-1.65x). Needs a step that moves nothing between layers (as layers_per_program),
    # one device, K/V extents all in one memory (no stored activations); keeps a stacked copy of the
    # looped layers' weights, read by layer index (`models.common.layer_weights`, the stacked-linear kernel; above
    # `ops.FEW_ROWS_MAX` rows other bits than the per-layer calls' XLA matmuls, so compare a looped policy with a
    # looped `full`). GPU memory: one more copy of the looped layers' weights.
    loop_layers: bool = False

    def __post_init__(self):
        from kvoffload.plan.cost import HOST_DTYPES, INT4_K_QUANTS

        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.host_dtype not in HOST_DTYPES:
            raise ValueError(f"host_dtype must be one of {HOST_DTYPES}, got {self.host_dtype!r}")
        self.int4_group_size = int(self.int4_group_size)
        if self.int4_k_quant not in INT4_K_QUANTS:
            raise ValueError(f"int4_k_quant must be one of {INT4_K_QUANTS}, got {self.int4_k_quant!r}")
        if self.int4_group_size < 1:
            raise ValueError(f"int4_group_size must be >= 1, got {self.int4_group_size}")
        self.gpu_batches = int(self.gpu_batches)
        self.resident_layers = int(self.resident_layers)
        if self.resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {self.resident_layers}")
        self.block_tokens = int(self.block_tokens)
        self.sync_depth = int(self.sync_depth)
        self.extent_mb = None if self.extent_mb is None else float(self.extent_mb)
        if isinstance(self.layers_per_program, bool) or int(self.layers_per_program) != self.layers_per_program \
                or self.layers_per_program < 1:
            raise ValueError(f"layers_per_program must be an integer >= 1, got {self.layers_per_program!r}")
        self.layers_per_program = int(self.layers_per_program)
        if not isinstance(self.loop_layers, bool):
            raise ValueError(f"loop_layers must be true or false, got {self.loop_layers!r}")
        if self.gpu_batches < 1:
            raise ValueError(f"gpu_batches must be >= 1, got {self.gpu_batches}")
        if self.block_tokens < 1 or self.block_tokens & (self.block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {self.block_tokens}")
        if self.extent_mb is not None and self.extent_mb <= 0:
            raise ValueError(f"extent_mb must be > 0, got {self.extent_mb}")
        if self.prefill_attention_impl not in ops.PREFILL_IMPLS:
            raise ValueError(f"prefill_attention_impl must be one of {ops.PREFILL_IMPLS}, "
                             f"got {self.prefill_attention_impl!r}")
        if self.prefill_chunk_tokens is not None:
            self.prefill_chunk_tokens = int(self.prefill_chunk_tokens)
            if self.prefill_chunk_tokens < 1:
                raise ValueError(f"prefill_chunk_tokens must be >= 1 or None, got {self.prefill_chunk_tokens}")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise S.TensorParallelError(f"tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}")
