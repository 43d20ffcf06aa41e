"""Fused mode (`PipelineOptions.layers_per_program`): consecutive layers with equal program shapes decoded by one
`layers_step` program, one host call instead of one per layer."""

from __future__ import annotations

import functools

import jax

from kvoffload.runtime.layer import layer_body
from kvoffload.runtime.state import join_slots, split_slots


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "options"), donate_argnames=("tail_k", "tail_v", "tail_x", "slots"))
def layers_step(cfg, lp, h, positions, tail_k, tail_v, tail_x, tail_len, sources, tables, slots, slots_fixed, attend,
                options):
    """Consecutive decode layers in one program (`PipelineOptions.layers_per_program`): lp, tail_k, tail_v,
    tail_x, sources, slots and slots_fixed are tuples, one entry per layer, run in order by `layer_body`; one call
    of the host instead of one per layer. Returns (h, tail_k, tail_v, tail_x, slots), the same tuples updated."""
    out = ([], [], [], [])
    for args in zip(lp, tail_k, tail_v, tail_x, sources, slots, slots_fixed):
        lp_i, tk, tv, tx, src, sl, fx = args
        h, tk, tv, tx, sl = layer_body(cfg, lp_i, h, positions, tk, tv, tx, tail_len, src, tables, sl, fx, attend,
                                       options)
        for lst, val in zip(out, (tk, tv, tx, sl)):
            lst.append(val)
    return (h,) + tuple(tuple(lst) for lst in out)


def run_layers(cfg, batch, h, positions, tail, group, attend, options):
    """h after the queued layers `batch` ((layer, weights, sources) each) of one GPU batch in one `layers_step`
    call; tail (the step's per-layer tails and slots of that batch: lists) updated in place."""
    idx = [b[0] for b in batch]
    moving, fixed = zip(*(split_slots(attend, tail["slots"][i] if tail["slots"] else None) for i in idx))
    h, ks, vs, xs, sls = layers_step(
        cfg, tuple(b[1] for b in batch), h, positions, tuple(tail["k"][i] for i in idx),
        tuple(tail["v"][i] for i in idx), tuple(tail["x"][i] for i in idx), group.tail_len,
        tuple(b[2] for b in batch), group.tables, moving, fixed, attend, options)
    for j, i in enumerate(idx):
        tail["k"][i], tail["v"][i], tail["x"][i] = ks[j], vs[j], xs[j]
        if tail["slots"]:
            tail["slots"][i] = join_slots(attend, sls[j], fixed[j])
    return h
