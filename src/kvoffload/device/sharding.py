"""Tensor parallelism over heads: a device mesh with a ``model`` axis and where every array lives on it.

Weights are sharded Megatron-style: Q/K/V and the MLP's up/gate projections column-wise (whole heads
per device for attention), the attention output and the MLP's down projection row-wise; embeddings,
norms, output biases and the head are replicated. Each attention block and each MLP then ends in one
partial sum that XLA (GSPMD) turns into an all-reduce: the layer programs are the single-device ones,
jitted with sharded inputs.

K/V (GPU tails, pool extents in device or pinned host memory, fetched extents) are sharded by KV head
(axis 1 of ``[B | E, n_kv, S | blk, d]``): each device stores, moves over its own link and attends only
its heads' blocks. Activation extents (``[E, blk, H]``, what kvpr and hybrid recompute K/V from) hold
every head's input; they are split **by token** (``X_TOKEN_SPEC``: each block's blk tokens in N slices of
blk / N, every slice whole along H). Each device moves 1/N of every X block over its own link and
recomputes the K/V of every head for its tokens (W_K / W_V whole on every device: replicated when the
weights stay on the GPU, gathered once per layer when they stream: `gather_whole`), attends all query
heads over them, and the devices merge their partial softmaxes into each device's heads (one
all-to-all of [B, heads, d + 1] fp32 per layer program, all its recomputed extents folded first;
`pipeline.attend_act_by_token`). No device receives
another's X. The earlier layout split X along H (``X_SPEC``) and all-gathered it before each recompute:
(N-1)/N of every recomputed X block over NVLink per device, which held kvpr to 1.38x / 1.66x on 2 / 4
GPUs. ``X_SPEC`` stays for the GPU tails of X and for the policies that gather single X rows
(tokenselect store=act), where a row must be readable on every device. Replicating X would move all of it
over every link: for MHA at N >= 2 as many bytes as a device's K/V, so recomputation could never pay.

Pallas kernels cannot be partitioned by XLA: `per_shard` wraps a kernel call in ``jax.shard_map`` over
the head axis when a mesh with a ``model`` axis is in context (``jax.set_mesh``, entered by the layer
pipeline around its programs); without one it is the call itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvoffload.errors import KVOffloadError

MODEL = "model"  # the mesh axis heads are split over

# per-layer weight fields by how they split (both families: models/opt.py, models/llama.py)
COLUMN = frozenset({"wq", "wk", "wv", "fc1", "w_gate", "w_up"})  # [H, out]: out split (whole heads)
COLUMN_BIAS = frozenset({"bq", "bk", "bv", "b1", "b_gate", "b_up"})  # [out]
ROW = frozenset({"wo", "fc2", "w_down"})  # [in, H]: in split; the product is a partial sum (all-reduce)

KV_SPEC = P(None, MODEL)  # [B | E, n_kv, ...]: by KV head
X_SPEC = P(None, None, MODEL)  # X tails [b, slots, H] (and tokenselect's row-gathered X extents): along H
X_TOKEN_SPEC = P(None, MODEL)  # activation extents [E, blk, H] recomputed per device: by token within a block
REPLICATED = P()


class TensorParallelError(KVOffloadError, ValueError):
    """A tensor-parallel setting that cannot run (head counts or MLP width not divisible, too few
    devices, a mesh without a 'model' axis, a policy that does not support it)."""


def check_divisible(cfg, n: int) -> None:
    """Refuses a model whose query heads, KV heads or MLP width do not split evenly over n devices."""
    counts = {"query heads": cfg.num_heads, "KV heads": cfg.num_kv_heads, "MLP width": cfg.intermediate_size}
    bad = {k: v for k, v in counts.items() if v % n}
    if bad:
        have = ", ".join(f"{k} {v}" for k, v in counts.items())
        ok = [d for d in range(1, n + 1) if all(v % d == 0 for v in counts.values())]
        raise TensorParallelError(
            f"tensor_parallel={n} splits heads and the MLP evenly over {n} devices, but this model has {have} "
            f"({', '.join(bad)} not divisible by {n}); choose a tensor_parallel that divides all three "
            f"(<= {n}: {ok})")


def make_mesh(n: int, devices=None) -> Mesh:
    """A 1-D mesh of the first n devices (global devices under jax.distributed) with axis 'model'."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TensorParallelError(f"tensor_parallel must be an integer >= 1, got {n!r}")
    if n > len(devices):
        raise TensorParallelError(f"tensor_parallel={n} needs {n} devices but {len(devices)} are visible "
                                  f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                                  f"{n} before jax starts")
    return Mesh(devices[:n], (MODEL,))


