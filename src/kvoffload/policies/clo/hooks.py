"""clo's layer hooks (`CloHooks`): the per-head rule from head-importance scores (thresholds, persistent heads),
the slots each layer gets, the metadata written with the keys, speculation and statistics."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from kvoffload.plan.clo import kv_thresholds, load_clo_profile, plan_persistent_heads
from kvoffload.plan.deploy import init_projection, load_projections, load_scores
from kvoffload.policies.clo.attend import (
    CloAttend,
    CloOptionError,
    CloSlots,
    clo_slot_specs,
    guess_rates,
    rule_array,
    speculate_layer,
)
from kvoffload.policies.clo.retrieval import DEFAULT_HATA_BITS, key_metadata_layers
from kvoffload.policies.selection.cache import empty_selection, with_replay
from kvoffload.policies.selection.hooks import SelectionHooks, tree_nbytes
from kvoffload.policies.selection.space import request_token_bound
from kvoffload.runtime.hooks import Capabilities
from kvoffload.runtime.pool import write_block_trees


PRETRAINED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "importance", "pretrained")
SHIPPED_SCORES = os.path.join(PRETRAINED, "smollm2_135m_instruct_head_scores.json")
SHIPPED_PROFILE = os.path.join(PRETRAINED, "smollm2_135m_instruct_clo_profile.json")


def shipped_scores_for(cfg):
    """The shipped head scores when they are the embedded model's and cfg is that model, else None."""
    if not os.path.exists(SHIPPED_SCORES):
        return None
    with open(SHIPPED_SCORES) as f:
        doc = json.load(f)
    same = (doc.get("model_type") == cfg.model_type and doc.get("num_layers") == cfg.num_layers
            and doc.get("num_heads") == cfg.num_heads and doc.get("num_kv_heads") == cfg.num_kv_heads)
    return np.asarray(doc["alpha"], np.float64) if same else None


def load_importance(path):
    """alpha [L, n] from a scores file as `importance/` writes it (head_scores.json or its directory, an
    orbax `scores` directory) or an .npz holding `alpha` (or one array)."""
    if not os.path.exists(path):
        raise CloOptionError(f"importance scores not found: {path}")
    if path.endswith(".npz"):
        with np.load(path) as z:
            if "alpha" not in z.files and len(z.files) != 1:
                raise CloOptionError(f"{path}: expected an array 'alpha' (or a single array), found {z.files}")
            return np.asarray(z["alpha"] if "alpha" in z.files else z[z.files[0]], np.float64)

    return np.asarray(load_scores(path), np.float64)


def head_rule(cfg, importance, eta, p, fixed_threshold):
    """(scores [L, n] as used, tau [L, n_kv], weights [L, n_kv, G], source) for the model."""
    L, H, n_kv = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
    G = H // n_kv
    if importance is not None:
        scores, source = load_importance(importance), importance
    else:
        scores = shipped_scores_for(cfg)
        source = SHIPPED_SCORES
        if scores is None:  # no scores for this model: every head equally (and fully) important, tau = eta
            scores, source = np.ones((L, n_kv)), "uniform (1.0)"
    if scores.ndim != 2 or scores.shape[0] != L or scores.shape[1] not in (n_kv, H):
        raise CloOptionError(f"importance scores must be [{L}, {n_kv}] or [{L}, {H}] for this model, "
                             f"got {scores.shape} ({source})")
    tau = np.full((L, n_kv), float(fixed_threshold)) if fixed_threshold is not None else \
        kv_thresholds(scores, n_kv, eta, p)
    weights = np.repeat(scores[:, :, None], G, -1) if scores.shape[1] == n_kv else scores.reshape(L, n_kv, G)
    return scores, tau, weights, source


