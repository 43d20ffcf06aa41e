"""Loop mode (`PipelineOptions.loop_layers`): a GPU batch's trailing layers of one program's shapes decoded by ONE
`loop_layers` program, a fori_loop over their state stacked at the end of the prefill (docs/ARCHITECTURE.md "Execution
modes")."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvoffload.runtime.hooks import GroupPlan
from kvoffload.runtime.layer import layer_body, program_key
from kvoffload.runtime.options import LoopLayersError
from kvoffload.runtime.state import (GroupState, LayerStack, StackedLayers, layer_slots, stack_layers, stacked_extent,
                                     with_layer_slots)


def _layer_fixed(fixed, j):
    """Layer j's fixed slots, sliced (a policy's `layer_fixed` may read some in place instead)."""
    return jax.tree.map(lambda a: a[j], fixed)


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "options", "row_stride", "table_stride",
                                             "linear_by_index"), donate_argnames=("st",))
def loop_layers(cfg, lp, st: StackedLayers, fixed, h, positions, tail_len, sources, tables, attend, options,
                row_stride: int = 0, table_stride: tuple = (), linear_by_index: bool = True):
    """The layers of st as one program: a `fori_loop` over `layer_body` with the policy's attend, its weights
    lp [n, ...] by index (linear_by_index: `layer_weights`; else sliced, which XLA copies out), its row buffers
    in place, its fixed slots sliced (or as the policy's `layer_fixed` gives them). sources' pool holds every
    layer's blocks (`LayerStack`): a selection policy
    reads layer j's rows at token ids + j x row_stride (`SelectSources.row_offset`), a policy attending whole
    blocks through the block tables gets extent e's shifted by j x table_stride[e]. The host issues the whole
    stack in one call. Returns (h, st) with st's tails and slots updated (st donated)."""
    from kvoffload.models.common import layer_weights

    def body(j, carry):
        h, now = carry
        lw = layer_weights(lp, j) if linear_by_index else jax.tree.map(lambda a: a[j], lp)
        src = dataclasses.replace(sources, row_offset=(j * row_stride).astype(jnp.int32)) if row_stride else sources
        tbl = tables if not table_stride else dataclasses.replace(
            tables, table=tuple(t + j * stride for t, stride in zip(tables.table, table_stride)))
        fx = None if fixed is None else getattr(attend, "layer_fixed", _layer_fixed)(fixed, j)
        h, k, v, _, m = layer_body(cfg, lw, h, positions, now.tail_k[j], now.tail_v[j], None, tail_len, src, tbl,
                                   layer_slots(now, j), fx, attend, options)
        return h, dataclasses.replace(now, tail_k=now.tail_k.at[j].set(k), tail_v=now.tail_v.at[j].set(v),
                                      moving=with_layer_slots(now, j, m))

    return jax.lax.fori_loop(0, st.tail_k.shape[0], body, (h, st))


class LoopedLayers:
    """`LayerPipeline`'s loop mode: the check before any work, the stacking at the prefill's end and the loop's
    call in a step (the looped layers' flush is `Flush.flush_stack`)."""

    def check_loop(self, layouts):
        """One clear LoopLayersError where `loop_layers` cannot run this plan."""
        why = None
        if self.mesh is not None:
            why = "one device (the looped weights are read by layer index; tensor_parallel=1)"
        elif self.fetches() or self.opts.offload_weights or self.hooks.speculates(self):
            why = ("a step that moves nothing between layers: a device pool or one read in place (a selective "
                   "policy's), weights on the GPU (no offload_weights), no speculative prefetch")
        elif any(lay.extents_of("act") or len({lay.on_device(e) for e in range(lay.num_extents)}) > 1
                 for lay in layouts):
            why = "K/V extents only, all in one memory (no stored activations)"
        else:
            why = self.hooks.loop_refusal(self)
        if why:
            raise LoopLayersError(f"loop_layers needs {why}")

    def stack_group(self, model, gr: GroupState) -> GroupState:
        """gr with its longest run of trailing layers of one program's shapes (`program_key`) as one `LayerStack`:
        tails, slots and pool extents copied into stacked arrays (host extents through host memory), the
        per-layer entries then None. Once, at the end of the prefill."""
        L, n_ext = model.config.num_layers, gr.layout.num_extents
        if any(x is not None for x in gr.tail_x):
            raise LoopLayersError("loop_layers needs no stored activations (the tails hold X)")
        slot = (lambda i: gr.slots[i]) if gr.slots else (lambda i: None)  # noqa: E731
        keys = [program_key((gr.tail_k[i], gr.tail_v[i], slot(i), gr.pool_k[i], gr.pool_v[i])) for i in range(L)]
        first = L - 1
        while first and keys[first - 1] == keys[-1]:
            first -= 1
        if L - first < 2:
            raise LoopLayersError("loop_layers: the last two layers' programs differ (persistent heads?): "
                                  "nothing to loop over")
        idx = range(first, L)
        st, fixed = stack_layers(self.hooks.attend, [gr.tail_k[i] for i in idx], [gr.tail_v[i] for i in idx],
                                 [slot(i) for i in idx])
        by_rows = self.hooks.reads_rows(self)
        if by_rows:  # one extent: layer after layer, each layer's extents in block-id order
            pool_k = (stacked_extent([gr.pool_k[i][e] for i in idx for e in range(n_ext)]),)
            pool_v = (stacked_extent([gr.pool_v[i][e] for i in idx for e in range(n_ext)]),)
        else:  # extent by extent
            pool_k = tuple(stacked_extent([gr.pool_k[i][e] for i in idx]) for e in range(n_ext))
            pool_v = tuple(stacked_extent([gr.pool_v[i][e] for i in idx]) for e in range(n_ext))
        stk = LayerStack(st=st, fixed=fixed, pool_k=pool_k, pool_v=pool_v, first=first,
                         blocks=tuple(gr.layout.size(e) for e in range(n_ext)), by_rows=by_rows,
                         attend=self.hooks.attend)
        none, no_ext = (None,) * (L - first), ((None,) * n_ext,) * (L - first)
        return dataclasses.replace(
            gr, stack=stk, tail_k=gr.tail_k[:first] + none, tail_v=gr.tail_v[:first] + none,
            slots=gr.slots[:first] + none if gr.slots else (), pool_k=gr.pool_k[:first] + no_ext,
            pool_v=gr.pool_v[:first] + no_ext)

    def loop_weights(self, model, first: int):
        """The weights of layers first..L-1 stacked [n, ...] (a copy, made once per model and first layer)."""
        from kvoffload.models.common import stack_trees

        key = (id(model.params), first)
        if key not in self._loop_weights:
            self._loop_weights = {key: stack_trees(self.layers(model)[first:])}
        return self._loop_weights[key]

    def run_stack(self, model, gr: GroupState, plan: GroupPlan, h, positions, stk: LayerStack):
        """(h, stk) after gr's looped layers, one `loop_layers` call (`LayerStack` says how layer j's blocks are
        found)."""
        o, blk = self.opts, gr.layout.block_tokens
        pool_x = gr.pool_x[:stk.first] + ((None,) * len(stk.pool_k),)
        view = dataclasses.replace(gr, pool_k=gr.pool_k[:stk.first] + (stk.pool_k,),
                                   pool_v=gr.pool_v[:stk.first] + (stk.pool_v,), pool_x=pool_x)
        src = self.hooks.sources(self, view, plan, stk.first, ([], []))
        h, st = loop_layers(model.config, self.loop_weights(model, stk.first), stk.st, stk.fixed, h, positions,
                            gr.tail_len, src, gr.tables, self.hooks.attend, (o.recompute_impl, o.attention_impl),
                            row_stride=sum(stk.blocks) * blk if stk.by_rows else 0,
                            table_stride=() if stk.by_rows else stk.blocks)
        return h, dataclasses.replace(stk, st=st)