def resolve_mesh(tensor_parallel: int = 1, mesh: Mesh | None = None) -> Mesh | None:
    """The run's mesh from the options (a mesh, or tensor_parallel=N over the first N devices); None
    for one device (the single-device path, unchanged)."""
    if mesh is not None:
        if not isinstance(mesh, Mesh) or MODEL not in mesh.axis_names:
            raise TensorParallelError(f"mesh must be a jax.sharding.Mesh with a {MODEL!r} axis, got {mesh!r}")
        if len(mesh.axis_names) != 1:
            raise TensorParallelError(f"mesh must have the single axis {MODEL!r} (tensor parallelism only), got "
                                      f"axes {mesh.axis_names}")
        if tensor_parallel not in (None, 1, mesh.shape[MODEL]):
            raise TensorParallelError(f"tensor_parallel={tensor_parallel} and a mesh of {mesh.shape[MODEL]} devices "
                                      "disagree; give one of them")
        return mesh if mesh.shape[MODEL] > 1 else None
    n = 1 if tensor_parallel is None else tensor_parallel
    return make_mesh(n) if n != 1 else None


def size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[MODEL])


def local_device(mesh: Mesh):
    """The first device of the mesh that this process drives (every process has one under
    jax.distributed with one process per device)."""
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def local_size(mesh: Mesh | None) -> int:
    """Devices of the mesh that this process drives (all of them without jax.distributed)."""
    return 1 if mesh is None else sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())


def device_budgets(host_bytes: float, gpu_bytes: float, mesh: Mesh | None, platform: str) -> tuple[float, float]:
    """One device's share of the machine's memory budgets, as `machine_plan` counts the other way: host
    bytes split over the local devices (each keeps its shard of the pool there); GPU bytes per device
    already, except on a CPU backend where the "devices" share host memory."""
    n = local_size(mesh)
    return host_bytes / n, gpu_bytes / (n if platform == "cpu" else 1)


def machine_plan(plan, mesh: Mesh | None, platform: str):
    """A per-device memory plan as this process's machine holds it: host parts once per local device
    (each keeps its shard of the pool, and its own copy of replicated activations); GPU parts per
    device, except on a CPU backend where the "devices" are host memory too."""
    if mesh is None:
        return plan
    n = local_size(mesh)
    times = lambda d: {k: v * n for k, v in d.items()}  # noqa: E731
    return dataclasses.replace(plan, host=times(plan.host), gpu=times(plan.gpu) if platform == "cpu" else plan.gpu)


