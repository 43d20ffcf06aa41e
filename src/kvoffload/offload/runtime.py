"""The layer-by-layer offloaded decode runtime shared by the `offload` and `kvpr` policies.

The decode loop is driven from Python. For every work item (layer i of GPU batch g) it first issues
the next item's transfers (eager device_put / jitted fetch, all asynchronous), then the current
item's jitted compute, so transfers of item n+1 run under compute of item n (measured here: copies
inside one jit do not overlap compute; a transfer dispatched *before* the compute overlaps fully).

Per item the transfers are issued in KVPR's fine-grained order: W_K/W_V (weights offloaded), the
activations X[0:l], the rest of the weights, then K/V[l:s]; the recomputation (its own jit, needing
only X and W_K/W_V) is dispatched before the attention/MLP jit, so it can start before the K/V and
the other weights have arrived.

Schedules: ``row`` (each GPU batch through all layers, then the next: latency) and ``column``
(zig-zag: every GPU batch through layer i before layer i+1; a layer's weights are fetched once per
step for all GPU batches: throughput).

Memory: fetched buffers are dropped as soon as their compute is dispatched. With ``sync_depth``
D > 0, before issuing item n+1's transfers the host waits until item n+1-D's compute finished, so at
most D items' transfer buffers are alive (D = 3: the GPU still has a queued item when the host
waits, so the wait costs no GPU time). sync_depth = 0 never waits (the GPU memory of a whole step's
transfers may then be alive at once).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.config import ModelConfig
from kvoffload.models.transformer import family, layer_prefill
from kvoffload.offload import memory as M
from kvoffload.offload.planner import check_memory, plan_memory, weight_bytes
from kvoffload.offload.store import Segment, SubBatch, flush_tail, new_tail
from kvoffload.plan.cost import CostModel, LayerShape, predict_step
from kvoffload.plan.split import SplitProblem, choose_split

KV_FIELDS = ("wk", "bk", "wv", "bv")
SCHEDULES = ("row", "column")


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def split_layer(lp):
    """(W_K/W_V part, the rest) of one layer's params (same dataclass, other fields None)."""
    fields = [f.name for f in dataclasses.fields(lp)]
    kv = dataclasses.replace(lp, **{f: None for f in fields if f not in KV_FIELDS})
    rest = dataclasses.replace(lp, **{f: None for f in fields if f in KV_FIELDS})
    return kv, rest


def join_layer(kv, rest):
    return dataclasses.replace(rest, **{f: getattr(kv, f) for f in KV_FIELDS if hasattr(kv, f)})


def without_layers(params):
    return dataclasses.replace(params, layers=())


# ---------------------------------------------------------------------------------------------
# jitted pieces
# ---------------------------------------------------------------------------------------------


def fetch(arrays, dev=None):
    """Whole host arrays -> device: one eager, asynchronous device_put (its own copy stream; a copy
    inside a jitted program would run on the compute stream and not overlap the next layer's compute)."""
    if not arrays:
        return []
    return jax.device_put(list(arrays), M.device_sharding(dev or M.default_device()))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(cfg, params, tokens, positions):
    return family(cfg).embed(cfg, params, tokens, positions)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(cfg, params, h):
    return family(cfg).logits(cfg, params, h)


@functools.partial(jax.jit, static_argnames=("cfg", "keep_x"))
def _layer_prefill(cfg, lp, h, positions, lengths, keep_x):
    h, k, v, x = layer_prefill(cfg, lp, h, positions, lengths)
    return h, k, v, (x if keep_x else None)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _last_hidden(cfg, h, lengths):
    del cfg
    return jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]


def recompute_kv_xla(cfg, kvw, x, positions):
    """K, V [B, n_kv, T, d] from X [B, T, H]: plain XLA matmuls (cuBLAS on GPU), RoPE for LLaMA."""
    from kvoffload.models.common import apply_rope, rope_cos_sin, split_heads

    def proj(w, b):
        y = jnp.einsum("bth,hn->btn", x, w, preferred_element_type=jnp.float32)
        if b is not None:
            y = y + b.astype(jnp.float32)
        return split_heads(y, cfg.num_kv_heads, cfg.head_dim)

    k, v = proj(kvw.wk, kvw.bk), proj(kvw.wv, kvw.bv)
    if cfg.family == "llama":
        cos, sin = rope_cos_sin(cfg, positions)
        k = apply_rope(k, cos, sin)
    return k.astype(x.dtype), v.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "pos_specs", "impl"))
