"""One decode step's work items (layer i of GPU batch g, in the schedule's order): each item's transfers issued
ahead of the programs they overlap, its layer program, and the fetched buffers kept alive until their program is
known finished."""

from __future__ import annotations

import functools

import jax

from kvoffload.device import sharding as S
from kvoffload.models.transformer import family
from kvoffload.runtime import layer as layer_program  # looked up per call: probes and tests wrap layer_step there
from kvoffload.runtime.cost import tree_bytes
from kvoffload.runtime.state import join_slots, split_slots
from kvoffload.runtime.weights import join_layer, split_layer


# A decode step's work outside its layer programs, one program each: an eager slice or add is a dispatch of
# its own (~30 us of host on an H100 host), and a host-bound step (a selective policy at batch 1) pays each.
@functools.partial(jax.jit, static_argnames=("cfg",))
def decode_inputs(cfg, params, tokens, next_positions, tail_len):
    """(h [B, 1, H], positions [B, 1], the next step's positions, the tail lengths after this step's token) of a
    decode step's new tokens [B] at next_positions [B] (the counters advanced here: no eager add a step)."""
    positions = next_positions[:, None]
    with jax.named_scope("embed"):
        h = family(cfg).embed(cfg, params, tokens[:, None], positions)
    return h, positions, next_positions + 1, tail_len + 1


@functools.partial(jax.jit, static_argnames=("cfg",))
def decode_logits(cfg, params, h):
    with jax.named_scope("logits"):
        return family(cfg).logits(cfg, params, h[:, 0])