def context(mesh: Mesh | None):
    """The mesh in context for the programs traced inside (per_shard, sharding constraints); nothing
    for one device."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


KV_FIELDS = ("wk", "bk", "wv", "bv", "k_norm")  # what recomputing K/V reads: W_K / W_V, biases, gemma3's key norm


def field_spec(name: str, ndim: int, replicate_kv: bool = False) -> P:
    """replicate_kv: W_K, W_V (and biases) whole on every device (token-split activations: each device
    recomputes every head's K/V of its tokens)."""
    if replicate_kv and name in KV_FIELDS:
        return REPLICATED
    if name in COLUMN and ndim == 2:
        return P(None, MODEL)
    if name in COLUMN_BIAS and ndim == 1:
        return P(MODEL)
    if name in ROW and ndim == 2:
        return P(MODEL, None)
    return REPLICATED


def layer_specs(lp, replicate_kv: bool = False):
    """The layer dataclass with a PartitionSpec in place of each weight (None stays None)."""
    return dataclasses.replace(lp, **{f.name: (None if getattr(lp, f.name) is None else
                                               field_spec(f.name, getattr(lp, f.name).ndim, replicate_kv))
                                      for f in dataclasses.fields(lp)})


def param_shardings(params, mesh: Mesh, memory_kind: str | None = None, layers_kind: str | None = None,
                    replicate_kv: bool = False):
    """NamedShardings of a whole params pytree: layers Megatron-style (in memory kind layers_kind, e.g.
    pinned_host for streamed weights; W_K / W_V whole with replicate_kv), everything else replicated."""
    rep = jax.tree.map(lambda _: NamedSharding(mesh, REPLICATED, memory_kind=memory_kind),
                       dataclasses.replace(params, layers=()))
    layers = tuple(jax.tree.map(lambda spec: NamedSharding(mesh, spec, memory_kind=layers_kind or memory_kind),
                                layer_specs(lp, replicate_kv), is_leaf=lambda s: isinstance(s, P))
                   for lp in params.layers)
    return dataclasses.replace(rep, layers=layers)


def shard_params(params, mesh: Mesh, memory_kind: str | None = None, layers_kind: str | None = None,
                 replicate_kv: bool = False):
    """params placed on the mesh (a no-op for arrays already placed so)."""
    return jax.device_put(params, param_shardings(params, mesh, memory_kind, layers_kind, replicate_kv))


def device_config(cfg, n: int):
    """The model config one device sees (its heads and MLP width; hidden size and head_dim whole): what
    the per-device memory plan and cost model count."""
    if n == 1:
        return cfg
    check_divisible(cfg, n)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                               intermediate_size=cfg.intermediate_size // n)


# ---------------------------------------------------------------------------------------------
# arrays on the mesh
# ---------------------------------------------------------------------------------------------


def kv_sharding(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, KV_SPEC, memory_kind=memory_kind)


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED, memory_kind=memory_kind)


def put(values, where):
    """Host values (numbers, numpy, arrays of this process) committed to `where` (a device or sharding),
    in one device_put where this process can address every device; for a sharding that spans other
    processes (jax.distributed), each process fills its own shards (every process passes the same values)."""
    if where is None or isinstance(where, jax.Device) or where.is_fully_addressable:
        return jax.device_put(values, where)

    def one(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, where, lambda idx: a[idx])

    return jax.tree.map(one, values)


def x_shardings(tree, mesh: Mesh, memory_kind: str | None = None, by_token: bool = False):
    """Shardings of activation arrays (an X extent or tail, or an int4 one's codes and scales): split
    along the last axis (H), or with by_token along axis 1 (an extent's tokens within each block), where
    that axis divides over the mesh, else replicated."""
    n = size(mesh)
    spec, axis = (X_TOKEN_SPEC, 1) if by_token else (X_SPEC, -1)
    return jax.tree.map(lambda a: NamedSharding(mesh, spec if a.shape[axis] % n == 0 else REPLICATED,
                                                memory_kind=memory_kind), tree)


@functools.lru_cache(maxsize=None)
def _whole_program(where: NamedSharding):
    return jax.jit(lambda tree: tree, out_shardings=where)


def gather_whole(tree, mesh: Mesh):
    """tree (a streamed layer's W_K / W_V head shards) whole on every device: one all-gather program, run
    once per layer and step, so that every GPU batch's layer program takes it gathered (inside each program
    XLA would gather it again: once per program, its extents' gathers merged)."""
    return _whole_program(replicated(mesh))(tree)


def constrain_replicated(x):
    """x replicated over the context mesh's 'model' axis (inside a traced program); x itself without one."""
    if context_size() == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), REPLICATED))


def per_shard(fn, in_specs, out_specs):
    """fn run per shard of the context mesh's 'model' axis (jax.shard_map) when one is in context with
    more than one device, else fn itself. For Pallas kernels: XLA cannot partition a kernel call, so
    each device runs it on its heads. Specs name MODEL for the head axis; arguments given None stay
    None (in_specs entries for them are ignored). Inside a shard_map over the axis (already per device)
    it is fn itself."""
    if context_size() == 1:
        return fn
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def context_size() -> int:
    """Devices along the context mesh's 'model' axis inside a traced program: 1 without one, and inside a
    shard_map over it (each device's own part, where nothing is split further)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names or MODEL in mesh.manual_axes:
        return 1
    return int(mesh.shape[MODEL])

