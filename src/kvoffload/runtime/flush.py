"""The flush: every block_tokens steps each request's oldest tail tokens become one pool block, every layer's
blocks popped in one program, quantized in one and written in one per extent and memory (lockstep, in place)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.runtime.cost import tree_bytes
from kvoffload.runtime.pool import PoolLayout, quantize_blocks, write_stored_blocks_many
from kvoffload.runtime.state import GroupState


def _pop(tail, blk, axis):
    """(the first blk tail slots of every request, the tail shifted left by blk)."""
    block = jax.lax.slice_in_dim(tail, 0, blk, axis=axis + 1)
    rest = jax.lax.slice_in_dim(tail, blk, tail.shape[axis + 1], axis=axis + 1)
    return block, jnp.concatenate([rest, jnp.zeros_like(block)], axis=axis + 1)


@functools.partial(jax.jit, static_argnames=("blk", "axes"), donate_argnums=(0,))
def _pop_blocks(tails, blk, axes):
    """`_pop` of each of several tails (token axis of a row axes[i]) in one program: (blocks, tails)."""
    popped = [_pop(t, blk, a) for t, a in zip(tails, axes)]
    return tuple(b for b, _ in popped), tuple(t for _, t in popped)


@functools.partial(jax.jit, static_argnames=("specs",))
def _quantize_many(blocks, specs):
    """`quantize_blocks(b, *spec)` of each block array in one program (a flush's every layer)."""
    return tuple(quantize_blocks(b, *spec) for b, spec in zip(blocks, specs))


class Flush:
    """`LayerPipeline`'s flush of the tails into the pool, and how a host pool stores a block (`host_spec`)."""

    def flush(self, gr: GroupState):
        """Every request's oldest blk tail tokens become a new pool block (one per request, lockstep)."""
        layout, blk = gr.layout, gr.layout.block_tokens
        alloc = gr.alloc.copy()
        ids = np.asarray([alloc.allocate(r) for r in range(gr.size)])
        ext_of, slot_of = layout.locate(ids)
        pk, pv, px = [list(p) for p in gr.pool_k], [list(p) for p in gr.pool_v], [list(p) for p in gr.pool_x]
        tk, tv, tx = list(gr.tail_k), list(gr.tail_v), list(gr.tail_x)
        layer_slots = list(gr.slots)
        touched = sorted(set(int(e) for e in ext_of))
        # a slot past the extent's end is dropped: one scatter program per extent size
        slots = {e: np.where(ext_of == e, slot_of, layout.size(e)) for e in touched}
        nbytes = self._flush_layers(gr, touched, ext_of, slots, (pk, pv, px), (tk, tv, tx), layer_slots)
        return dataclasses.replace(
            gr, pool_k=tuple(tuple(p) for p in pk), pool_v=tuple(tuple(p) for p in pv),
            pool_x=tuple(tuple(p) for p in px), tail_k=tuple(tk), tail_v=tuple(tv), tail_x=tuple(tx),
            tail_len=gr.tail_len - blk, tables=alloc.device_tables(layout, self.tables_at), alloc=alloc, since_flush=0,
            slots=tuple(layer_slots)), nbytes

    def _flush_layers(self, gr: GroupState, touched, ext_of, slots: dict, pools, tails, layer_slots) -> int:
        """`flush`'s writes (pools, tails and layer_slots: lists updated in place): every layer's blocks
        popped in one program, quantized in one, written in one per extent and memory space
        (`write_stored_blocks_many`), their key metadata updated by the policy for all of them at once.
        Returns the device->host bytes."""
        layout, blk = gr.layout, gr.layout.block_tokens
        (pk, pv, px), (tk, tv, tx) = pools, tails
        n = len(tk)
        xs = [i for i in range(n) if tx[i] is not None]
        blocks, new_tails = _pop_blocks(tuple(tk[:n]) + tuple(tv[:n]) + tuple(tx[i] for i in xs), blk,
                                        (1,) * (2 * n) + (0,) * len(xs))
        tk[:n], tv[:n] = new_tails[:n], new_tails[n:2 * n]
        for i, t in zip(xs, new_tails[2 * n:]):
            tx[i] = t
        popped = {"k": blocks[:n], "v": blocks[n:2 * n], "x": dict(zip(xs, blocks[2 * n:]))}
        dev = [self.hooks.device_layer(self, i) for i in range(n)]

        def stores(i, e):  # (kind, extent array, stored as computed) of layer i's arrays in extent e
            out = []
            if layout.has("kv", e):
                out += [(kind, pool[i][e], self._stores_native(layout, e, dev[i], kind == "k"))
                        for kind, pool in (("k", pk), ("v", pv)) if pool[i][e] is not None]
            if layout.has("act", e) and i in popped["x"] and px[i][e] is not None:
                out.append(("x", px[i][e], layout.on_device(e)))  # a layer may store X in place of K / V
            return out

        # blocks bound for host memory in some extent: int4 / int8 made once per layer and kind, on the GPU,
        # before they move, every layer in one program (a flushed block is whole: blk tokens of every request)
        want = sorted({(kind, i) for i in range(n) for e in touched for kind, _, native in stores(i, e)
                       if not native and self.host_spec(kind == "k") is not None})
        made = dict(zip(want, _quantize_many(tuple(popped[k][i] for k, i in want),
                                             tuple(self.host_spec(k == "k") for k, _ in want))))
        nbytes = 0
        for e in touched:
            share = int((ext_of == e).sum()) / gr.size  # of the blocks written, those in extent e
            where, exts, new = [], [], []
            for i in range(n):
                for kind, ext, native in stores(i, e):
                    w = popped[kind][i] if native else made.get((kind, i), popped[kind][i])
                    where.append((kind, i)), exts.append(ext), new.append(w)
                    nbytes += 0 if native else int(tree_bytes(w) * share)  # device -> host bytes
            for (kind, i), a in zip(where, write_stored_blocks_many(exts, new, slots[e])):
                {"k": pk, "v": pv, "x": px}[kind][i][e] = a
            if layer_slots and layout.has("kv", e):
                layer_slots[:n] = self.hooks.keys_written(self, tuple(layer_slots[:n]), e, popped["k"], slots[e])
        return nbytes

    def _stores_native(self, layout: PoolLayout, e: int, device_layer: bool, key: bool) -> bool:
        """Whether extent e of a layer stores a flushed K (key) or V block as computed: a device extent or
        layer, or K the policy keeps on the device; else as `host_spec` says."""
        return layout.on_device(e) or device_layer or (key and self.hooks.capabilities.keys_on_device)

    def host_spec(self, key=False):
        """`quantize_blocks`' (group size, scales, bits) of a K (key=True), V or X block / extent as a host pool
        stores it: int4 (K scaled as int4_k_quant says, V and X per token; int8 K codes with
        int4_k_quant="int8"), or None: as it is (native pools; K with int4_k_quant="native")."""
        k_quant, g = self.opts.int4_k_quant, self.opts.int4_group_size
        if not self.int4 or (key and k_quant == "native"):
            return None
        if key and k_quant == "int8":
            return g, "token", 8
        return g, k_quant if key else "token", 4

    def host_form(self, a, key=False):
        """A K (key=True), V or X block / extent as a host pool stores it (`host_spec`)."""
        spec = self.host_spec(key)
        return a if spec is None else quantize_blocks(a, *spec)
