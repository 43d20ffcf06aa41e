"""Memory planner: host and GPU bytes of an offloaded run, checked before anything is allocated.

`plan_memory` counts what a run will hold; `check_memory` refuses, with one message saying what is
needed, what is there and what to change, when the host store does not fit host memory or XLA's
pinned pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) or the GPU side does not fit the GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvoffload.config import ModelConfig
from kvoffload.offload import memory as M

GB = 1e9


class MemoryPlanError(RuntimeError):
    """The planned run does not fit; raised before any allocation."""


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    per_layer: int  # bytes of one transformer layer
    kv_per_layer: int  # of which W_K, W_V (+ biases): what recomputation needs first
    other: int  # embeddings, final norm, head


def weight_bytes(cfg: ModelConfig, dtype=jnp.bfloat16, params=None) -> WeightBytes:
    """Weight bytes from a params pytree, or (params None) from the config's shapes."""
    if params is None:
        from kvoffload.models.transformer import init_params

        params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))

    def nbytes(tree):
        return int(sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))

    layer = params.layers[0]
    kv = sum(nbytes(getattr(layer, f, None)) for f in ("wk", "bk", "wv", "bv"))
    per_layer = nbytes(layer)
    total = nbytes(params)
    return WeightBytes(per_layer=per_layer, kv_per_layer=kv, other=total - per_layer * cfg.num_layers)


@dataclasses.dataclass
class MemoryPlan:
    host: dict  # name -> bytes
    gpu: dict
    host_kind: str | None
    notes: list

    @property
    def host_bytes(self) -> int:
        return int(sum(self.host.values()))

    @property
    def gpu_bytes(self) -> int:
        return int(sum(self.gpu.values()))

    def describe(self) -> str:
        def fmt(d):
            return ", ".join(f"{k} {v / GB:.2f} GB" for k, v in d.items() if v)

        return (f"host {self.host_bytes / GB:.2f} GB ({fmt(self.host) or 'nothing'}); "
                f"GPU {self.gpu_bytes / GB:.2f} GB ({fmt(self.gpu)})")


def plan_memory(cfg: ModelConfig, batch: int, capacity: int, *, prompt_len: int | None = None,
                store_activations: bool, offload_weights: bool, dtype=jnp.bfloat16, gpu_batches: int = 1,
                flush_block: int = 64, inflight: int = 3, weights: WeightBytes | None = None,
                split_store: bool = False) -> MemoryPlan:
    """Bytes an offloaded run holds. batch: the whole batch (all GPU batches); capacity: slots per
    sequence (prompt + generated, bucketed); inflight: layers' transfers alive at once on the GPU."""
    p = jnp.dtype(dtype).itemsize
    wb = weights or weight_bytes(cfg, dtype)
    L = cfg.num_layers
    kv_tok = cfg.kv_bytes_per_token * p
    x_tok = cfg.hidden_size * p
    slots = capacity  # host slots: prompt + flushed blocks (the newest < flush_block tokens stay on the GPU)
    t0 = min(prompt_len or 0, slots)
    if store_activations and split_store:  # X before the split, K/V after it: at most max(x, kv) a slot
        host = {"K/V": L * batch * (slots - t0) * kv_tok, "K/V or X (split prompt)": L * batch * t0 * max(kv_tok, x_tok)}
    else:
        host = {"K/V": L * batch * slots * kv_tok,
                "activations X": L * batch * slots * x_tok if store_activations else 0}
    host = {
        **host,
        "weights": L * wb.per_layer if offload_weights else 0,
    }
    b = -(-batch // max(1, gpu_batches))
    t = prompt_len or capacity
    per_tok = max(kv_tok, x_tok) + (kv_tok if store_activations else 0)  # fetched + recomputed
    gpu = {
        "weights": wb.other + (min(inflight, L) * wb.per_layer if offload_weights else L * wb.per_layer),
        "transfer buffers": inflight * b * slots * per_tok,
        "recent-token buffers": L * batch * flush_block * (kv_tok + (x_tok if store_activations else 0)),
        # prefill of one layer of one GPU batch: hidden states, q/k/v, MLP and one score chunk
        "workspace": b * t * (6 * cfg.hidden_size + 2 * cfg.intermediate_size) * p
        + b * cfg.num_heads * min(t, 512) * t * 4 + b * cfg.vocab_size * 4 * 2,
    }
    kind, note = M.host_memory_kind()
    return MemoryPlan(host=host, gpu=gpu, host_kind=kind, notes=[note])


def check_memory(plan: MemoryPlan, *, host_available: float | None = None, gpu_available: float | None = None,
                 host_cap: float | None = None, what: str = "") -> None:
    """Raises MemoryPlanError when the plan does not fit. Unknown availabilities (None) are read
    from the machine; a cap of None means no pinned-pool cap (CPU)."""
    host_available = M.available_host_bytes() if host_available is None else host_available
    gpu_available = M.available_device_bytes() if gpu_available is None else gpu_available
    need_h = plan.host_bytes
    problems = []
    if host_cap is not None and need_h > host_cap:
        problems.append(
            f"the host store needs {need_h / GB:.1f} GB of pinned host memory but XLA's pinned pool is capped at "
            f"{host_cap / GB:.1f} GB; set {M.HOST_LIMIT_ENV}={int(need_h / GB * 1.1) + 1} before jax starts "
            f"(the machine must have that much RAM)")
    if host_available is not None and need_h > host_available:
        problems.append(
            f"the host store needs {need_h / GB:.1f} GB but only {host_available / GB:.1f} GB of host memory is "
            "available")
    if gpu_available is not None and plan.gpu_bytes > gpu_available:
        problems.append(f"the GPU side needs {plan.gpu_bytes / GB:.1f} GB but only {gpu_available / GB:.1f} GB "
                        "of GPU memory is free")
    if problems:
        raise MemoryPlanError(
            f"kvoffload refuses to start{(' ' + what) if what else ''}: " + "; ".join(problems)
            + f". Plan: {plan.describe()}. To fit: lower the batch size or max length (prompt + new tokens), "
            "use more GPU batches (--gpu-batches) for the GPU side, use policy 'offload' instead of 'kvpr' "
            "(no stored activations), or keep the weights on the GPU if only the host is short.")