class CloHooks(SelectionHooks):
    """The selection hooks (`SelectionHooks`), kv=split, with CLO's slots (tau, weights, persistent heads per layer)."""

    name = "clo"

    option_error = CloOptionError

    def __init__(self, attend: CloAttend, importance, eta, p, fixed_threshold, persistent_heads, layer0_full,
                 hata_weights=None, hata_bits=None, store="kv", replay_hit_rate=None):
        super().__init__(attend, split=True, store=store, replay_hit_rate=replay_hit_rate)
        self.importance, self.eta, self.p, self.fixed_threshold = importance, eta, p, fixed_threshold
        self.persistent_heads, self.layer0_full = persistent_heads, layer0_full
        self.hata_weights, self.hata_bits = hata_weights, hata_bits
        self.chosen: dict = {}  # what init_slots decided for the model (for describe)

    @property
    def capabilities(self) -> Capabilities:
        # exact scores read K on the GPU; quest / hata keep K on the host too, only their metadata on the GPU
        return dataclasses.replace(super().capabilities, keys_on_device=self.attend.retrieval == "exact")

    def speculate(self, pipe, model, group, layer, h, positions, slot):
        if not self.attend.speculative or slot.dense:
            return slot
        src = self.sources(pipe, group, None, layer, None)  # kv=split: the pool's own arrays, nothing fetched
        return speculate_layer(model.config, self.attend, pipe.layers(model)[layer], h, positions, src, group.tables,
                               slot)

    def step_record(self, pipe, groups) -> dict:
        """With speculative prefetch: the step's guess hit rate (fraction of the fresh selections' rows the
        guesses had fetched), overall and per layer, as device values (float() them after the step)."""
        if not self.attend.speculative:
            return {}
        rate, rates = guess_rates([[s.last_guess for s in gr.slots] for gr in groups])
        return {"guess_hit_rate": rate, "guess_hit_rate_per_layer": rates}

    def slot_parts(self, slot) -> dict:
        rows = tree_nbytes((slot.v_rows, slot.k_rows))
        meta = tree_nbytes((slot.meta, slot.hata_w))
        return {"selection cache (query labels, indices, per-head rule)": tree_nbytes(slot) - rows - meta,
                "row buffers (selected K/V rows)": rows, "retrieval metadata": meta}

    def hata_projections(self, cfg):
        """(W [L, n_kv, d, r] f32, source): trained from hata_weights, else seeded Gaussian (SimHash)."""

        L, n_kv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        if self.hata_weights is None:
            self.hata_bits = self.hata_bits or DEFAULT_HATA_BITS
            return np.asarray(init_projection(cfg, self.hata_bits, seed=0)), f"random projections (seed 0, {self.hata_bits} bits)"
        if not os.path.exists(self.hata_weights):
            raise CloOptionError(f"hata_weights not found: {self.hata_weights}")
        w = load_projections(self.hata_weights)
        if w.ndim != 4 or w.shape[:3] != (L, n_kv, d) or w.shape[3] % 32:
            raise CloOptionError(f"hata_weights must be [{L}, {n_kv}, {d}, r] (r a multiple of 32) for this model, "
                                 f"got {w.shape} ({self.hata_weights})")
        if self.hata_bits is not None and w.shape[3] != self.hata_bits:
            raise CloOptionError(f"hata_weights has {w.shape[3]} bits, hata_bits asks for {self.hata_bits}")
        self.hata_bits = int(w.shape[3])  # the trained width (hata_bits not given)
        return w, self.hata_weights

    def keys_written(self, pipe, slots, extent, k_blocks, at):
        r = self.attend.retrieval
        live = [j for j, slot in enumerate(slots) if r != "exact" and not slot.dense]
        if not live:
            return slots
        # every layer's metadata made in one program and written in one (per memory space): the blocks' metadata
        # placed as the extent's (split by head under a mesh) by the write
        new = key_metadata_layers(tuple(k_blocks[j] for j in live), tuple(slots[j].hata_w for j in live), r,
                                   self.attend.page_size, self.attend.quest_dtype)
        written = write_block_trees([slots[j].meta[extent] for j in live], new, at)
        out = list(slots)
        for j, m in zip(live, written):
            meta = slots[j].meta
            out[j] = dataclasses.replace(slots[j], meta=meta[:extent] + (m,) + meta[extent + 1:])
        return tuple(out)

    def persistent_for_stores(self, pipe, model, layout, batch, K):
        scores = head_rule(model.config, self.importance, self.eta, self.p, self.fixed_threshold)[0]
        return self.persistent_mask(pipe, model, scores, layout, batch, K)[0]

    def persistent_mask(self, pipe, model, scores, layout, batch, K):
        """([L, n_kv] bool, the plan's report or None): "auto" plans where a CLO profile of the model exists
        (the shipped SmolLM2 one) and keeps none elsewhere; "plan" requires the profile."""
        cfg = model.config
        L, n_kv = cfg.num_layers, cfg.num_kv_heads
        spec, report = self.persistent_heads, None
        mask = np.zeros((L, n_kv), bool)
        if isinstance(spec, str):
            prof = None
            if spec in ("plan", "auto") and os.path.exists(SHIPPED_PROFILE) and shipped_scores_for(cfg) is not None:
                prof = load_clo_profile(SHIPPED_PROFILE)
                prof = prof if prof.s_hat.shape == (L, n_kv) else None
            if spec == "plan" and prof is None:
                raise CloOptionError(
                    f"persistent_heads='plan' needs a CLO profile of this model; the only shipped one "
                    f"({os.path.basename(SHIPPED_PROFILE)}) is for the embedded SmolLM2-135M-Instruct, and this model "
                    f"({cfg.model_type}, {L} layers, {cfg.num_heads}/{n_kv} heads) differs: pass persistent_heads="
                    "'none' or an explicit list of (layer, kv_head)")
            if prof is not None:
                itemsize = jnp.dtype(model.params.layers[0].wk.dtype).itemsize
                mask, report = plan_persistent_heads(
                    cfg, pipe.cost, pipe.shape(model), prof.s_hat, scores, batch=batch,
                    context=request_token_bound(layout, batch), k_tokens=K, sink=self.attend.num_sink,
                    recent=self.attend.num_recent, dtype_bytes=itemsize, eta=self.eta, p=self.p,
                    devices=pipe.tp)  # tensor parallel: each device's heads against its own link and compute
        else:
            for item in spec:
                try:
                    layer, head = (int(x) for x in item)
                except (TypeError, ValueError):
                    raise CloOptionError(f"persistent_heads entries must be (layer, kv_head) pairs, got {item!r}") from None
                if not (0 <= layer < L and 0 <= head < n_kv):
                    raise CloOptionError(f"persistent head {(layer, head)} out of range: {L} layers, {n_kv} KV heads")
                mask[layer, head] = True
        if self.layer0_full:
            mask[0] = True
        return mask, report

    def slot_maker(self, pipe, model, layout, batch):
        """As `SelectionHooks.slot_maker` asks: the host-side rule (thresholds, persistent heads, HATA projections) decided here,
        the arrays made by the function returned."""
        cfg = model.config
        d = cfg.head_dim
        scores, tau, weights, source = head_rule(cfg, self.importance, self.eta, self.p, self.fixed_threshold)
        K_sel = self.static_budget(layout, batch)
        persistent, report = self.persistent_mask(pipe, model, scores, layout, batch, K_sel)
        bound = request_token_bound(layout, batch)
        dtype = model.params.layers[0].wk.dtype
        w, w_source = self.hata_projections(cfg) if self.attend.retrieval == "hata" else (None, None)
        rates = self.replay_rates(cfg)
        itemsize = jnp.dtype(dtype).itemsize  # one row of V and of K as the host pool stores it
        self.chosen = dict(tau=tau, persistent=persistent, source=source, plan=report, K=K_sel, bound=bound,
                           v_row_bytes=pipe.host_row_bytes(d, itemsize),
                           k_row_bytes=pipe.host_row_bytes(d, itemsize, key=True), hata_source=w_source)

        def make():
            return tuple(self.layer_slots(model, layout, batch, layer, K_sel, bound, tau, weights, persistent, w,
                                          None if rates is None else rates[layer])
                         for layer in range(cfg.num_layers))
        return make

    def slot_specs(self, slot):
        return clo_slot_specs(slot)

    def layer_slots(self, model, layout, batch, layer, K_sel, bound, tau, weights, persistent, w, replay_rate=None):
        """One layer's CloSlots before the first step (replay_rate: the layer's replayed reuse probability)."""
        cfg = model.config
        H, n_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dtype = model.params.layers[0].wk.dtype
        retrieval, page, blk = self.attend.retrieval, self.attend.page_size, layout.block_tokens

        def meta_zeros(E):
            if retrieval == "quest":  # two buffers (donated), and int8 pages' scales
                int8 = self.attend.quest_dtype == "int8"
                pages = tuple(jnp.zeros((E, n_kv, blk // page, d), jnp.int8 if int8 else dtype) for _ in "mM")
                return pages + ((jnp.zeros((E, n_kv, blk // page), jnp.float32),) if int8 else ())
            if retrieval == "hata":
                return (jnp.zeros((E, n_kv, blk, w.shape[-1] // 32), jnp.uint32),)
            return ()
        zeros = lambda shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
        dense = self.device_layer(None, layer)
        # a persistent head selects its whole context; a dense layer selects nothing (its buffers: one row)
        K = 1 if dense else bound if persistent[layer].any() else K_sel
        spec = dict(held=zeros((batch, n_kv, K)), held_valid=zeros((batch, n_kv)), guessed=jnp.zeros((), bool),
                    spec_rows_fetched=zeros((batch, n_kv)), guess_covered=zeros((batch, n_kv)),
                    guess_needed=zeros((batch, n_kv)), last_guess=zeros((2,))) if self.attend.speculative else {}
        selection = empty_selection(batch, H, n_kv, d, K)
        if replay_rate is not None:
            selection = with_replay(selection, replay_rate, layer)
        return CloSlots(selection=selection, v_rows=jnp.zeros((batch, n_kv, K, d), dtype),
                        rule=rule_array(tau[layer], weights[layer], persistent[layer]),
                        meta=tuple(meta_zeros(layout.size(e)) for e in range(layout.num_extents))
                        if retrieval != "exact" and not dense else (),
                        hata_w=None if w is None or dense else jnp.asarray(w[layer], jnp.float32),
                        k_rows=jnp.zeros((batch, n_kv, K, d), dtype) if self.buffers_k(layer) and not dense else None,
                        dense=dense, **spec)

    def buffers_k(self, layer) -> bool:
        """Whether the layer keeps a GPU buffer of its selected K rows: K on the host (quest / hata), and for
        exact (K on the GPU) where the layer stores K/V and does not speculate: an all-hit layer then reads only
        its buffers (no gather over the pool's K extents: on an H100 at 128K that gather was most of a hit's
        cost), and a miss gathers K rows only for its missed heads, from the device extents."""
        if self.attend.retrieval != "exact":
            return True
        store = self.stores[layer] if self.stores else self.store  # before prefill: as asked (auto: the larger)
        return store in ("kv", "auto") and not self.attend.speculative