def _recompute(cfg, kvw, xs, prompt_lens, pos_specs, impl="xla"):
    """K/V of each X part. pos_specs: ('prompt', start) -> positions start + 0..n-1; ('gen', off) ->
    positions prompt_len + off + 0..n-1. impl 'xla' (plain matmuls) or 'ops' (ops.recompute_kv)."""
    fam = family(cfg)
    out = []
    for x, (kind, off) in zip(xs, pos_specs):
        n = x.shape[1]
        if kind == "prompt":
            pos = jnp.broadcast_to(off + jnp.arange(n, dtype=jnp.int32), (x.shape[0], n))
        else:
            pos = prompt_lens[:, None] + off + jnp.arange(n, dtype=jnp.int32)[None]
        out.append(recompute_kv_xla(cfg, kvw, x, pos) if impl == "xla" else fam.recompute_kv(cfg, kvw, x, pos))
    return tuple(out)


def _part_lengths(spec, prompt_lens):
    if spec[0] == "prompt":  # prompt slots [start, start + n): valid below the prompt length
        _, start, n = spec
        return jnp.clip(prompt_lens - start, 0, n)
    return jnp.full_like(prompt_lens, spec[1])  # a generated segment of n slots, all valid


@functools.partial(jax.jit, static_argnames=("cfg", "part_specs", "impl"),
                   donate_argnames=("tail_k", "tail_v", "tail_x"))
def _attend(cfg, lp, h, prompt_lens, n_gen, tail_k, tail_v, tail_x, tail_len, parts, part_specs, impl="auto"):
    """One decode layer: q/k/v of the new token, write k/v/x into the GPU tail, attention over every
    part (recomputed, fetched, tail) merged by log-sum-exp, output projection and MLP."""
    fam = family(cfg)
    positions = (prompt_lens + n_gen)[:, None]
    x = fam.attn_input(cfg, lp, h)
    q, k, v = fam.qkv(cfg, lp, x, positions)
    zero = jnp.zeros((), jnp.int32)
    tail_k = jax.lax.dynamic_update_slice(tail_k, k.astype(tail_k.dtype), (zero, zero, tail_len, zero))
    tail_v = jax.lax.dynamic_update_slice(tail_v, v.astype(tail_v.dtype), (zero, zero, tail_len, zero))
    if tail_x is not None:
        tail_x = jax.lax.dynamic_update_slice(tail_x, x.astype(tail_x.dtype), (zero, tail_len, zero))
    q1 = q[:, :, 0]
    outs = []
    for (pk, pv), spec in zip(parts, part_specs):
        outs.append(ops.decode_attention(q1, pk, pv, _part_lengths(spec, prompt_lens), impl=impl))
    outs.append(ops.decode_attention(q1, tail_k, tail_v, jnp.full_like(prompt_lens, 1) + tail_len, impl=impl))
    o, _ = ops.merge_attention(outs)
    h = fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o[:, :, None]))
    return h, tail_k, tail_v, tail_x


# ---------------------------------------------------------------------------------------------
# the runtime
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OffloadState:
    subs: list  # of SubBatch
    batch: int
    capacity: int
    step: int = 0


@dataclasses.dataclass
class RuntimeOptions:
    kvpr: bool = False  # store X and recompute K/V[0:l]
    kvpr_store: str = "both"  # 'both': X and K/V of every prompt slot (l free per step); 'split': X of
    # [0, l0) and K/V of [l0, t_pad) only, l0 chosen at prefill (KVPR's memory saving; l fixed)
    schedule: str = "row"
    offload_weights: bool = False
    split_point: int | None = None  # forced l (host slots); None: the scheduler
    gpu_batches: int = 1
    profile: str | None = None
    trace: str | None = None
    flush_block: int = 64
    split_bucket: int = 64
    sync_depth: int = 3
    objective: str = "pipelined"
    recompute_impl: str = "xla"  # 'xla' (plain matmuls) | 'ops' (ops.recompute_kv: kernel on GPU)
    attention_impl: str = "auto"  # impl of ops.decode_attention
    check_memory: bool = True
    host_memory_limit_gb: float | None = None  # override of what is available (tests, planning)
    gpu_memory_limit_gb: float | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if int(self.gpu_batches) < 1:
            raise ValueError(f"gpu_batches must be >= 1, got {self.gpu_batches}")
        if int(self.flush_block) < 1 or int(self.split_bucket) < 1:
            raise ValueError("flush_block and split_bucket must be >= 1")
        if self.kvpr_store not in ("both", "split"):
            raise ValueError(f"kvpr_store must be 'both' or 'split', got {self.kvpr_store!r}")
        if self.split_point is not None and int(self.split_point) < 0:
            raise ValueError(f"split_point must be >= 0 or None, got {self.split_point}")
        self.gpu_batches = int(self.gpu_batches)
        self.flush_block = int(self.flush_block)
        self.split_bucket = int(self.split_bucket)
        self.sync_depth = int(self.sync_depth)


