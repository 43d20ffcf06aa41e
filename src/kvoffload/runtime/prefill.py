"""Prefill: the prompts through every layer (row chunks, optionally token chunks), each layer's K/V (and X where
stored) packed into the pool's extents, the partial blocks into the GPU tails, the policy's slots made."""

from __future__ import annotations

import logging
import time
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.device import memory as M
from kvoffload.device import sharding as S
from kvoffload.models.transformer import family, layer_prefill, layer_prefill_chunked
from kvoffload.plan.memory import prefill_chunk_rows
from kvoffload.runtime.cost import flush_possible, tail_slots
from kvoffload.runtime.layer import distinct_arrays, sliding_layers
from kvoffload.runtime.pool import (BlockAllocator, PoolLayout, allocate_prompts_aligned, extent_sources,
                                    gather_act_extent, gather_kv_extent)
from kvoffload.runtime.state import DecodeState, GroupState
from kvoffload.runtime.weights import without_layers


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(cfg, params, tokens, positions):
    return family(cfg).embed(cfg, params, tokens, positions)


_log = logging.getLogger(__name__)  # a token-chunked (long) prefill reports each layer at INFO


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(cfg, params, h):
    return family(cfg).logits(cfg, params, h)


@functools.partial(jax.jit, static_argnames=("cfg", "keep_x", "chunk_tokens", "attention_impl"))
def _layer_prefill(cfg, lp, h, positions, lengths, keep_x, chunk_tokens=None, attention_impl="reference"):
    if chunk_tokens:  # token chunks: a chunk's workspace, not the whole prompt's
        return layer_prefill_chunked(cfg, lp, h, positions, lengths, chunk_tokens, keep_x,
                                     attention_impl=attention_impl)
    h, k, v, x = layer_prefill(cfg, lp, h, positions, lengths)
    return h, k, v, (x if keep_x else None)


@functools.partial(jax.jit, donate_argnums=0)
def _put_row_chunk(bufs, outs, start):
    """A row chunk's layer-prefill outputs (h, k, v, x; x may be None) written into the group's buffers in
    place, at row `start`: the chunks' outputs are never all alive beside a concatenation of them."""
    return jax.tree.map(lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, o, start, 0), bufs, outs)


@jax.jit
def _last_hidden(h, lengths):
    return jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("blk", "slots", "axis"))
def _tail_from_prompt(a, start, blk, slots, axis):
    """Each request's slots [start, start + blk) of a prefill array (axis = the token axis of a row),
    placed at the front of a tail of `slots` slots."""
    part = jax.vmap(lambda t, s: jax.lax.dynamic_slice_in_dim(t, s, blk, axis))(a, start)
    if slots <= blk:
        return jax.lax.slice_in_dim(part, 0, slots, axis=axis + 1)
    pad = [(0, 0)] * part.ndim
    pad[axis + 1] = (0, slots - blk)
    return jnp.pad(part, pad)


