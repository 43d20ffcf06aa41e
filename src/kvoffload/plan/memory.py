"""Memory planning: the block pool's shape and the host and GPU bytes of a run, checked before
anything is allocated.

`plan_pool` sizes the pool (blocks per extent, extents per GPU batch) from the prompts and the
capacity; `pool_memory` counts what the run will hold; `check_memory` refuses, with one message saying
what is needed, what is there and what to change, when the host pool does not fit host memory or
XLA's pinned pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) or the GPU side does not fit the GPU (on a
machine without a GPU the "GPU" is host memory too, and both sides are checked against it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.config import ModelConfig
from kvoffload.errors import KVOffloadError
from kvoffload.device import memory as M
from kvoffload.device import sharding as S

GB = 1e9


class MemoryPlanError(KVOffloadError, RuntimeError):
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
    # GPU parts alive only while prefilling or only while decoding (name -> "prefill" | "decode"); the
    # others are held throughout. A run's GPU peak is the shared parts plus the larger phase.
    gpu_phase: dict = dataclasses.field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return int(sum(self.host.values()))

    def phase_bytes(self, phase: str | None) -> int:
        """GPU bytes of one phase's parts (None: the parts held throughout)."""
        return int(sum(v for k, v in self.gpu.items() if self.gpu_phase.get(k) == phase))

    @property
    def gpu_bytes(self) -> int:
        return self.phase_bytes(None) + max(self.phase_bytes("prefill"), self.phase_bytes("decode"))

    def describe(self) -> str:
        def fmt(d):
            return ", ".join(f"{k} {v / GB:.2f} GB" for k, v in d.items() if v)

        def part(phase):
            return {k: v for k, v in self.gpu.items() if self.gpu_phase.get(k) == phase}

        gpu = fmt(part(None))
        for ph in ("decode", "prefill"):
            if self.phase_bytes(ph):
                gpu += f"; while {ph}: {fmt(part(ph))}"
        return (f"host {self.host_bytes / GB:.2f} GB ({fmt(self.host) or 'nothing'}); "
                f"GPU {self.gpu_bytes / GB:.2f} GB at peak ({gpu})")


MAX_CODES_BYTES = 2**31  # an extent's largest 1-byte array (int4 / int8 codes), at most (plan_pool)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    layouts: tuple  # one PoolLayout per GPU batch
    prompt_blocks: tuple  # full prompt blocks per GPU batch
    flushes: int  # blocks each request appends while generating


def weight_bytes_per_device(cfg, dtype, params, n: int, replicate_kv: bool = False):
    """WeightBytes of one device's shard (split fields / n, replicated ones whole;
    replicate_kv: W_K / W_V whole, as `device.sharding.shard_params` places them for token-split activations)."""
    if n == 1:
        return weight_bytes(cfg, dtype, params)

    def nbytes(lp, fields=None):
        total = 0
        for f in dataclasses.fields(lp):
            a = getattr(lp, f.name)
            if a is None or (fields is not None and f.name not in fields):
                continue
            split = S.field_spec(f.name, a.ndim, replicate_kv) != S.REPLICATED
            total += a.size * jnp.dtype(a.dtype).itemsize // (n if split else 1)
        return int(total)

    whole = weight_bytes(cfg, dtype, params)
    lp = params.layers[0]
    return WeightBytes(per_layer=nbytes(lp), kv_per_layer=nbytes(lp, ("wk", "bk", "wv", "bv")), other=whole.other)


def prefill_workspace_per_row(cfg, dtype, t_pad: int, chunk_tokens: int | None = None) -> float:
    """Bytes of one prompt row's layer prefill: hidden states, q/k/v, MLP and one score chunk; token-
    chunked (chunk_tokens), a chunk's: its hidden states, q/k/v and MLP, the scores of one key block
    (and their exponentials) and the online softmax's fp32 accumulator (prefill_attention_chunk)."""
    from kvoffload.models.common import PREFILL_KEY_BLOCK

    p = jnp.dtype(dtype).itemsize
    if chunk_tokens:
        tc = min(int(chunk_tokens), t_pad)
        return (tc * (6 * cfg.hidden_size + 2 * cfg.intermediate_size) * p
                + cfg.num_heads * tc * (2 * min(PREFILL_KEY_BLOCK, t_pad) + cfg.head_dim) * 4)
    return t_pad * (6 * cfg.hidden_size + 2 * cfg.intermediate_size) * p + cfg.num_heads * min(t_pad, 512) * t_pad * 4