class StepRun:
    """The work items of one decode step over `groups` (their `plans` made), driven from the host: `run` issues
    transfers `lookahead` items ahead of the programs they overlap and dispatches each item's program. hs and
    positions: per GPU batch, the layers' input hidden states (updated) and the new tokens' positions; tails: per
    GPU batch, the tails and slots the programs update."""

    def __init__(self, pipe, model, groups, plans, layers, hs, positions):
        o = pipe.opts
        self.pipe, self.model, self.cfg, self.opts = pipe, model, model.config, o
        self.groups, self.plans, self.layers, self.hs, self.positions = groups, plans, layers, hs, positions
        self.tails = [dict(k=list(gr.tail_k), v=list(gr.tail_v), x=list(gr.tail_x), slots=list(gr.slots))
                      for gr in groups]
        self.items = pipe._items(self.cfg.num_layers, len(groups))
        self.weights: dict = {}
        self.fetched: dict = {}
        self.done_h: list = []
        self.resident = pipe.resident(model)
        self.moved = {"bytes_x": 0, "bytes_kv": 0, "bytes_w": 0, "arrays": 0}
        self.issued = 0
        # layers whose streamed W_K / W_V are gathered whole before their first program: a gather dispatched at
        # issue time (items ahead) would wait on the weights' copy and hold every program dispatched after it
        self.to_gather: set = set()
        # a device pool moves nothing, nor does a host pool read in place (the layer programs gather selected rows
        # themselves): no transfer buffers to bound, the host never waits in the step. Nothing to move (weights on
        # the GPU too): `issue` skips asking for the hooks' empty fetch lists (Python per layer on the host's path)
        self.moves = pipe.fetches() or o.offload_weights
        self.attend = pipe.hooks.attend
        self.options = (o.recompute_impl, o.attention_impl)
        self.sync_depth = o.sync_depth if self.moves else 0
        # a host->GPU copy starts only after every program dispatched before it, so item n + lookahead's copies
        # are issued before item n's program; at most `window` items' buffers are alive: before issuing item m
        # the host waits for item m - window's program (already dispatched, so the GPU never runs dry)
        self.lookahead = max(1, self.sync_depth - 1)
        self.window = self.sync_depth + 1
        self.last_item = {it[0]: m for m, it in enumerate(self.items)}
        # fetched arrays and streamed weights stay referenced until their program is known finished (a buffer
        # freed at dispatch would be handed to the next copy, which would then wait for it)
        self.keep: dict = {}
        self.retired = 0

    def run(self) -> dict:
        """Every item in order; returns what moved (the step record's transfer counts)."""
        for n, (i, g) in enumerate(self.items):
            self.issue_ahead(n)
            self.run_item(n, i, g, self.fetched.pop(n))
        self.moved.update(lookahead_items=self.lookahead)
        return self.moved

    def issue_ahead(self, n: int):
        """Items up to n + lookahead issued, each after the item `window` before it is known finished."""
        while self.issued < min(n + self.lookahead + 1, len(self.items)):
            if self.sync_depth and self.issued - self.window >= 0:
                jax.block_until_ready(self.done_h[self.issued - self.window])
                while self.retired <= self.issued - self.window:
                    self.keep.pop(self.retired, None), self.keep.pop((self.retired, "w"), None)
                    self.retired += 1
            self.issue(self.issued)
            self.issued += 1

    def issue(self, n: int):
        """Item n's transfers: its layer's W_K / W_V (streamed), the early arrays (X), the rest of the weights,
        the late arrays (K/V), as eager puts dispatched before the programs they overlap."""
        i, g = self.items[n]
        if not self.moves:
            self.fetched[n] = ([], [])
            return
        pipe, o, weights, moved, layers = self.pipe, self.opts, self.weights, self.moved, self.layers
        if o.offload_weights and i not in weights:
            kv, rest = split_layer(layers[i])
            if i < self.resident:  # in GPU memory already
                weights[i] = [kv, (rest,)]
            else:
                weights[i] = [pipe.to_device(kv), rest]  # W_K / W_V first
                moved["bytes_w"] += tree_bytes(layers[i])
            if pipe.gathers_kv(self.groups, self.plans, i):  # whole on every device, once for all GPU batches
                self.to_gather.add(i)
        early, late = pipe.hooks.fetch(pipe, self.groups[g], self.plans[g], i)
        early_d = pipe.to_device(early) if early else []
        if o.offload_weights and not isinstance(weights[i][1], tuple):
            weights[i][1] = (pipe.to_device(weights[i][1]),)
        late_d = pipe.to_device(late) if late else []
        moved["bytes_x"] += tree_bytes(early)
        moved["bytes_kv"] += tree_bytes(late)  # as stored: int4 codes and scales
        moved["arrays"] += len(jax.tree.leaves((early, late)))
        self.fetched[n] = (early_d, late_d)

    def run_item(self, n: int, i: int, g: int, f):
        """Item n (layer i of GPU batch g, f its fetched arrays): the layer's own program."""
        pipe, o = self.pipe, self.opts
        if i in self.to_gather:  # the layer's first program is next: its weights are needed now anyway
            self.to_gather.discard(i)
            self.weights[i][0] = S.gather_whole(self.weights[i][0], pipe.mesh)
        lp = join_layer(self.weights[i][0], self.weights[i][1][0]) if o.offload_weights else self.layers[i]
        self.run_layer(n, i, g, lp, f)
        if o.offload_weights and not any(self.items[m][0] == i for m in self.fetched):
            # no issued item needs this layer's weights any more; alive until its last program ends
            w_done = self.weights.pop(i, None)
            if self.sync_depth:
                self.keep[self.last_item[i], "w"] = w_done

    def run_layer(self, n: int, i: int, g: int, lp, f):
        """Layer i of GPU batch g as its own program, after the policy's speculation for layer i + 1."""
        pipe, gr, tl, attend = self.pipe, self.groups[g], self.tails[g], self.attend
        # (no named scope per layer: every layer runs one cached executable, traced once)
        if tl["slots"] and i + 1 < self.cfg.num_layers:  # dispatched before layer i's program, from its input
            tl["slots"][i + 1] = pipe.hooks.speculate(pipe, self.model, gr, i + 1, self.hs[g], self.positions[g],
                                                      tl["slots"][i + 1])
        src = pipe.hooks.sources(pipe, gr, self.plans[g], i, f)
        slot, fixed = split_slots(attend, tl["slots"][i] if tl["slots"] else None)
        self.hs[g], tl["k"][i], tl["v"][i], tl["x"][i], slot = layer_program.layer_step(
            self.cfg, lp, self.hs[g], self.positions[g], tl["k"][i], tl["v"][i], tl["x"][i], gr.tail_len, src,
            gr.tables, slot, fixed, attend, self.options)
        if tl["slots"]:
            tl["slots"][i] = join_slots(attend, slot, fixed)
        del src
        self.done_h.append(self.hs[g])
        if self.sync_depth:
            self.keep[n] = f