class Prefill:
    """`LayerPipeline`'s prefill."""

    def prefill(self, model, tokens, lengths, capacity):
        with S.context(self.mesh):  # the mesh in context: per_shard kernels (GPU) trace per device
            return self._prefill(model, tokens, lengths, capacity)

    def _prefill(self, model, tokens, lengths, capacity):
        cfg = model.config
        o = self.opts
        b, t_pad = tokens.shape
        dtype = model.params.layers[0].wk.dtype
        lengths_np = np.asarray(lengths, np.int64)
        if cfg.has_sliding_layers:
            self.check_sliding()
        self.sliding_layers, self.window = sliding_layers(cfg), cfg.sliding_window
        rows, layouts = self.plan(model, lengths_np, t_pad, capacity)
        fam_params = without_layers(self.params(model))
        layers = self.layers(model)
        lengths = S.put(lengths_np.astype(np.int32), self.rep)  # committed, like a step's outputs
        if self.mesh is not None:  # every process holds the same prompts (jax.distributed: a global array)
            tokens = S.put(tokens, self.rep)
        blk = o.block_tokens
        t_blk = -(-t_pad // blk) * blk
        if t_blk != t_pad:  # whole blocks for the gathers below (pad tokens are never attended)
            tokens = jnp.pad(tokens, ((0, 0), (0, t_blk - t_pad)))
        positions = jnp.broadcast_to(jnp.arange(t_blk, dtype=jnp.int32), (b, t_blk))
        groups = []
        for (a, z), layout in zip(rows, layouts):
            alloc = BlockAllocator(layout.num_blocks, z - a, blk)
            allocate_prompts_aligned(alloc, layout, lengths_np[a:z])
            groups.append(dict(rows=(a, z), layout=layout, alloc=alloc, h=_embed(cfg, fam_params, tokens[a:z], positions[a:z]),
                               pk=[], pv=[], px=[], tk=[], tv=[], tx=[],
                               slots=list(distinct_arrays(self.hooks.init_slots(self, model, layout, z - a))),
                               srcs=[self.local(extent_sources(alloc, layout, e, t_blk // blk))
                                     for e in range(layout.num_extents)],
                               start=self.local(jnp.asarray((lengths_np[a:z] // blk) * blk, jnp.int32))))
        keep_x = any(len(lay.extents_of("act")) for lay in layouts)  # activations stored somewhere
        tail_x = flush_possible(lengths_np, capacity, blk)  # tails keep X only to flush it into blocks
        slots = tail_slots(lengths_np, capacity, blk)
        chunk = prefill_chunk_rows(cfg, dtype, t_blk, o.prefill_workspace_gb, o.prefill_chunk_tokens)
        # token-chunked (long contexts): wait for each layer's extents to reach the host, so one layer's
        # K/V (and its extents) is on the GPU at a time, as the memory plan counts
        depth = 0 if o.prefill_chunk_tokens else o.sync_depth
        pending, t_prefill = [], time.perf_counter()
        for i in range(cfg.num_layers):
            lp = self.to_device(layers[i]) if o.offload_weights else layers[i]
            for gr in groups:
                a, z = gr["rows"]
                bufs = None
                for c in range(a, z, chunk):  # row chunks bound the attention / MLP workspace
                    e = min(z, c + chunk)
                    out = _layer_prefill(cfg, lp, gr["h"][c - a:e - a] if (a, z) != (c, e) else gr["h"],
                                         positions[c:e], lengths[c:e], keep_x, o.prefill_chunk_tokens,
                                         o.prefill_attention_impl)
                    if (a, z) == (c, e):
                        bufs = out
                        break
                    if bufs is None:  # the layer's outputs for the group, filled chunk by chunk
                        bufs = jax.tree.map(lambda t: jnp.zeros((z - a,) + t.shape[1:], t.dtype, device=t.sharding), out)
                    bufs = _put_row_chunk(bufs, out, c - a)
                    del out
                gr["h"], k, v, x = bufs
                del bufs
                pk, pv, px, k_dev = self._extents_from_prefill(gr["layout"], gr["srcs"], gr["alloc"], k, v, x, dtype,
                                                               self.hooks.layer_parts(self, i),
                                                               self.hooks.device_layer(self, i))
                if gr["slots"]:
                    for e, ke in enumerate(k_dev):
                        if ke is not None:
                            gr["slots"][i], = self.hooks.keys_written(self, (gr["slots"][i],), e, (ke,),
                                                                    np.arange(ke.shape[0]))
                del k_dev
                gr["pk"].append(pk), gr["pv"].append(pv), gr["px"].append(px)
                gr["tk"].append(_tail_from_prompt(k, gr["start"], blk, slots, 1))
                gr["tv"].append(_tail_from_prompt(v, gr["start"], blk, slots, 1))
                parts = self.hooks.layer_parts(self, i)
                keep_tx = keep_x and tail_x and (parts is None or "x" in parts)  # X only where the layer stores it
                tx = _tail_from_prompt(x, gr["start"], blk, slots, 0) if keep_tx else None
                if tx is not None and self.mesh is not None:  # split along H (a flush moves a block to its extent's split)
                    tx = M.transfer(tx, S.x_shardings(tx, self.mesh, "device"))
                gr["tx"].append(tx)
                pending.append((gr["tk"][-1], pk, pv, px) if o.prefill_chunk_tokens else gr["tk"][-1])
                if (o.sync_depth or o.prefill_chunk_tokens) and len(pending) > depth:  # bound the device copies alive
                    jax.block_until_ready(pending.pop(0))
                if o.prefill_chunk_tokens:  # each layer waited for above: minutes per layer at 1M tokens
                    _log.info("prefill: layer %d/%d of rows %d-%d on the host after %.1f s", i + 1, cfg.num_layers,
                              a, z, time.perf_counter() - t_prefill)
        states, logits = [], []
        for gr in groups:
            a, z = gr["rows"]
            lens = lengths_np[a:z]
            logits.append(_logits(cfg, fam_params, _last_hidden(gr["h"], lengths[a:z])))
            states.append(GroupState(
                pool_k=tuple(gr["pk"]), pool_v=tuple(gr["pv"]), pool_x=tuple(gr["px"]),
                tables=gr["alloc"].device_tables(gr["layout"], self.tables_at), tail_k=tuple(gr["tk"]), tail_v=tuple(gr["tv"]),
                tail_x=tuple(gr["tx"]), tail_len=S.put(np.asarray(lens % blk, np.int32), self.rep),
                slots=tuple(gr["slots"]),
                rows=(a, z), layout=gr["layout"], alloc=gr["alloc"], tail_base=tuple(int(n) for n in lens % blk),
                n_gen=0, since_flush=0, next_positions=lengths[a:z]))
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, 0)
        return logits, DecodeState(groups=tuple(states), batch=b)

    def _extents_from_prefill(self, layout: PoolLayout, srcs, alloc, k, v, x, dtype, parts=None, on_device=False):
        """One layer's extents: prompt blocks gathered from the prefill's K/V/X, the rest empty; and the
        K extents as computed in device memory, before quantization and placement (for `keys_written`).
        parts: the layer's stored parts (`LayerHooks.layer_parts`; None: all the layout holds). on_device:
        every extent of the layer stays in device memory as computed (`LayerHooks.device_layer`)."""
        keeps = (lambda part: parts is None or part in parts)  # noqa: E731
        blk = layout.block_tokens
        n_kv, d = k.shape[1], k.shape[3]
        hdim = x.shape[2] if x is not None else None  # activations kept only where the layout stores them
        used = alloc.used_extents(layout)
        k_dev_kept = self.hooks.capabilities.keys_on_device
        pk, pv, px, k_dev = [], [], [], []
        for e in range(layout.num_extents):
            src, valid = srcs[e]
            E = layout.size(e)
            # a host extent as the pool stores it: quantized here, on its way to the host, for int4
            to_host = not (layout.on_device(e) or on_device)
            stored = lambda a, h=to_host: self.host_form(a) if h else a  # noqa: E731
            stored_k = lambda a, h=to_host and not k_dev_kept: self.host_form(a, key=True) if h else a  # noqa: E731
            if layout.has("kv", e):
                if e < used:
                    k_dev.append(gather_kv_extent(k, src, valid, blk))
                    pv.append(stored(gather_kv_extent(v, src, valid, blk)))
                else:
                    k_dev.append(jnp.zeros((E, n_kv, blk, d), dtype))
                    pv.append(stored(jnp.zeros((E, n_kv, blk, d), dtype)))
                pk.append(stored_k(k_dev[-1]))
                pk[-1], pv[-1] = (pk[-1] if keeps("k") else None), (pv[-1] if keeps("v") else None)
            else:
                pk.append(None), pv.append(None), k_dev.append(None)
            if layout.has("act", e) and keeps("x"):
                px.append(stored(gather_act_extent(x, src, valid, blk) if e < used else jnp.zeros((E, blk, hdim), dtype)))
            else:
                px.append(None)
        # committed, like the written extents a flush returns (else each first write recompiles); host
        # extents in one asynchronous device->host put of the layer's extents
        on_host = [self.host_pool and not (layout.on_device(e) or on_device) for e in range(layout.num_extents)]
        on_host = ([False] * len(on_host) if k_dev_kept else on_host) + on_host * 2  # K, V, X
        pick = lambda want: [(a if h == want else None) for a, h in zip(pk + pv + px, on_host)]  # noqa: E731
        n = layout.num_extents
        if self.mesh is None:
            host = M.to_host(pick(True), self.dev) if any(on_host) else pick(True)
            dev = jax.device_put(pick(False), M.device_sharding(self.dev))
        else:  # K/V by KV head (each device stores and moves its heads' blocks), X by token or along H
            kv_s, tok = S.kv_sharding(self.mesh), self.x_by_token  # (device/sharding.py)
            hp, dp = pick(True), pick(False)
            host = (M.to_host(hp[:2 * n], kv_s) + M.transfer(hp[2 * n:], S.x_shardings(hp[2 * n:], self.mesh,
                                                                                         self.host_kind, tok))
                    ) if any(on_host) else hp
            dev = (M.transfer(dp[:2 * n], M.device_sharding(kv_s))
                   + M.transfer(dp[2 * n:], S.x_shardings(dp[2 * n:], self.mesh, "device", tok)))
        both = [hh if h else dd for hh, dd, h in zip(host, dev, on_host)]
        return tuple(both[:n]), tuple(both[n:2 * n]), tuple(both[2 * n:]), k_dev
