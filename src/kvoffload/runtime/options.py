"""`PipelineOptions`: how a run of the layer pipeline places, moves and schedules its work. Each option keeps a
one-line reason; the measurements behind the defaults are in docs/ARCHITECTURE.md "Facts measured on the GPU"."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvoffload import ops
from kvoffload.device import sharding as S

SCHEDULES = ("row", "column")


EXTENT_MB_PER_DEVICE = 64.0  # the default extent: MiB of K per device of the mesh (PipelineOptions.extent_mb)


@dataclasses.dataclass
class PipelineOptions:
    """How one run of the layer pipeline places, moves and schedules its work (validated here)."""

    # "row": each GPU batch through every layer; "column": every GPU batch through a layer first (weights once)
    schedule: str = "row"
    # stream each layer's weights from host memory (W_K / W_V first): for models larger than the GPU
    offload_weights: bool = False
    # with offload_weights: the first N layers' weights stay in GPU memory (never moved; the rest stream)
    resident_layers: int = 0
    # GPU batches a batch is split into: one batch's transfers overlap another's compute
    gpu_batches: int = 1
    # tokens per pool block (a power of two): the unit of allocation, flush and attention
    block_tokens: int = 64
    # MiB of K (or V) per extent, the unit a fetch moves (None: EXTENT_MB_PER_DEVICE on each device of the mesh,
    # so each device moves copies of one GPU's size; a number plans a mesh's pool like one device's, same bits)
    extent_mb: float | None = None
    # items whose transfers run ahead of the programs (at most sync_depth + 1 items' buffers alive)
    sync_depth: int = 3
    # the decode attention kernels (ops.paged_decode_attention and the tail's): "auto", "kernel" or "reference"
    attention_impl: str = "auto"
    # prefill runs a GPU batch in row chunks whose attention / MLP workspace stays under this
    prefill_workspace_gb: float = 2.0
    # prefill each layer in chunks of this many tokens (None: the whole prompt at once): the workspace is a
    # chunk's, and one layer's K/V is on the GPU at a time (long contexts)
    prefill_chunk_tokens: int | None = None
    # the chunked prefill's attention (ops.PREFILL_IMPLS): "auto" is cuDNN's flash attention on a GPU for 16-bit
    # models (the fastest measured), else "reference"; "kernel" is the Pallas flash kernel
    prefill_attention_impl: str = "auto"
    # recomputing K/V from X: "reference" (XLA's matmuls, faster than the fused Pallas kernel on an H200)
    recompute_impl: str = "reference"
    # a `kvoffload profile` JSON for the cost model (None: the platform's default rates)
    profile: str | None = None
    # write every step's record here (JSON)
    trace: str | None = None
    # refuse a run whose memory plan does not fit, before anything is allocated
    check_memory: bool = True
    host_memory_limit_gb: float | None = None
    gpu_memory_limit_gb: float | None = None
    # how a host pool stores K/V and activation blocks: "native" (the model's dtype) or "int4" (group
    # quantization, ~1/4 of bf16's bytes: quantized on the way to the host, moved as it is, dequantized on the
    # GPU); GPU-resident blocks and the GPU tails stay in the model's dtype
    host_dtype: str = "native"
    # int4: elements per group (of a head's d for K/V, of H for X) sharing a float32 step and min
    int4_group_size: int = 64
    # how int4 K is scaled: "token" (groups along each token's head_dim, like V and X), "channel" (KIVI: a step
    # and min per channel over each block's tokens, for keys' outlier channels), "int8" (int8 codes in per-token
    # groups, for single gathered rows) or "native" (K in the model's dtype)
    int4_k_quant: str = "token"
    # tensor parallelism over heads (device/sharding.py): N devices (the first N of jax.devices()), or a
    # jax.sharding.Mesh with a 'model' axis; weights, K/V and the host pool split by head over it
    tensor_parallel: int = 1
    mesh: Any = None

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