class OffloadRuntime:
    """Prefill into the host store and decode layer by layer (see the module docstring)."""

    def __init__(self, opts: RuntimeOptions):
        self.o = opts
        self.dev = M.default_device()
        self.host_kind, self.host_note = M.host_memory_kind(self.dev)
        self._cost = None
        self._host_layers = {}  # id(params) -> host layers
        self._split_cache = {}
        self.trace_rows: list[dict] = []
        self.last_plan = None
        self.memory_plan = None
        self._last_step_t = None
        self.store_x = opts.kvpr
        self.no_recompute_reason = None

    # -- cost model ----------------------------------------------------------------------------
    @property
    def cost(self) -> CostModel:
        if self._cost is None:
            self._cost = (CostModel.load(self.o.profile) if self.o.profile
                          else CostModel.default(self.dev.platform))
        return self._cost

    def _shape(self, model) -> LayerShape:
        key = id(model.params)
        if getattr(self, "_shape_key", None) != key:
            self._shape_key, self._shape_val = key, self._compute_shape(model)
        return self._shape_val

    def _compute_shape(self, model) -> LayerShape:
        cfg = model.config
        lp = model.params.layers[0]
        p = jnp.dtype(lp.wk.dtype).itemsize
        wb = weight_bytes(cfg, lp.wk.dtype, model.params)
        return LayerShape.of(cfg, p, wb.per_layer, wb.kv_per_layer)

    # -- weights ----------------------------------------------------------------------------------
    def _layers(self, model):
        """Per-layer params: on the GPU (resident) or in host memory (offloaded)."""
        layers = model.params.layers
        if not self.o.offload_weights:
            return layers
        if M.on_host(layers):
            return layers
        key = id(model.params)
        if key not in self._host_layers:
            self._host_layers = {key: M.to_host(layers, self.dev)}
        return self._host_layers[key]

    def _issue_weights(self, hl):
        """(kv part, rest) of one layer on the device; W_K/W_V are issued first."""
        kv, rest = split_layer(hl)
        kv_d = M.to_device(kv, self.dev)
        return kv_d, rest

    # -- prefill -------------------------------------------------------------------------------------
    def prefill(self, model, tokens, lengths, capacity):
        cfg: ModelConfig = model.config
        o = self.o
        self.store_x = o.kvpr
        self.no_recompute_reason = None
        sh = self._shape(model)
        if o.kvpr and o.split_point is None and sh.x_tok >= sh.kv_tok:
            # an activation is no smaller than its K/V (GQA): recomputation cannot pay for any l, so
            # store no activations and run exactly as `offload` (the plan says why)
            self.store_x = False
            self.no_recompute_reason = (
                f"no recompute: an activation ({sh.x_tok:.0f} B/token) is at least as large as its K/V "
                f"({sh.kv_tok:.0f} B/token, GQA), so recomputing can only add PCIe bytes; no activations stored")
        b, t_pad = tokens.shape
        g = min(o.gpu_batches, b)
        dtype = model.params.layers[0].wk.dtype
        if o.check_memory:
            self.memory_plan = plan_memory(
                cfg, b, capacity, prompt_len=t_pad, store_activations=self.store_x, offload_weights=o.offload_weights,
                dtype=dtype, gpu_batches=g, flush_block=o.flush_block, inflight=max(o.sync_depth, 2),
                weights=weight_bytes(cfg, dtype, model.params), split_store=o.kvpr_store == "split")
            if o.offload_weights and M.on_host(model.params.layers):
                self.memory_plan.host["weights"] = 0  # already in host memory (counted by MemAvailable)
            gb = 1e9
            check_memory(
                self.memory_plan,
                host_available=None if o.host_memory_limit_gb is None else o.host_memory_limit_gb * gb,
                gpu_available=None if o.gpu_memory_limit_gb is None else o.gpu_memory_limit_gb * gb,
                host_cap=M.host_pool_cap_bytes(self.dev.platform) if self.host_kind == "pinned_host" else None,
                what=f"{'kvpr' if o.kvpr else 'offload'} for batch {b} x {capacity} tokens")
        fam_params = without_layers(model.params)
        layers = self._layers(model)
        lengths = jnp.asarray(lengths, jnp.int32)
        bounds = np.linspace(0, b, g + 1).astype(int)
        subs = []
        hs = []
        positions = None
        for gi in range(g):
            rows = slice(int(bounds[gi]), int(bounds[gi + 1]))
            tok = tokens[rows]
            positions = jnp.broadcast_to(jnp.arange(t_pad, dtype=jnp.int32), tok.shape)
            hs.append(_embed(cfg, fam_params, tok, positions))
            tails = [new_tail(cfg, rows.stop - rows.start, o.flush_block, dtype, self.store_x)
                     for _ in range(cfg.num_layers)]
            subs.append(SubBatch(rows=rows, prompt_lens=lengths[rows], t_pad=t_pad,
                                 segs=[[] for _ in range(cfg.num_layers)],
                                 tail_k=[t[0] for t in tails], tail_v=[t[1] for t in tails],
                                 tail_x=[t[2] for t in tails]))
        split_store = self.store_x and o.kvpr_store == "split"
        l0s = [self.split_for(model, sb)[0] if split_store else None for sb in subs]  # at s = t_pad
        # column-major: each layer's weights once for all GPU batches
        pending = []
        nxt = self._prefill_weights(layers, 0)
        for i in range(cfg.num_layers):
            lp = nxt
            if i + 1 < cfg.num_layers:
                nxt = self._prefill_weights(layers, i + 1)
            for gi, sb in enumerate(subs):
                pos = jnp.broadcast_to(jnp.arange(t_pad, dtype=jnp.int32), (sb.size, t_pad))
                hs[gi], k, v, x = _layer_prefill(cfg, lp, hs[gi], pos, sb.prompt_lens, self.store_x)
                segs = self._store_prompt(k, v, x, t_pad, l0s[gi] if split_store else None)
                sb.segs[i].extend(segs)
                pending.append(segs[-1])
                if o.sync_depth and len(pending) > o.sync_depth:  # bound the device copies alive
                    old = pending.pop(0)
                    jax.block_until_ready([a for a in (old.k, old.v, old.x) if a is not None])
        logits = [_logits(cfg, fam_params, _last_hidden(cfg, hs[gi], sb.prompt_lens)) for gi, sb in enumerate(subs)]
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, 0)
        self._last_step_t = None
        return logits, OffloadState(subs=subs, batch=b, capacity=capacity)

    def _store_prompt(self, k, v, x, t_pad, l0):
        """Host segments of one layer's prompt K/V/X: one segment (offload); chunks of split_bucket
        slots with X and K/V each (kvpr 'both': any chunk boundary can be the split); or X of
        [0, l0) and K/V of [l0, t_pad) (kvpr 'split')."""
        o = self.o
        if not self.store_x:
            bounds = ((0, t_pad),)
        elif l0 is not None:
            bounds = tuple(b for b in ((0, l0), (l0, t_pad)) if b[1] > b[0])
        else:
            bounds = tuple((j, min(j + o.split_bucket, t_pad)) for j in range(0, t_pad, o.split_bucket))
        want = tuple((l0 is None or b[1] <= l0, l0 is None or b[0] >= l0) for b in bounds)  # (x?, kv?)
        chunks = _chunks(k, v, x if self.store_x else None, bounds, want) if len(bounds) > 1 or l0 is not None \
            else ((k, v, x if self.store_x else None),)
        host = M.to_host(chunks, self.dev)
        return [Segment(k=hk, v=hv, x=hx, n=b[1] - b[0], start=b[0]) for (hk, hv, hx), b in zip(host, bounds)]

    def _prefill_weights(self, layers, i):
        lp = layers[i]
        return M.to_device(lp, self.dev) if self.o.offload_weights else lp

    # -- split points --------------------------------------------------------------------------
    def candidates(self, sb: SubBatch) -> tuple:
        """Split points l the store allows: segment boundaries with X stored for every segment
        below and K/V for every segment above (offload: 0 only)."""
        segs = sorted(sb.segs[0], key=lambda s: s.start)
        if not segs:  # before prefill stored anything: prompt chunk boundaries
            if self.store_x:
                return tuple(sorted(set(range(0, sb.t_pad, self.o.split_bucket)) | {sb.t_pad}))
            return (0,)
        out = []
        for j in range(len(segs) + 1):
            if all(s.x is not None for s in segs[:j]) and all(s.k is not None for s in segs[j:]):
                out.append(segs[j].start if j < len(segs) else segs[-1].start + segs[-1].n)
        return tuple(out)

    def split_for(self, model, sb: SubBatch) -> tuple[int, str]:
        cands = self.candidates(sb)
        if len(cands) == 1:
            if self.no_recompute_reason:
                return 0, self.no_recompute_reason
            return cands[0], ("offload: all K/V fetched" if not self.o.kvpr else
                              f"split store: X of slots [0, {cands[0]}) and K/V of the rest, fixed at prefill")
        s = sb.host_slots
        if self.o.split_point is not None:
            l = max(c for c in cands if c <= min(int(self.o.split_point), s))
            return l, f"forced split point {self.o.split_point} (at the store's boundary {l})"
        key = (s, sb.t_pad, sb.size, cands)
        if key not in self._split_cache:
            g = self.o.gpu_batches if self.o.schedule == "column" else 1
            prob = SplitProblem(shape=self._shape(model), batch=sb.size, s=s, candidates=cands,
                                tail=sb.tail_len + 1, offload_weights=self.o.offload_weights, gpu_batches=g)
            plan = choose_split(prob, self.cost, self.o.objective)
            self._split_cache[key] = (plan.l, plan.reason)
        return self._split_cache[key]

    # -- one decode step ---------------------------------------------------------------------------
    def _items(self, n_layers, n_subs):
        if self.o.schedule == "row":
            return [(i, g) for g in range(n_subs) for i in range(n_layers)]
        items = []
        for i in range(n_layers):
            order = range(n_subs) if i % 2 == 0 else range(n_subs - 1, -1, -1)  # zig-zag
            items += [(i, g) for g in order]
        return items

    def _issue(self, layers, sb: SubBatch, i: int, l: int, weights_cache: dict):
        """Issues every transfer item (i, sb) needs, in KVPR's order; returns what compute needs."""
        o = self.o
        if o.offload_weights and i not in weights_cache:
            kv, rest = split_layer(layers[i])
            weights_cache[i] = [M.to_device(kv, self.dev), rest]  # W_K / W_V first
        x_arrays, pos_specs, rec_specs = [], [], []
        kv_arrays, part_specs = [], []
        for seg in sb.segs[i]:
            gen = seg.start >= sb.t_pad
            if seg.start + seg.n <= l:  # recomputed from X
                x_arrays.append(seg.x)
                pos_specs.append(("gen", seg.start - sb.t_pad) if gen else ("prompt", seg.start))
                rec_specs.append(("gen", seg.n) if gen else ("prompt", seg.start, seg.n))
            else:
                kv_arrays += [seg.k, seg.v]
                part_specs.append(("gen", seg.n) if gen else ("prompt", seg.start, seg.n))
        xs = fetch(x_arrays, self.dev)
        if o.offload_weights and not isinstance(weights_cache[i][1], tuple):
            weights_cache[i][1] = (M.to_device(weights_cache[i][1], self.dev),)
        kvs = fetch(kv_arrays, self.dev)
        return dict(xs=tuple(xs), pos_specs=tuple(pos_specs), rec_specs=tuple(rec_specs),
                    kv_parts=tuple((kvs[2 * j], kvs[2 * j + 1]) for j in range(len(kvs) // 2)),
                    part_specs=tuple(part_specs),
                    bytes_x=sum(_nbytes(a) for a in xs), bytes_kv=sum(_nbytes(a) for a in kvs))

    def decode_step(self, model, state: OffloadState, tokens):
        cfg = model.config
        o = self.o
        now = time.perf_counter()
        if self._last_step_t is not None and self.trace_rows:
            self.trace_rows[-1]["time_s"] = now - self._last_step_t
        self._last_step_t = now
        fam_params = without_layers(model.params)
        layers = self._layers(model) if o.offload_weights else model.params.layers
        subs = state.subs
        tokens = jnp.asarray(tokens, jnp.int32)
        hs, splits = [], []
        for sb in subs:
            pos = (sb.prompt_lens + sb.n_gen)[:, None]
            hs.append(_embed(cfg, fam_params, tokens[sb.rows][:, None], pos))
            splits.append(self.split_for(model, sb))
        items = self._items(cfg.num_layers, len(subs))
        weights_cache: dict = {}
        fetched: dict = {}
        done_h: list = []
        tot = {"bytes_x": 0, "bytes_kv": 0, "bytes_w": 0, "bytes_d2h": 0}
        shape = self._shape(model)
        issued = 0

        def issue(n):
            i, g = items[n]
            new_w = o.offload_weights and i not in weights_cache
            fetched[n] = self._issue(layers, subs[g], i, splits[g][0], weights_cache)
            tot["bytes_x"] += fetched[n]["bytes_x"]
            tot["bytes_kv"] += fetched[n]["bytes_kv"]
            if new_w:
                tot["bytes_w"] += shape.w_layer

        for n, (i, g) in enumerate(items):
            while issued < min(n + 2, len(items)):
                if o.sync_depth and issued - o.sync_depth >= 0 and issued - o.sync_depth < len(done_h):
                    jax.block_until_ready(done_h[issued - o.sync_depth])
                issue(issued)
                issued += 1
            f = fetched.pop(n)
            sb = subs[g]
            if o.offload_weights:
                kvw, rest = weights_cache[i][0], weights_cache[i][1][0]
                lp = join_layer(kvw, rest)
            else:
                lp = layers[i]
                kvw = lp
            rec = ()
            if f["xs"]:
                if o.offload_weights:
                    kvw_only = kvw
                else:
                    kvw_only = split_layer(lp)[0]
                rec = _recompute(cfg, kvw_only, f["xs"], sb.prompt_lens, f["pos_specs"], o.recompute_impl)
            parts = tuple(rec) + f["kv_parts"]
            specs = f["rec_specs"] + f["part_specs"]
            hs[g], sb.tail_k[i], sb.tail_v[i], sb.tail_x[i] = _attend(
                cfg, lp, hs[g], sb.prompt_lens, jnp.int32(sb.n_gen), sb.tail_k[i], sb.tail_v[i], sb.tail_x[i],
                jnp.int32(sb.tail_len), parts, specs, o.attention_impl)
            done_h.append(hs[g])
            del f, parts, rec
            if sb.tail_len + 1 == o.flush_block:  # this layer's tail is full: to the host, asynchronously
                keep_x = self.store_x and o.kvpr_store == "both"
                flush_tail(sb, i, keep_x, o.flush_block)
                tot["bytes_d2h"] += o.flush_block * sb.size * (shape.kv_tok + (shape.x_tok if keep_x else 0))
            if o.offload_weights and not any(items[m][0] == i for m in fetched):
                weights_cache.pop(i, None)  # no issued item needs this layer's weights any more
        for sb in subs:
            sb.tail_len += 1
            if sb.tail_len == o.flush_block:
                sb.tail_len = 0
                sb.n_flushed += o.flush_block
        logits = [_logits(cfg, fam_params, h[:, 0]) for h in hs]
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, 0)
        state.step += 1
        self._record(model, state, splits, tot, shape)
        return logits, state

    # -- trace ---------------------------------------------------------------------------------------
    def _record(self, model, state, splits, tot, shape):
        sb0 = state.subs[0]
        g = len(state.subs)
        s = sb0.host_slots
        l = splits[0][0]
        pred = predict_step(self.cost, model.config, shape, sb0.size, s, l, tail=sb0.tail_len,
                            offload_weights=self.o.offload_weights, gpu_batches=g,
                            policy="kvpr" if self.o.kvpr else "offload")
        row = {"step": state.step, "context": int(sb0.t_pad + sb0.n_gen), "host_slots": s, "split_point": l,
               "split_reason": splits[0][1], "recompute_tokens": int(l * state.batch), **tot,
               "bytes_h2d": tot["bytes_x"] + tot["bytes_kv"] + tot["bytes_w"],
               "predicted_s": pred["step_s"], "predicted_transfer_s": pred["transfer_s"],
               "predicted_gpu_s": pred["gpu_s"], "time_s": None}
        self.last_plan = row
        self.trace_rows.append(row)
        if self.o.trace:
            self.write_trace(self.o.trace)

    def write_trace(self, path):
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"policy": "kvpr" if self.o.kvpr else "offload", "options": dataclasses.asdict(self.o),
                       "cost_model": self.cost.to_json(), "steps": self.trace_rows}, f, indent=1)


@functools.partial(jax.jit, static_argnames=("bounds", "want"))
def _chunks(k, v, x, bounds, want):
    out = []
    for (a, b), (wx, wkv) in zip(bounds, want):
        out.append((k[:, :, a:b] if wkv else None, v[:, :, a:b] if wkv else None,
                    x[:, a:b] if (wx and x is not None) else None))
    return tuple(out)


def _nbytes(a) -> int:
    return int(a.size * a.dtype.itemsize)
