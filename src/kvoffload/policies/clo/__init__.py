"""`clo`: CLO, first version: exact-key top-k attention over a host KV pool with the head-wise
approximate cache, importance-derived per-head thresholds and persistent heads.

Built on the selection machinery shared with `tokenselect` (`kvoffload.policies.selection`: ``kv=split``
placement and `SelectionHooks`, the selection cache in the layer's slots, ``choose_tokens``, the token space,
the rows, ``ops.gather_pool_rows``); what differs:

1. Scoring (``exact_scores``): exact keys, per KV head score_t = max over the group's query heads of
   q.k_t / sqrt(d) (plain attention logits, no softmax vote). Max, not sum: a token one query head of the
   group needs is kept even when the others ignore it (with a sum, raw logits of the heads with the
   largest query norms would decide for the whole group). Top-k by count or ratio, sinks and recent
   tokens forced in (``choose_tokens``).
2. Cache reuse per (request, KV head) iff the group's aggregated query cosine >= tau_i and the pool has
   not grown. Aggregation: the importance-weighted harmonic mean (``group_similarity``, Eq. 10) or the
   min. tau_i = cos(lambda_i arccos(eta) + (1 - lambda_i) pi), lambda_i = s_i^p (``kv_thresholds``), or
   one ``fixed_threshold`` (the ablation). tau, weights and the persistent mask are per layer: they live
   in the layer's slots (``CloSlots``), not in the static attend. ``replay_hit_rate`` (an option shared
   with tokenselect, for random-weight speed runs) replaces a cached head's rule by a seeded Bernoulli draw
   at that rate (`selection.cache.ReplayDraw`; persistent heads keep theirs); tau is still evaluated and counted.
3. Persistent heads select every pool token of the request (their "selection" is the whole context,
   re-made only when the pool grows); layer 0 always (``layer0_full``). A layer whose every head is
   persistent (layer 0 then) is a device layer (``CloHooks.device_layer``): its K/V blocks stay on the GPU in
   the model's dtype and it attends them with `full`'s own ``attend_pool`` (no scores, no top-k, no row
   buffers; ``CloSlots.dense``); so is every sliding-window layer (gemma3), attending its window with the
   window mask. ``persistent_heads="plan"``
   uses ``plan_persistent_heads`` with the shipped profile of the embedded model; "auto" (the default)
   does so where that profile is the model's and keeps none elsewhere (RULER on SmolLM2, exact: -1.3 / -2.6
   points without persistent heads, -0.5 / -0.0 with them).
4. The cache buffer: the selected V rows per (request, KV head) are kept on the GPU in the slots
   (``v_rows``); when every head of a layer hits, nothing is gathered from host memory (on the CPU the
   gather runs under a ``lax.cond``; on the GPU, where a conditional syncs the host, it runs with every
   head's count 0: ``conditionals``). When some head misses, only the missed heads' rows are read and
   written into the buffer in place (``ops.refill_block_rows``; the layer program donates the slots; the
   hit heads' rows stay); ``v_rows_fetched`` counts them. Every per-(request, head) buffer holds one request's tokens at most
   (`request_token_bound`: the longest prompt's full blocks plus one block per flush), not the batch's pool.

5. Retrieval (``retrieval``): ``exact`` scores the exact keys (above). ``quest`` and ``hata`` score GPU-side
   metadata of the keys instead, and the keys themselves stay on the host with the values:
   * ``quest``: per page of ``quest_page_tokens`` tokens inside a block (default 16), the channel-wise
     min and max of the keys (``ops.quest_page_minmax``), stored in the model's dtype (a min / max of keys
     is one of them), or with ``quest_dtype="int8"`` as int8 with one scale per page and head, min rounded
     down and max up so the bound stays an upper bound (``quest_int8``: about half of bf16's bytes, so 32-token
     pages cost the GPU memory of 64-token ones in bf16). Score of a page per KV head: max over the group of Quest's upper bound
     sum_c max(q_c min_c, q_c max_c) (``quest_bounds``, as q+ . max + q- . min over the extents' blocks, each
     block against its owner's query: ``ops.quest_block_bounds``, a Pallas kernel on the GPU); whole pages
     are selected (``choose_tokens`` with page_size = quest_page_tokens).
   * ``hata``: per token a ``hata_bits``-bit sign code of the key (default: the trained weights' width, or 128
     for random projections) (``ops.hata_encode`` with a per-KV-head
     projection W [d, r]: trained from ``kvoffload train-hata``'s output when ``hata_weights`` is given,
     else seeded Gaussian projections, ``plan.deploy.init_projection``, i.e. SimHash). Score per KV
     head: max over the group of r - hamming(code(q), code(k)) (``hata_token_scores``).
   The metadata is computed on the GPU when blocks enter the pool, from the blocks' K while they are
   still in device memory: prefill (every extent) and each flush (`LayerHooks.keys_written`), and kept
   per layer in the slots (``CloSlots.meta``: per extent, [E, n_kv, ...] in block-slot order, so the block
   tables index it like the keys). HATA's W of the layer lives in the slots too (``hata_w``).

Placement: ``exact``: as tokenselect ``kv=split``: K extents in device memory (the exact keys are the
retrieval metadata), V extents in pinned host memory; without speculation the selected K rows are kept in a
GPU buffer too (``k_rows``, `CloHooks.buffers_k`: a hit reads only the buffers). ``quest`` / ``hata``: K and V extents both in
pinned host memory (`Capabilities.keys_on_device` False), only the metadata on the GPU; the selected K rows are
gathered from the host like the V rows, into a second cache buffer (``k_rows``) reused on hits.
Persistent heads' K/V are NOT placed on the GPU separately: they stay in the host pool (K on the GPU
for ``exact``) and their whole context's rows are gathered into the cache buffer on each re-selection
(every flush). The memory plan counts the slots (selection caches, row buffers, metadata).

6. Speculative prefetch (``speculative_prefetch``, default off since measured on an H100: the guess's program
   costs ~0.7 ms of host dispatch a layer and its gather runs on the compute stream after layer l-1, so it
   overlaps nothing and tripled clo's step time at 32K b1 (74.9 vs 26.5 ms, BENCHMARKS); exact, it changes where rows come from, never
   which rows are attended). Before layer l-1's program (`LayerHooks.speculate`, the pipeline's hook), a
   separate program (``speculate_layer``) takes layer l-1's input hidden state through layer l's input norm,
   W_Q and RoPE at the new token's positions: an approximate query of layer l. With it, layer l's reuse rule
   predicts which heads will miss, and for those it selects (the same scoring and top-k as the true query)
   and gathers the guessed rows into layer l's buffers. The slots then track which tokens the buffers hold
   (``held``); layer l's own program selects with the true query and gathers only the rows the buffers lack
   (``refill_rows``: exactly true minus guess for a guessed head; nothing for a hit). The gathers' size is
   static: the smallest of K/16, K/4 or K rows that holds the most any (request, head) lacks, none when
   nothing is missing (``gather_missing``). The guess's hit rate (rows of the fresh selections the buffers
   already held) goes into each step record (device values) and `describe`. On the GPU, whether the guess's
   host gather overlaps layer l-1's compute depends on where XLA runs a gather from pinned host memory (the
   probes found the compute stream): the structure is in place, the overlap is to be measured.
   Indices never leave the device: everything above is inside the two programs.

Scores and top-k per request (all three retrievals, as tokenselect's vote): every pool block is scored once
against its owner's query, and the scores are laid out per request over its own blocks only
(`selection.space.TokenSpace`: [B, n_kv, T], T = the most tokens one request owns), where the top-k runs; the
chosen slots map back to pool token ids. At batch 1 the request's space is the pool's (nothing gathered).

int4 host storage (``host_dtype="int4"``): the host extents (V; for quest / hata also K, unless
``int4_k_quant="native"`` keeps K in the model's dtype) are ``QuantizedInt``; the gathers take the selected
rows' codes and scales (``ops.gather_pool_rows``) and dequantize only those rows on the GPU (`native_extent`);
K extents kept on the GPU (exact) stay in the model's dtype, and the retrieval metadata is computed from the
unquantized keys.

Modules: `retrieval` (scores and key metadata), `rows` (the row buffer's refill), `attend` (a layer's slots and
the policy's attend), `hooks` (`CloHooks`: the per-head rule, the slots, the metadata kept with the keys),
`policy` (`CloPolicy`: options and defaults). The names below are the package's API.
"""

from kvoffload.policies.clo.attend import CloAttend, CloOptionError, CloSlots, rule_array
from kvoffload.policies.clo.hooks import CloHooks, load_importance
from kvoffload.policies.clo.policy import DEFAULT_RATIO, TOPK_MIN, CloPolicy
from kvoffload.policies.clo.retrieval import (
    RETRIEVALS,
    aggregate_similarity,
    exact_scores,
    hata_token_scores,
    key_metadata,
    quest_bounds,
    quest_int8,
    quest_token_scores,
)
from kvoffload.policies.clo.rows import refill_rows

__all__ = ["CloAttend", "CloHooks", "CloOptionError", "CloPolicy", "CloSlots", "DEFAULT_RATIO", "RETRIEVALS",
           "TOPK_MIN", "aggregate_similarity", "exact_scores", "hata_token_scores", "key_metadata", "load_importance",
           "quest_bounds", "quest_int8", "quest_token_scores", "refill_rows", "rule_array"]