def prefill_chunk_rows(cfg, dtype, t_pad: int, workspace_gb: float, chunk_tokens: int | None = None) -> int:
    return max(1, int(workspace_gb * 1e9 // prefill_workspace_per_row(cfg, dtype, t_pad, chunk_tokens)))


def plan_pool(cfg: ModelConfig, dtype, group_lengths, capacity: int, *, block_tokens: int = 64,
              extent_mb: float = 64.0, host_dtype: str = "native") -> PoolPlan:
    """The pool of each GPU batch: its prompts' full blocks plus one block per request for every
    block_tokens generated tokens (the prompt's partial block and the newest tokens stay in the GPU
    tail), in extents of about extent_mb MiB of K in the model's dtype, the prompt split evenly over
    whole extents. The layout is a function of the shapes and lengths only, so `full` and the offloading
    policies get the same extents (and so the same attention programs over the same blocks).

    host_dtype (validated here) does not change the layout: an int4 extent holds the blocks of a native
    one (its codes array is ~1/4 of extent_mb: 16 MiB at the default, which probe (a) moves at ~94% of
    the link's rate). Why blocks, not stored bytes: the extent is the unit of kvpr's split (recompute extents [0, r),
    fetch the rest), and int4 makes the best split finer, not coarser -- X and K/V shrink alike, so the
    split still balances X's transfer against recomputation, which int4 does not shrink (OPT-6.7B b64
    P512: r ~ 0.6 of the context). Sized by codes, the prompt was one extent there and r could only be
    0 or 1. The same rule holds for hybrid's classed layouts (block bytes in the model's dtype)."""
    from kvoffload.runtime.pool import PoolLayout, extent_blocks_for
    from kvoffload.plan.cost import HOST_DTYPES

    p = jnp.dtype(dtype).itemsize
    blk = int(block_tokens)
    longest = max(int(np.max(l)) for l in group_lengths)
    flushes = max(0, int(capacity) - longest) // blk
    if host_dtype not in HOST_DTYPES:
        raise ValueError(f"host_dtype must be one of {HOST_DTYPES}, got {host_dtype!r}")
    k_block = blk * cfg.num_kv_heads * cfg.head_dim * p  # bytes of one block's K in the model's dtype
    # the most blocks an extent may hold: its largest 1-byte array in any storage form (int8 K codes, int4 X
    # codes) stays within 2 GiB, past which the Triton kernels reading extents in place address it wrongly
    # (`pallas.common.check_triton_offsets`); the same for every host_dtype, so the layout stays shape-only
    code_block = blk * max(cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size // 2)
    most = max(1, MAX_CODES_BYTES // code_block)
    target = min(extent_mb * 2**20, most * k_block)
    layouts, prompt_blocks = [], []
    for lens in group_lengths:
        lens = np.asarray(lens, np.int64)
        pb = int((lens // blk).sum())
        e = extent_blocks_for(k_block, pb, target)
        n_p = -(-pb // e) if pb else 0
        gen = len(lens) * flushes  # the prompt extents' spare slots stay unused (flushes stay aligned)
        # generated extents: whole flushes (one block per request each), about extent_mb each
        e_g = len(lens) * max(1, min(flushes, int(target // (k_block * len(lens))))) if gen else e
        n = n_p + -(-gen // e_g)
        if n == 0:  # nothing to store (every prompt shorter than a block, nothing generated): one tiny extent
            n, n_p = 1, 1
        layouts.append(PoolLayout(block_tokens=blk, extent_blocks=e, num_extents=n, prompt_extents=n_p,
                                  gen_extent_blocks=e_g, kv_extents=(0, n),
                                  request_blocks=int((lens // blk).max(initial=0)) + flushes))
        prompt_blocks.append(pb)
    return PoolPlan(tuple(layouts), tuple(prompt_blocks), flushes)


def pool_memory(cfg: ModelConfig, dtype, layouts, batch: int, t_pad: int, *, host_pool: bool, offload_weights: bool,
                weights: WeightBytes | None = None, inflight: int = 3, tail_slots: int | None = None,
                tail_x: bool = True, prefill_workspace_gb: float = 2.0, resident_layers: int = 0, host_dtype: str = "native",
                int4_group_size: int = 64, int4_k_quant: str = "token", k_on_device: bool = False, prefill_chunk_tokens: int | None = None,
                activation_split: int = 1, fetch: bool = True, slots: dict | None = None,
                layer_parts=None, device_layers=None, kv_gathered: int = 0, x_by_token: bool = False) -> MemoryPlan:
    """Bytes a pool run holds: the pool (host or device), the weights, the GPU tails (tail_slots per
    request and layer; default two blocks), the transfer buffers of `inflight` layers and the prefill's
    workspace. host_dtype: how host K/V and activation blocks are stored ("int4": codes + scales,
    dequantized on the GPU one extent at a time; GPU-resident blocks stay in the model's dtype);
    int4_k_quant: K's int4 scales per token group or per channel of a block (`cost.stored_bytes`).
    k_on_device: a host pool's K extents live on the GPU and its V extents on the host, read in place by
    the layer program (tokenselect kv=split, clo exact); K stays in the model's dtype there (it never
    crosses PCIe). fetch False: decode moves no whole extent (clo, tokenselect kv=split gather selected rows
    in place), so no transfer buffers and no extent-sized dequantize workspace. slots: GPU bytes of the
    policy's per-layer slots by part name (selection caches, row buffers, retrieval metadata), held from
    prefill to the end of the run. layer_parts: per layer, the parts ("k", "v", "x") it stores where the
    layout holds them, or None (all; `LayerHooks.layer_parts`: clo / tokenselect store=act keep X in place
    of V, or of K and V). device_layers: per layer, whether a host pool keeps that layer's K/V extents in
    device memory in the model's dtype (`LayerHooks.device_layer`: clo's all-persistent layers, the selective
    policies' sliding-window layers).
    kv_gathered: the bytes a layer's W_K / W_V gain when their head shards are gathered whole before its
    programs (streamed weights, activations split by token: `sharding.gather_whole`), per layer in flight.
    prefill_chunk_tokens: the prefill runs each layer in token chunks (the workspace is a chunk's) and
    one layer at a time (its K/V, X and their gathered extents are counted once).
    Tensor parallelism (device/sharding.py) plans one device: cfg is the config that device sees (its
    heads and MLP width), weights its shard, and activation_split = N: stored activations (pool and tails)
    are split along H over N devices (a recompute workspace holds a whole gathered X extent); with
    x_by_token they are split by token instead (`pipeline.attend_act_by_token`: each device recomputes all
    its tokens' extents at once, their X slices joined, nothing gathered)."""
    from kvoffload.plan.cost import stored_bytes, stored_x_bytes_per_token

    p = jnp.dtype(dtype).itemsize
    tail_slots = 2 * layouts[0].block_tokens if tail_slots is None else int(tail_slots)
    per_row = prefill_workspace_per_row(cfg, dtype, t_pad, prefill_chunk_tokens)
    chunk = prefill_chunk_rows(cfg, dtype, t_pad, prefill_workspace_gb, prefill_chunk_tokens)
    wb = weights or weight_bytes(cfg, dtype)
    L = cfg.num_layers
    kv_blk = lambda lay: lay.block_tokens * cfg.kv_bytes_per_token * p  # noqa: E731  (K and V)
    stored_as = host_dtype if host_pool else "native"
    kv_values = cfg.num_kv_heads * cfg.head_dim
    # one block's K and V of one layer as the host pool stores them (K's int4 scales may be per channel)
    k_host_blk = lambda lay: int(lay.block_tokens * stored_bytes(  # noqa: E731
        kv_values, p, stored_as, int4_group_size, int4_k_quant, lay.block_tokens))
    v_host_blk = lambda lay: int(lay.block_tokens * stored_bytes(kv_values, p, stored_as, int4_group_size))  # noqa: E731
    x_blk = lambda lay: lay.block_tokens * cfg.hidden_size * p // activation_split  # noqa: E731
    x_host_tok = stored_x_bytes_per_token(cfg, p, stored_as, int4_group_size) / activation_split
    x_host_blk = lambda lay: int(lay.block_tokens * x_host_tok)  # noqa: E731
    # every extent of every layer, on the host (a host pool) or on the GPU (a device pool, or a
    # device-resident block class)
    pool_h = {"K/V blocks": 0, "activation blocks": 0}
    pool_d = {"K/V blocks": 0, "activation blocks": 0}
    per_layer_fetch, rec_ws, deq_ws = 0, 0, 0
    parts = [None] * L if layer_parts is None else list(layer_parts)
    dev_layer = [False] * L if device_layers is None else [bool(x) and host_pool for x in device_layers]
    # layers storing each part in the pool's placement; device layers' K/V counted apart (native, on the GPU)
    n_k, n_v = (sum(1 for p_, d_ in zip(parts, dev_layer) if (p_ is None or part in p_) and not d_) for part in "kv")
    n_x = sum(1 for p_ in parts if p_ is None or "x" in p_)
    n_dev_k, n_dev_v = (sum(1 for p_, d_ in zip(parts, dev_layer) if (p_ is None or part in p_) and d_) for part in "kv")
    for lay in layouts:
        moved, joined = 0, 0
        for e in range(lay.num_extents):
            side = pool_h if host_pool and not lay.on_device(e) else pool_d
            k_e, v_e = ((lay.size(e) * k_host_blk(lay), lay.size(e) * v_host_blk(lay)) if side is pool_h
                        else (lay.size(e) * kv_blk(lay) // 2, lay.size(e) * kv_blk(lay) // 2)) if lay.has("kv", e) else (0, 0)
            kv_e = k_e + v_e
            if side is pool_h and kv_e and stored_as != "native":
                deq_ws = max(deq_ws, lay.size(e) * kv_blk(lay))  # one fetched extent's K/V, dequantized
            x_e = lay.size(e) * (x_host_blk(lay) if side is pool_h else x_blk(lay)) if lay.has("act", e) else 0
            if side is pool_h and x_e and x_host_tok != cfg.hidden_size * p:
                deq_ws = max(deq_ws, lay.size(e) * x_blk(lay))  # one fetched X extent, dequantized
            if side is pool_h and k_on_device and kv_e:  # K on the GPU (native), V on the host (as stored)
                pool_d["K/V blocks"] += n_k * (lay.size(e) * kv_blk(lay) // 2)
                pool_h["K/V blocks"] += n_v * v_e
                kv_e = k_e = v_e = 0
            side["K/V blocks"] += n_k * k_e + n_v * v_e
            if lay.has("kv", e):
                pool_d["K/V blocks"] += (n_dev_k + n_dev_v) * (lay.size(e) * kv_blk(lay) // 2)
            side["activation blocks"] += n_x * x_e
            if side is pool_h:
                moved += max(kv_e, x_e)
            if x_e and fetch and x_by_token:  # every extent's K/V at once, from their X slices joined
                joined += lay.size(e) * (kv_blk(lay) + x_blk(lay))
            elif x_e and fetch:  # K/V recomputed from one activation extent at a time (gathered whole when split)
                rec_ws = max(rec_ws, lay.size(e) * (kv_blk(lay) + (x_blk(lay) * activation_split
                                                                    if activation_split > 1 else 0)))
        rec_ws = max(rec_ws, joined)
        per_layer_fetch = max(per_layer_fetch, moved)
    host = dict(pool_h) if host_pool else {}
    r = min(int(resident_layers), L) if offload_weights else 0
    host["weights"] = (L - r) * wb.per_layer if offload_weights else 0
    g = max(1, len(layouts))
    has_x = any(len(l.extents_of("act")) for l in layouts)
    x_tok = cfg.hidden_size * p if has_x else 0
    tail_tok = cfg.kv_bytes_per_token * p + (x_tok // activation_split if tail_x else 0)
    b = -(-batch // g)
    streamed = L - r if offload_weights else 0
    gpu = {
        "weights": wb.other + (r * wb.per_layer if offload_weights else L * wb.per_layer),
        **({f"{k} (GPU-resident)" if host_pool else k: v for k, v in pool_d.items()}),
        "GPU tails": L * batch * tail_slots * tail_tok,
        "logits": b * cfg.vocab_size * 4 * 2,
        # decoding: `inflight` streamed layers' weights and items' fetched blocks alive at once
        "weights in flight": min(inflight, streamed) * wb.per_layer,
        "W_K / W_V gathered whole": min(inflight, L) * int(kv_gathered),
        "transfer buffers": inflight * per_layer_fetch if host_pool and fetch else 0,
        "recompute workspace": 2 * rec_ws,
        "dequantize workspace": deq_ws if fetch else 0,
        **{k: int(v) for k, v in (slots or {}).items()},
        # prefill of one layer of one GPU batch: its weights (this layer's and the next's), the batch's
        # hidden states and K/V/X, and one row chunk's attention / MLP workspace (token-chunked: one
        # token chunk's, and the layer's K/V/X gathered into extents before they go to the host)
        "prefill weights in flight": min(2, streamed) * wb.per_layer,
        "prefill workspace": b * t_pad * (2 * cfg.hidden_size * p + cfg.kv_bytes_per_token * p + x_tok)
        + min(b, chunk) * per_row + (b * t_pad * (cfg.kv_bytes_per_token * p + x_tok) if prefill_chunk_tokens else 0)
        # row chunks: one chunk's outputs (h, K/V, X) before they are written into the layer's buffers
        + (chunk * t_pad * (cfg.hidden_size * p + cfg.kv_bytes_per_token * p + x_tok) if b > chunk else 0),
    }
    phase = {"weights in flight": "decode", "W_K / W_V gathered whole": "decode", "transfer buffers": "decode",
             "recompute workspace": "decode", "dequantize workspace": "decode", "prefill weights in flight": "prefill",
             "prefill workspace": "prefill"}
    kind, note = M.host_memory_kind()
    return MemoryPlan(host=host, gpu=gpu, host_kind=kind, notes=[note], gpu_phase=phase)


def check_memory(plan: MemoryPlan, *, host_available: float | None = None, gpu_available: float | None = None,
                 host_cap: float | None = None, device_is_host: bool = False, what: str = "") -> None:
    """Raises MemoryPlanError when the plan does not fit. Unknown availabilities (None) are read
    from the machine; a cap of None means no pinned-pool cap (CPU). device_is_host: the "GPU" side is
    host memory as well (a CPU backend), so both sides must fit host memory together."""
    host_available = M.available_host_bytes() if host_available is None else host_available
    gpu_available = M.available_device_bytes() if gpu_available is None else gpu_available
    need_h = plan.host_bytes + (plan.gpu_bytes if device_is_host else 0)
    problems = []
    if host_cap is not None and plan.host_bytes > host_cap:
        problems.append(
            f"the host pool needs {plan.host_bytes / GB:.1f} GB of pinned host memory but XLA's pinned pool is capped at "
            f"{host_cap / GB:.1f} GB; set {M.HOST_LIMIT_ENV}={int(plan.host_bytes / GB * 1.1) + 1} before jax starts "
            f"(the machine must have that much RAM)")
    if host_available is not None and need_h > host_available:
        problems.append(
            f"the {'run (host pool, weights and compute, all in host memory on this CPU backend)' if need_h > plan.host_bytes else 'host pool'} "
            f"needs {need_h / GB:.1f} GB but only {host_available / GB:.1f} GB of host memory is available")
    if gpu_available is not None and plan.gpu_bytes > gpu_available:
        problems.append(f"the GPU side needs {plan.gpu_bytes / GB:.1f} GB but only {gpu_available / GB:.1f} GB "
                        "of GPU memory is free"
                        + (" (its peak is the prefill: prefill long prompts in token chunks, prefill_chunk_tokens, "
                           "e.g. 8192)" if plan.phase_bytes("prefill") > plan.phase_bytes("decode") else ""))
    if problems:
        raise MemoryPlanError(
            f"kvoffload refuses to start{(' ' + what) if what else ''}: " + "; ".join(problems)
            + f". Plan: {plan.describe()}. To fit: lower the batch size or max length (prompt + new tokens), "
            "use more GPU batches (--gpu-batches) for the GPU side, use policy 'offload' instead of 'kvpr' "
            "(no stored activations), or keep the weights on the GPU if only the host is short.")


def check_pool(plan: MemoryPlan, host_limit_gb: float | None, gpu_limit_gb: float | None, host_pool: bool, dev,
               what: str = "", resident: int = 0) -> None:
    """check_memory for a pool run on dev (limits in GB override what the machine reports). resident: bytes the
    plan counts that dev already holds (the model's weights): free memory has them in use, so they are added
    back to it (else they would count twice)."""
    kind, _ = M.host_memory_kind(dev)
    free = M.available_device_bytes(dev) if gpu_limit_gb is None else None
    check_memory(plan, host_available=None if host_limit_gb is None else host_limit_gb * GB,
                 gpu_available=gpu_limit_gb * GB if gpu_limit_gb is not None else (
                     None if free is None else free + resident),
                 host_cap=M.host_pool_cap_bytes(dev.platform) if (host_pool and kind == "pinned_host") else None,
                 device_is_host=dev.platform == "cpu", what=what)
