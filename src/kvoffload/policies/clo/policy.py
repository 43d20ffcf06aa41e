"""The `clo` policy: its options, their checks and defaults (`CloPolicy.make_hooks`), and `describe`."""

from __future__ import annotations

import math

import jax
import numpy as np

from kvoffload.errors import warn_accuracy
from kvoffload.policies.base import register_policy
from kvoffload.policies.clo.attend import CloAttend, CloOptionError
from kvoffload.policies.clo.hooks import CloHooks
from kvoffload.policies.clo.retrieval import AGGREGATIONS, QUEST_DTYPES, RETRIEVALS, SCORING
from kvoffload.policies.layered import LayeredPolicy
from kvoffload.policies.options import Option
from kvoffload.policies.selection.cache import conditionals_default, hit_rates, replay_rates
from kvoffload.policies.selection.options import (
    SELECTION_RUN_OPTIONS,
    SELECTION_WINDOW_OPTIONS,
    check_store,
    check_topk_method,
    selection_budget,
)


DEFAULT_RATIO = 0.1
# The fewest tokens a ratio selects, per retrieval. 10% of a 2K context is 205 tokens: exact top-k keeps 0.83 of
# the attention mass there and Quest's whole pages 0.66 (kvoffload.eval.selection_recall); on the development set
# (RULER seed 42, both templates) Quest at 10% lost 9-13 points at 2K, at 1024 tokens 1.5-3.3 at 4K, at 2048
# within 1 point; exact top-k within 1 point with 1024, not without (BENCHMARKS.md, the budget floor). Past
# 10-20K tokens the ratio selects more than these and they are inert: the long-context speed figures stand.
TOPK_MIN = {"exact": 1024, "quest": 2048, "hata": 2048}


@register_policy("clo")
class CloPolicy(LayeredPolicy):
    host_pool = True  # V (and for quest / hata K) extents in pinned host memory; exact: K on the device
    host_dtypes = ("native", "int4")  # int4: the host extents quantized, the gathered rows dequantized on the GPU
    int4_k_quant_default = "token"  # rows are gathered one by one (`LayeredPolicy.int4_k_quant_default`)
    streams_weights = False
    option_error = CloOptionError
    hook_options = (
        Option("retrieval", "choice", "how tokens are scored: exact q.k, Quest page bounds, HATA hash codes",
               choices=RETRIEVALS),
        Option("quest_page_tokens", "int", "quest: tokens per page (divides block_tokens)", low=1),
        Option("quest_dtype", "choice", "quest: page metadata in the keys' dtype or int8", choices=QUEST_DTYPES),
        Option("hata_bits", "int", "hata: hash bits (a multiple of 32); none: the weights' width, else 128", low=32),
        Option("hata_weights", "path", "hata: trained projections from `kvoffload train-hata`; none: random"),
        Option("topk", "int", "tokens selected per head (none: topk_ratio, default 0.1 of the context)", low=1),
        Option("topk_ratio", "float", "tokens selected per head as a share of the context", low=0, high=1,
               low_open=True),
        Option("topk_min", "int", "with a ratio: the fewest tokens selected (none: 1024 for exact, 2048 for quest "
               "and hata)", low=0),
        *SELECTION_WINDOW_OPTIONS,
        Option("importance", "path", "head-importance scores from `kvoffload train-importance`; none: shipped"),
        Option("eta", "float", "reuse-threshold curve: the cosine of the least important head", low=-1, high=1),
        Option("p", "float", "reuse-threshold curve exponent", low=0, low_open=True),
        Option("fixed_threshold", "float", "one reuse threshold for every head (in place of the curve)"),
        Option("gqa_aggregation", "choice", "how a KV group's query similarities combine", choices=AGGREGATIONS),
        Option("persistent_heads", "pairs", "heads that keep all their tokens: auto, none, plan (a CLO profile)",
               choices=("auto", "none", "plan")),
        Option("layer0_full", "bool", "layer 0 attends all its tokens as `full` does"),
        Option("speculative_prefetch", "bool", "gather the next layer's guessed rows ahead"),
        *SELECTION_RUN_OPTIONS,
    )

    def make_hooks(self, retrieval="exact", quest_page_tokens=16, quest_dtype="keys", hata_bits=None, hata_weights=None, topk=None, topk_ratio=None, num_sink=4, num_recent=64, importance=None,
                   eta=0.8, p=3.0, fixed_threshold=None, gqa_aggregation="harmonic", persistent_heads="auto",
                   layer0_full=True, speculative_prefetch=False, store="kv", replay_hit_rate=None, conditionals=None,
                   topk_method="auto", topk_min=None):
        if retrieval not in RETRIEVALS:
            raise CloOptionError(f"retrieval must be one of {RETRIEVALS}, got {retrieval!r}")
        blk = self.options.block_tokens
        page = int(quest_page_tokens) if retrieval == "quest" else 1
        if page < 1 or blk % page:
            raise CloOptionError(f"quest_page_tokens must divide block_tokens ({blk}), got {quest_page_tokens}")
        if quest_dtype not in QUEST_DTYPES:
            raise CloOptionError(f"quest_dtype must be one of {QUEST_DTYPES}, got {quest_dtype!r}")
        if quest_dtype != "keys" and retrieval != "quest":
            raise CloOptionError(f"quest_dtype={quest_dtype} sets Quest's page metadata: it needs retrieval=quest, "
                                 f"got retrieval={retrieval}")
        hata_bits = None if hata_bits is None else int(hata_bits)  # None: the weights' width, else 128
        if hata_bits is not None and (hata_bits < 32 or hata_bits % 32):
            raise CloOptionError(f"hata_bits must be a positive multiple of 32 (packed uint32 words), got {hata_bits}")

        if gqa_aggregation not in AGGREGATIONS:
            raise CloOptionError(f"gqa_aggregation must be one of {AGGREGATIONS}, got {gqa_aggregation!r}")
        if topk_min is None:  # the retrieval's floor (`TOPK_MIN`); a fixed topk has none
            topk_min = TOPK_MIN[retrieval] if topk is None else 0
        if retrieval == "quest" and (topk_min < TOPK_MIN["quest"] if topk is None else int(topk) < TOPK_MIN["quest"]):
            warn_accuracy(f"clo retrieval=quest selecting fewer than {TOPK_MIN['quest']} tokens at short contexts: "
                          "at 10% of 2K it lost 9-13 RULER points against `full`, with 1024 tokens 1.6-3.3 at 4K "
                          "(development set; BENCHMARKS.md, the budget floor); its default floor is "
                          f"topk_min={TOPK_MIN['quest']}")
        if retrieval == "hata" and hata_weights is None:
            warn_accuracy("clo retrieval=hata without hata_weights scores by random projections, which lost "
                          "15-20 RULER points against `full` on held-out data (BENCHMARKS.md, held-out accuracy); "
                          "train codes for the model with `kvoffload train-hata` and pass hata_weights=DIR")
        topk, topk_ratio, num_sink, num_recent, topk_min = selection_budget(
            topk, topk_ratio, num_sink, num_recent, default_ratio=DEFAULT_RATIO, names=("topk", "topk_ratio"),
            error=CloOptionError, token_min=topk_min, min_name="topk_min")
        if not -1 <= float(eta) <= 1 or float(p) <= 0:
            raise CloOptionError(f"eta must be a cosine in [-1, 1] and p > 0, got eta={eta}, p={p}")
        if fixed_threshold is not None and not math.isfinite(float(fixed_threshold)):
            raise CloOptionError(f"fixed_threshold must be a finite number, got {fixed_threshold}")
        if isinstance(persistent_heads, str) and persistent_heads not in ("none", "plan", "auto"):
            raise CloOptionError(f"persistent_heads must be 'auto', 'none', 'plan' or a list of (layer, kv_head), "
                                 f"got {persistent_heads!r}")
        check_store(store, CloOptionError)
        replay_rates(replay_hit_rate, error=CloOptionError)  # the values; their number once the model is known
        if speculative_prefetch not in (True, False):
            raise CloOptionError(f"speculative_prefetch must be true or false, got {speculative_prefetch!r}")
        conditionals = conditionals_default(conditionals, CloOptionError)
        check_topk_method(topk_method, CloOptionError)
        attend = CloAttend(token_budget=topk, token_ratio=topk_ratio,
                           num_sink=num_sink, num_recent=num_recent, gqa_aggregation=gqa_aggregation,
                           page_size=page, retrieval=retrieval, quest_dtype=quest_dtype,
                           speculative=bool(speculative_prefetch),
                           conditionals=conditionals, topk_method=topk_method, token_min=topk_min)
        return CloHooks(attend=attend, importance=importance, eta=float(eta), p=float(p),
                        fixed_threshold=None if fixed_threshold is None else float(fixed_threshold),
                        persistent_heads=persistent_heads, layer0_full=bool(layer0_full),
                        hata_weights=hata_weights, hata_bits=hata_bits, store=store, replay_hit_rate=replay_hit_rate)

    def describe(self, state=None) -> dict:
        d = super().describe(state)
        h = self.pipeline.hooks
        a = h.attend
        c = {"retrieval": a.retrieval, "topk": a.token_budget, "topk_ratio": a.token_ratio, "topk_min": a.token_min,
             "num_sink": a.num_sink,
             "num_recent": a.num_recent, "eta": h.eta, "p": h.p, "fixed_threshold": h.fixed_threshold,
             "gqa_aggregation": a.gqa_aggregation, "scoring": SCORING[a.retrieval], "conditionals": a.conditionals,
             "topk_method": a.topk_method,
             "kv": "split: K on the GPU, V on the host" if a.retrieval == "exact" else
                   "host: K and V on the host, retrieval metadata on the GPU", **h.replay_description()}
        if a.retrieval == "quest":
            c.update(quest_page_tokens=a.page_size, quest_dtype=a.quest_dtype)
        if a.retrieval == "hata":
            c.update(hata_bits=h.hata_bits, hata_weights=h.chosen.get("hata_source"))
        if h.chosen:
            ch = h.chosen
            c.update(importance=ch["source"], tau=[[round(float(x), 6) for x in row] for row in ch["tau"]],
                     persistent_heads=[list(map(int, x)) for x in np.argwhere(ch["persistent"])],
                     selected_per_head=ch["K"], persistent_tokens_per_head=ch["bound"],
                     device_layers=[int(x) for x in np.flatnonzero(h.device_layers)],
                     sliding_device_layers=[int(x) for x in np.flatnonzero(h.sliding_layers)],
                     persistent_v_placement="a layer whose every head is persistent (device_layers: layer 0 with "
                                            "layer0_full): its K/V blocks in GPU memory, attended whole as `full` "
                                            "does; another layer's persistent heads: V in the host pool (gathered "
                                            "whole on re-selection), K on the GPU",
                     sliding_placement="a sliding-window layer is a device layer (sliding_device_layers): no "
                                       "selection, its K/V blocks in GPU memory, its window attended as `full` does")
            if ch["plan"] is not None:
                c["plan"] = {k: ch["plan"][k] for k in ("n_d", "n_p", "n_persist", "n_kept", "total_bytes")}
        if state is not None and state.groups and state.groups[0].slots:
            c.update(hit_rates(state))  # persistent heads count no hits (they re-select only at a flush)
            # heads that may reuse a cached selection: not persistent, not in a device layer (which selects nothing)
            cached = ~h.chosen["persistent"] & ~np.asarray(h.device_layers, bool)[:, None]
            per_head = np.asarray(c["hit_rate_per_layer_head"])
            c["hit_rate_cached_heads"] = float(per_head[cached].mean()) if cached.any() else None
            by_group = [gr.slots for gr in state.groups]

            def per_layer_head(field):  # [L, n_kv] summed over requests and GPU batches
                return sum(np.stack([np.asarray(getattr(s, field)).sum(0) for s in sl]) for sl in by_group)

            # store=act layers read X rows (counted below), no V (K) row crosses: their row counters count nothing
            kv_layer = np.asarray([s != "act" for s in h.stores] if h.stores else [True] * len(h.chosen["tau"]))
            rows = per_layer_head("v_rows_fetched") * kv_layer[:, None]
            if a.speculative:  # the rows the guesses gathered, beside those each layer's own program gathered
                spec = per_layer_head("spec_rows_fetched") * kv_layer[:, None]
                covered, needed = per_layer_head("guess_covered"), per_layer_head("guess_needed")
                c["speculative_prefetch"] = {
                    "guess_hit_rate": float(covered.sum() / needed.sum()) if needed.sum() else None,
                    "guess_hit_rate_per_layer": [round(float(x), 4) if n else None for x, n in
                                                 zip(covered.sum(1) / np.maximum(needed.sum(1), 1), needed.sum(1))],
                    "v_bytes_fetched_by_guesses": int(spec.sum()) * h.chosen["v_row_bytes"],
                    "v_bytes_fetched_after_guesses": int(rows.sum()) * h.chosen["v_row_bytes"]}
                rows = rows + spec
            nbytes = rows.astype(np.int64) * h.chosen["v_row_bytes"]
            c["v_bytes_fetched"] = int(nbytes.sum())
            c["v_bytes_fetched_per_layer"] = [int(x) for x in nbytes.sum(1)]
            c["v_bytes_fetched_cached_heads"] = int(nbytes[cached].sum())
            if a.retrieval != "exact":  # the same rows of K (as stored) gathered from the host beside V
                c["k_bytes_fetched"] = int(rows.astype(np.int64).sum()) * h.chosen["k_row_bytes"]
            # GPU-resident retrieval state: the metadata of every extent (slots' meta) and HATA's W
            slots = [s for sl in by_group for s in sl]
            c["metadata_gpu_bytes"] = int(sum(x.nbytes for s in slots for x in jax.tree.leaves(s.meta)))
            c["hata_w_gpu_bytes"] = int(sum(s.hata_w.nbytes for s in slots if s.hata_w is not None))
            c["metadata_placement"] = "per layer in the slots (CloSlots.meta), device memory"
        c.update(h.store_report(state))
        d["clo"] = c
        return d
