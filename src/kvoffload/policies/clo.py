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
   buffers; ``CloSlots.dense``). ``persistent_heads="plan"``
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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.errors import warn_accuracy
from kvoffload.models.transformer import family
from kvoffload.device import sharding as S
from kvoffload.runtime.attention import attend_pool, native_extent
from kvoffload.runtime.hooks import Capabilities
from kvoffload.runtime.pool import write_blocks_many
from kvoffload.plan.clo import kv_thresholds, load_clo_profile, plan_persistent_heads
from kvoffload.plan.deploy import (
    encode_keys,
    encode_queries,
    group_similarity,
    init_projection,
    load_projections,
    load_scores,
)
from kvoffload.policies.base import register_policy
from kvoffload.policies.layered import LayeredPolicy
from kvoffload.policies.options import Option, PolicyOptionError
from kvoffload.policies.selection.cache import (
    SelectionCache,
    cache_decision,
    conditionals_default,
    constrain_slots,
    empty_selection,
    hit_rates,
    query_cosines,
    replay_rates,
    reuse_or_select,
    selection_specs,
    unless_all,
    with_replay,
)
from kvoffload.policies.selection.choose import NEG_INF, choose_tokens
from kvoffload.policies.selection.hooks import SelectionHooks, tree_nbytes
from kvoffload.policies.selection.options import (
    SELECTION_RUN_OPTIONS,
    SELECTION_WINDOW_OPTIONS,
    check_store,
    check_topk_method,
    selection_budget,
    selection_size,
)
from kvoffload.policies.selection.rows import HostRows, rows_attention
from kvoffload.policies.selection.space import (
    TokenSpace,
    pool_block_tokens,
    request_token_bound,
    sorted_positions,
    tier_index,
    token_space,
)

RETRIEVALS = ("exact", "quest", "hata")
QUEST_DTYPES = ("keys", "int8")  # the pages' min / max: in the keys' dtype, or int8 with a scale per page
SCORING = {"exact": "max over the group of q.k", "quest": "max over the group of the page's Quest bound",
           "hata": "max over the group of bits - hamming(code(q), code(k))"}
AGGREGATIONS = ("harmonic", "min")
DEFAULT_RATIO = 0.1
# The fewest tokens a ratio selects, per retrieval. 10% of a 2K context is 205 tokens: exact top-k keeps 0.83 of
# the attention mass there and Quest's whole pages 0.66 (kvoffload.eval.selection_recall); on the development set
# (RULER seed 42, both templates) Quest at 10% lost 9-13 points at 2K, at 1024 tokens 1.5-3.3 at 4K, at 2048
# within 1 point; exact top-k within 1 point with 1024, not without (BENCHMARKS.md, the budget floor). Past
# 10-20K tokens the ratio selects more than these and they are inert: the long-context speed figures stand.
TOPK_MIN = {"exact": 1024, "quest": 2048, "hata": 2048}
DEFAULT_HATA_BITS = 128  # random projections without hata_weights (trained weights bring their own width)
PRETRAINED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "importance", "pretrained")
SHIPPED_SCORES = os.path.join(PRETRAINED, "smollm2_135m_instruct_head_scores.json")
SHIPPED_PROFILE = os.path.join(PRETRAINED, "smollm2_135m_instruct_clo_profile.json")


class CloOptionError(PolicyOptionError):
    """A clo option out of range, not supported, or not applicable to the model."""


@dataclasses.dataclass(frozen=True)
class CloSlots:
    """One layer's slots: the selection cache (`SelectionCache`), the GPU cache buffer of the selected V rows
    (and K rows where K is on the host), the layer's per-KV-head reuse rule (tau, aggregation weights,
    persistent: one array, `rule_array`) and the GPU-side retrieval metadata of the layer's pool (quest / hata)."""

    selection: SelectionCache
    v_rows: jax.Array  # [B, n_kv, K, d]: the selected V rows (pool dtype), on the GPU
    # [n_kv, G + 2] f32 per KV head: tau, the G query heads' importance weights in the GQA aggregation,
    # persistent (1 / 0). One leaf, read by every layer call (three cost ~9 us more a call on the host)
    rule: jax.Array
    # per extent, the pool's retrieval metadata in block-slot order: quest (min, max) [E, n_kv, blk/page, d]
    # (model dtype) or, quest_dtype int8, (min, max int8, scale [E, n_kv, blk/page] f32), hata (codes [E, n_kv,
    # blk, r/32] uint32,); () for exact
    meta: tuple = ()
    hata_w: jax.Array | None = None  # [n_kv, d, r] f32: the layer's HATA projections (hata only)
    k_rows: jax.Array | None = None  # [B, n_kv, K, d]: the selected K rows where K is on the host
    # speculative prefetch only (None without): the tokens whose rows the buffers hold, in buffer order (the
    # last selection, or a speculative guess), whether this step's guess was made, and counters
    held: jax.Array | None = None  # [B, n_kv, K] int32, the first held_valid entries valid (ascending)
    held_valid: jax.Array | None = None  # [B, n_kv] int32
    guessed: jax.Array | None = None  # [] bool: a guess was made for this layer this step (cleared by attend)
    spec_rows_fetched: jax.Array | None = None  # [B, n_kv] int32: rows gathered by the guesses
    guess_covered: jax.Array | None = None  # [B, n_kv] int32: rows of fresh selections already held
    guess_needed: jax.Array | None = None  # [B, n_kv] int32: rows of fresh selections after a guess
    last_guess: jax.Array | None = None  # [2] int32: (covered, needed) of the last step
    # static: every head of the layer is persistent; its K/V blocks stay on the GPU (`CloHooks.device_layer`) and
    # it attends them as `full` does: no scores, no selection, no row buffers (theirs are one row)
    dense: bool = False

    # what `hit_rates` reads
    hits = property(lambda self: self.selection.hits)
    steps = property(lambda self: self.selection.steps)
    scored = property(lambda self: self.selection.scored)
    replay = property(lambda self: self.selection.replay)
    rule_hits = property(lambda self: self.selection.rule_hits)
    v_rows_fetched = property(lambda self: self.selection.rows_fetched)  # [B, n_kv]: V rows gathered on misses
    # the reuse rule's parts
    tau = property(lambda self: self.rule[..., 0])  # [n_kv] f32
    weights = property(lambda self: self.rule[..., 1:-1])  # [n_kv, G] f32
    persistent = property(lambda self: self.rule[..., -1] > 0.5)  # [n_kv] bool


def rule_array(tau, weights, persistent) -> jax.Array:
    """CloSlots.rule: [n_kv, G + 2] f32 of tau [n_kv], the aggregation weights [n_kv, G], persistent [n_kv]."""
    tau, weights = jnp.asarray(tau, jnp.float32), jnp.asarray(weights, jnp.float32)
    return jnp.concatenate([tau[:, None], weights, jnp.asarray(persistent, jnp.float32)[:, None]], axis=1)


jax.tree_util.register_dataclass(CloSlots, data_fields=[f.name for f in dataclasses.fields(CloSlots) if f.name != "dense"],
                                 meta_fields=["dense"])


def clo_slot_specs(slots: CloSlots) -> CloSlots:
    """Where a layer's CloSlots live on a tensor-parallel mesh (PartitionSpecs in their place): everything per
    KV head split by head with the K/V it comes from -- the selection cache and its counts (`selection_specs`),
    the row buffers and the guesses' counters (axis 1), the metadata of every extent ([E, n_kv, ...]: axis 1),
    the per-head rule (`rule`: tau, weights, persistent) and HATA's W (axis 0); step flags replicated. A
    persistent head's buffers are the layer's whole-capacity ones (K = the request bound for every head of a
    layer with one): each device's shapes are equal and static whichever of its heads persist."""
    heads, by_head, rep = S.KV_SPEC, S.P(S.MODEL), S.REPLICATED
    opt = lambda a, spec: None if a is None else spec  # noqa: E731
    return CloSlots(selection=selection_specs(slots.selection), v_rows=heads, rule=by_head,
                    meta=jax.tree.map(lambda _: heads, slots.meta),
                    hata_w=opt(slots.hata_w, by_head), k_rows=opt(slots.k_rows, heads), held=opt(slots.held, heads),
                    held_valid=opt(slots.held_valid, heads), guessed=opt(slots.guessed, rep),
                    spec_rows_fetched=opt(slots.spec_rows_fetched, heads),
                    guess_covered=opt(slots.guess_covered, heads), guess_needed=opt(slots.guess_needed, heads),
                    last_guess=opt(slots.last_guess, rep), dense=slots.dense)


def exact_scores(q, keys, tables, space: TokenSpace | None = None, skip=None):
    """[B, n_kv, T] f32 over the token space (`token_space`; default the pool's, T = N in block-id order):
    max over each KV head's query heads of q.k / sqrt(d); -inf where the request owns no token.
    keys: per extent [E, n_kv, blk, d]. Each extent's blocks go to the scores kernel as a batch of E, each
    with its owner's query: one read of K in place, no transpose of it (the einsum of q against the extent
    made XLA transpose the whole extent first: 80 us a layer at 32K on an H100, more than the scores
    themselves), and no request scores another's blocks (1x the pool's flops at any batch).
    skip [B, n_kv] bool (optional): heads whose scores are not needed (they reuse their selection): the
    kernel reads none of their keys (their scores come back -inf)."""
    blk = keys[0].shape[2]
    space = token_space(tables, blk) if space is None else space
    qb = space.owner_rows(q)
    lengths = None if skip is None else space.owner_rows(jnp.where(skip, 0, blk).astype(jnp.int32))  # [blocks, n_kv]
    out, start = [], 0
    for k in keys:
        E = k.shape[0]
        out.append(ops.topk_scores_exact(qb[start:start + E].astype(k.dtype), k,
                                         None if lengths is None else lengths[start:start + E], group_reduce="max"))
        start += E
    return space.per_request(jnp.concatenate(out))


def quest_bounds(q, kmin, kmax, scale=None, owner=None, active=None):
    """[E, n_kv, P] f32: per page, max over each KV head's query heads of Quest's upper bound
    sum_c max(q_c min_c, q_c max_c) = q+ . max + q- . min (`ops.quest_block_bounds`: the kernel on the GPU).
    owner None: q [E, H, d], each block's query; else q [B, H, d] and owner [E] each block's request.
    kmin, kmax [E, n_kv, P, d]; int8 pages (``quest_int8``) with their scale [E, n_kv, P], applied to the
    page's dot products (a scale per page factors out of the sum over channels: no dequantized copy).
    Operands in q's dtype (the model's), products and sums in f32: int8 pages are exact in bf16, and bf16
    operands took half the f32 form's time on an H100 in XLA's matmul form (2026-11-27). active [B, n_kv]
    or None: an inactive (request, head) gets -inf and its pages are not read."""
    if owner is None:
        owner = jnp.arange(kmin.shape[0], dtype=jnp.int32)
    return ops.quest_block_bounds(q, owner, kmin, kmax, scale, active=active)


def quest_int8(kmin, kmax):
    """One scale per page and head, (qmin, qmax) int8 [..., P, d] and scale f32 [..., P], with
    qmin * scale <= kmin and qmax * scale >= kmax channel by channel (min rounded down, max up): the bound
    over the dequantized pages stays an upper bound of every key's q.k, only looser, by at most one step
    (the page's largest |key| / 126) per channel. Pages are finite: metadata is taken of whole blocks."""
    kmin, kmax = kmin.astype(jnp.float32), kmax.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(kmin), -1), jnp.max(jnp.abs(kmax), -1))
    scale = jnp.where(amax > 0, amax / 126.0, 1.0)  # 126: |k| / scale stays inside int8 through rounding
    s = scale[..., None]
    qmin, qmax = jnp.floor(kmin / s), jnp.ceil(kmax / s)
    # the division may land just past an integer (kmin / scale = -126 exactly gave -126.00001 -> -127 on an H200)
    # and the product q * scale may round past the key (the channel of the page's largest |key|, by an ulp): fix
    # both in the arithmetic the bound is used in, so q is the tightest integer whose q * scale bounds the key
    qmin = jnp.where((qmin + 1) * s <= kmin, qmin + 1, qmin)
    qmin = jnp.where(qmin * s > kmin, qmin - 1, qmin)
    qmax = jnp.where((qmax - 1) * s >= kmax, qmax - 1, qmax)
    qmax = jnp.where(qmax * s < kmax, qmax + 1, qmax)
    return jnp.clip(qmin, -127, 127).astype(jnp.int8), jnp.clip(qmax, -127, 127).astype(jnp.int8), scale


def quest_token_scores(q, meta, tables, blk, space: TokenSpace | None = None, active=None):
    """[B, n_kv, T] f32 over the token space (default the pool's): each token its page's bound
    (``quest_bounds``, each block against its owner's query); -inf where the request owns no token.
    meta: per extent (kmin, kmax) [E, n_kv, P, d] or their int8 form (``quest_int8``); active: `quest_bounds`'."""
    space = token_space(tables, blk) if space is None else space
    out, start = [], 0
    for m in meta:  # (kmin, kmax) or (qmin, qmax, scale)
        E, P = m[0].shape[0], m[0].shape[2]
        bounds = quest_bounds(q, *m, owner=space.owner[start:start + E], active=active)  # against its owner's query
        out.append(jnp.repeat(bounds, blk // P, axis=-1))  # [E, n_kv, blk]
        start += E
    return space.per_request(jnp.concatenate(out))


def hata_token_scores(q, meta, w, tables, space: TokenSpace | None = None):
    """[B, n_kv, T] f32 over the token space (default the pool's): max over each KV head's query heads of
    r - hamming(code(q), code(k)) (codes by ``ops.hata_encode`` with the head's W [n_kv, d, r]), each block
    against its owner's query; -inf where the request owns no token. meta: per extent (codes [E, n_kv, blk,
    r/32],)."""

    B, H, d = q.shape
    n_kv, r = w.shape[0], w.shape[-1]
    blk = meta[0][0].shape[2]
    space = token_space(tables, blk) if space is None else space
    qc = space.owner_rows(encode_queries(w, q, H // n_kv).reshape(B, n_kv, H // n_kv, 1, r // 32))
    out, start = [], 0
    for (codes,) in meta:
        E = codes.shape[0]
        ham = jnp.min(ops.hamming_distance(qc[start:start + E], codes[:, :, None]), axis=2)  # [E, n_kv, blk]
        out.append((r - ham).astype(jnp.float32))
        start += E
    return space.per_request(jnp.concatenate(out))


@functools.partial(jax.jit, static_argnames=("retrieval", "page", "quest_dtype"))
def key_metadata(k_blocks, w, retrieval, page, quest_dtype="keys"):
    """The retrieval metadata of K blocks [n, n_kv, blk, d] (device memory): quest (min, max)
    [n, n_kv, blk/page, d] in the keys' dtype or (quest_dtype int8) ``quest_int8``'s (min, max, scale),
    hata (codes [n, n_kv, blk, r/32],)."""
    if retrieval == "quest":
        kmin, kmax = ops.quest_page_minmax(k_blocks, page)
        if quest_dtype == "int8":
            return quest_int8(kmin, kmax)
        return kmin.astype(k_blocks.dtype), kmax.astype(k_blocks.dtype)

    return (encode_keys(w, k_blocks),)


@functools.partial(jax.jit, static_argnames=("retrieval", "page", "quest_dtype"))
def _key_metadata_layers(k_blocks, ws, retrieval, page, quest_dtype="keys"):
    """`key_metadata` of several layers' K blocks (each with its own HATA projections ws[j]) in one program."""
    return tuple(key_metadata(kb, w, retrieval, page, quest_dtype) for kb, w in zip(k_blocks, ws))


def aggregate_similarity(cos, weights, how: str):
    """[B, n_kv]: the group's similarity from per-query-head cosines cos [B, n_kv, G]."""
    return group_similarity(cos, weights[None]) if how == "harmonic" else jnp.min(cos, axis=-1)


# ---------------------------------------------------------------------------------------------
# the row buffer: rows held on the GPU, refilled with only the rows it lacks (speculative prefetch)
# ---------------------------------------------------------------------------------------------

FETCH_TIERS = (16, 4, 1)  # a refill gathers K/16, K/4 or K rows (the smallest that holds its misses), or none


def locate_rows(held, held_valid, want, want_valid):
    """(present, pos) [B, n_kv, K]: whether each wanted token (the first want_valid entries of want) is among
    the held ones (the first held_valid entries of held, ascending, as ``choose_tokens`` gives them) and
    at which entry of held."""
    Kh, Kw = held.shape[-1], want.shape[-1]
    keyed = jnp.where(jnp.arange(Kh) < held_valid[..., None], held, jnp.int32(2 ** 30))  # sorted
    pos = sorted_positions(keyed.reshape(-1, Kh), want.reshape(-1, Kw)).reshape(want.shape)
    pos = jnp.minimum(pos, Kh - 1).astype(jnp.int32)
    present = (jnp.take_along_axis(keyed, pos, -1) == want) & (jnp.arange(Kw) < want_valid[..., None])
    return present, pos


def missing_rows(held, held_valid, want, want_valid):
    """(present, pos, missing, count): ``locate_rows`` and the wanted tokens the held ones lack, compacted
    ([B, n_kv, K]: the first count [B, n_kv] entries, in want's order; the rest 0)."""
    present, pos = locate_rows(held, held_valid, want, want_valid)
    K = want.shape[-1]
    miss = (jnp.arange(K) < want_valid[..., None]) & ~present
    rank = jnp.cumsum(miss, axis=-1, dtype=jnp.int32) - 1
    B, n_kv = want.shape[:2]
    at = (jnp.arange(B)[:, None, None], jnp.arange(n_kv)[None, :, None], jnp.where(miss, rank, K))
    missing = jnp.zeros_like(want).at[at].set(want, mode="drop")
    return present, pos, missing, jnp.sum(miss, axis=-1, dtype=jnp.int32)


def gather_missing(sources: HostRows, missing, count, blk, like):
    """(rows, x_rows): rows of the tokens missing[..., :max(count)] from the layer's host side (`HostRows`: each
    buffer's extents, int4 or native, dequantized to like[i]'s dtype; or recomputed from X rows, x_rows [B] of
    them read), as [B, n_kv, K, d] arrays shaped like `like` (rows past the count undefined). The gather takes
    the smallest of the FETCH_TIERS sizes that holds max(count) rows (a ``lax.switch``: static shapes), none
    when nothing is missing."""
    K = missing.shape[-1]
    sizes = sorted({max(1, -(-K // t)) for t in FETCH_TIERS})

    def gather(m):
        def run():
            rows, x_rows = sources(missing[..., :m], jnp.minimum(count, m), tuple(b.dtype for b in like), blk)
            return tuple(jnp.pad(r, ((0, 0), (0, 0), (0, K - m), (0, 0))) for r in rows), x_rows
        return run

    which = tier_index(sizes, jnp.max(count))
    none = lambda: (tuple(jnp.zeros_like(b) for b in like), jnp.zeros(count.shape[:1], jnp.int32))  # noqa: E731
    return jax.lax.switch(which, [none] + [gather(m) for m in sizes])


def refill_rows(held, held_valid, buffers, want, want_valid, sources, blk):
    """(rows, fetched, x_rows): the rows of the wanted tokens ([B, n_kv, K, d] per buffer, in want's order), how
    many were fetched per (request, KV head) and the X rows read per request (store=act). buffers hold the rows
    of `held` (one per part: V, or K and V); a wanted row already held is taken from its buffer, only the others
    come from the sources (a `HostRows`, or per buffer the host extents to gather from): exactly want minus held."""
    if not isinstance(sources, HostRows):
        sources = HostRows(extents=tuple(sources))
    present, pos, missing, count = missing_rows(held, held_valid, want, want_valid)
    got, x_rows = gather_missing(sources, missing, count, blk, buffers)
    rank = jnp.maximum(jnp.cumsum(~present, axis=-1, dtype=jnp.int32) - 1, 0)
    out = tuple(jnp.where(present[..., None], jnp.take_along_axis(buf, pos[..., None], axis=2),
                          jnp.take_along_axis(new, rank[..., None], axis=2)) for buf, new in zip(buffers, got))
    return out, count, x_rows


# CloSlots fields a decode layer program reads and never writes: the per-head reuse rule and the retrieval
# metadata (written by `CloHooks.keys_written` between steps) and HATA's projections
FIXED_SLOT_FIELDS = ("rule", "meta", "hata_w")
_NO_FIXED = {f: None for f in FIXED_SLOT_FIELDS}
_NO_DRAW = {"rate": None, "key": None}


def _with(obj, fields: dict):
    """A copy of the frozen dataclass obj with `fields` replaced, without running its __init__ (host side, per
    layer call)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(fields)
    return new


@dataclasses.dataclass(frozen=True)
class CloAttend:
    """The policy's `attend` (hashable, static). The per-layer reuse rule comes with the slots."""

    token_budget: int | None
    token_ratio: float | None
    num_sink: int
    num_recent: int
    gqa_aggregation: str
    page_size: int = 1  # tokens selected together: 1, quest's page (static_budget of the shared hooks reads it)
    retrieval: str = "exact"
    quest_dtype: str = "keys"  # quest's page metadata: the keys' dtype or int8 (`quest_int8`)
    speculative: bool = False  # the slots track the rows their buffers hold (CloSlots.held); see `speculate_layer`
    conditionals: bool = True  # skip a layer's selection and gathers under a lax.cond when all hit (`unless_all`)
    topk_method: str = "auto"  # `ops.select_topk`'s method
    token_min: int = 0  # with token_ratio: the fewest tokens selected (`selection_size`)

    def split_slots(self, slots: CloSlots):
        """(slots without the fields a layer program only reads, those fields): the layer program takes the
        second part undonated and does not return it (`pipeline.layer_step`). Per call on the host, so the
        instances are made without `dataclasses.replace` (~9 us a call against ~1.5)."""
        d = slots.__dict__
        moving = _with(slots, _NO_FIXED)
        fixed = tuple(d[f] for f in FIXED_SLOT_FIELDS)
        replay = d["selection"].replay
        if replay is not None:  # a replayed run's draw: its rate and key are fixed too
            moving.__dict__["selection"] = _with(d["selection"], {"replay": _with(replay, _NO_DRAW)})
            fixed += (replay.rate, replay.key)
        return moving, fixed

    def join_slots(self, moving: CloSlots, fixed: tuple) -> CloSlots:
        n = len(FIXED_SLOT_FIELDS)
        slots = _with(moving, dict(zip(FIXED_SLOT_FIELDS, fixed[:n])))
        if len(fixed) > n:
            sel = moving.selection
            draw = _with(sel.replay, dict(rate=fixed[n], key=fixed[n + 1]))
            slots.__dict__["selection"] = _with(sel, {"replay": draw})
        return slots

    def selection_rule(self, q, src, tables, slots: CloSlots):
        """(reuse [B, n_kv], select, rule_hits): which (request, KV head) keep their cached selection for query
        q, a function giving a fresh selection (indices, num_valid) for q (scores, top-k, sinks and recent
        tokens, persistent heads: everything), and what the similarity rule reused to count (0 without
        replay_hit_rate; with it a cached head's reuse is the replayed draw, `cache_decision`)."""
        keys = src.pool.k
        B, H, d = q.shape
        sel = slots.selection
        n_kv, blk = sel.indices.shape[1], pool_block_tokens(src.pool)
        K = sel.indices.shape[-1]  # the whole pool bound in a layer with persistent heads
        pool_tokens = sum(tables.count) * blk
        context = pool_tokens + src.tail_len + 1
        budget_k = K if self.token_budget is None else min(self.token_budget, K)
        ps = self.page_size
        n_select = selection_size(self.token_budget, self.token_ratio, self.num_sink, self.num_recent, ps,
                                  budget_k, context, self.token_min)
        n_select = jnp.where(slots.persistent[None], K, n_select[:, None])  # [B, n_kv]

        sim = aggregate_similarity(query_cosines(q, sel.query).reshape(B, n_kv, H // n_kv), slots.weights,
                                   self.gqa_aggregation)
        valid = (sel.pool_tokens == pool_tokens)[:, None]
        reuse, rule_hits = cache_decision((sim >= slots.tau[None]) & ~slots.persistent[None], valid, sel)
        reuse = reuse | (slots.persistent[None] & valid)  # a persistent head re-selects only when the pool grows
        # a reusing head's fresh selection is discarded (`reuse_or_select`): it selects nothing, and Quest's bounds
        # kernel does not read its pages (the select kernels skip rows of count 0)
        n_select = jnp.where(reuse, 0, n_select)

        def select():  # over each request's own blocks (`TokenSpace`): scores and top-k of T = R * blk tokens
            space = token_space(tables, blk, src.request_blocks)
            with jax.named_scope("scores"):
                if self.retrieval == "quest":
                    scores = quest_token_scores(q, slots.meta, tables, blk, space, active=~reuse)
                elif self.retrieval == "hata":
                    scores = hata_token_scores(q, slots.meta, slots.hata_w, tables, space)
                else:
                    scores = exact_scores(q, keys, tables, space, skip=reuse)  # a reusing head's keys are not read
                scores = jnp.where(slots.persistent[None, :, None] & (scores > NEG_INF), jnp.inf, scores)  # all
            with jax.named_scope("select"):
                return choose_tokens(scores, space.positions(tables), pool_tokens, context, n_select, K,
                                     self.num_sink, self.num_recent, ps, token_ids=space.token_ids(),
                                     method=self.topk_method)

        return reuse, select, rule_hits

    def __call__(self, cfg, lp, q, acc, src, tables, slots: CloSlots, recompute_impl, attention_impl):
        if slots.dense:  # every head persistent: the layer's blocks in device memory, attended as `full` does
            acc, _ = attend_pool(cfg, lp, q, acc, src.pool, tables, None, recompute_impl, attention_impl)
            sel = slots.selection
            return acc, dataclasses.replace(slots, selection=dataclasses.replace(sel, counts=sel.counted(steps=1)))
        keys = src.pool.k
        B, H, d = q.shape
        sel = slots.selection
        n_kv, blk = sel.indices.shape[1], pool_block_tokens(src.pool)
        pool_tokens = sum(tables.count) * blk
        # named scopes: the CLO paper's Fig. 11 parts (cache management, retrieval, transfer, attention) in a profile
        with jax.named_scope("cache"):
            reuse, select, rule_hits = self.selection_rule(q, src, tables, slots)
        with jax.named_scope("retrieval"):
            indices, num_valid = reuse_or_select(reuse, sel, select, self.conditionals)
        # the host side's rows: gathered (store=kv) or recomputed from the union's X rows (store=act)
        rows = HostRows.of(cfg, lp, src.pool, tables, ("v",) if slots.k_rows is None else ("k", "v"), recompute_impl)
        miss_nv = jnp.where(reuse, 0, num_valid)  # the hit heads' rows come from the buffers
        no_x = jnp.zeros((B,), jnp.int32)
        spec = {}
        with jax.named_scope("transfer"):  # the rows the buffers lack, from the host (or the device K)
            if self.speculative:  # the buffers hold the rows of slots.held: gather only the rows they lack
                k_rows, v_sel, fetched, x_rows = refill_buffers(slots, indices, num_valid, rows, blk)
                k_sel = native_extent(ops.gather_pool_rows(keys, indices, blk), q.dtype) if k_rows is None else k_rows
                # the guess's coverage of every fresh selection of a layer that was guessed this step
                fresh = ~reuse & slots.guessed
                needed = jnp.where(fresh, num_valid, 0)
                covered = jnp.where(fresh, num_valid - fetched, 0)
                spec = dict(held=indices, held_valid=num_valid, guessed=jnp.zeros((), bool),
                            guess_covered=slots.guess_covered + covered, guess_needed=slots.guess_needed + needed,
                            last_guess=jnp.stack([jnp.sum(covered), jnp.sum(needed)]))
            elif slots.k_rows is None:  # exact: K extents on the GPU, the selected rows read from them
                k_sel = native_extent(ops.gather_pool_rows(keys, indices, blk), q.dtype)
                (v_sel,), x_rows = unless_all(reuse, ((slots.v_rows,), no_x),
                                              lambda: rows.refill((slots.v_rows,), indices, miss_nv, blk),
                                              self.conditionals)
                k_rows = None
            else:  # K buffered too (on the host, or exact's device extents): the missed heads' rows of both refilled
                # in place; a hit head's kept
                (k_rows, v_sel), x_rows = unless_all(
                    reuse, ((slots.k_rows, slots.v_rows), no_x),
                    lambda: rows.refill((slots.k_rows, slots.v_rows), indices, miss_nv, blk), self.conditionals)
                k_sel = k_rows
        if not self.speculative:
            fetched = jnp.where(reuse, 0, num_valid)
        with jax.named_scope("attention"):
            part = rows_attention(q, k_sel, v_sel, num_valid, attention_impl)
            acc = ops.merge_attention_into(acc, part)

        keep_q = jnp.repeat(reuse, H // n_kv, axis=1)[..., None]
        cached = ~slots.persistent[None]
        counts = sel.counted(dict(num_valid=num_valid, pool_tokens=pool_tokens), steps=1, hits=reuse & cached,
                             scored=jnp.any(~reuse), x_rows=x_rows, rule_hits=rule_hits, rows_fetched=fetched)
        new_sel = SelectionCache(query=jnp.where(keep_q, sel.query, q.astype(jnp.float32)), indices=indices,
                                 counts=counts, replay=sel.replay)
        new = dataclasses.replace(slots, selection=new_sel, v_rows=v_sel, k_rows=k_rows, **spec)
        return acc, constrain_slots(new, clo_slot_specs(new))


def refill_buffers(slots: CloSlots, indices, num_valid, rows: HostRows, blk):
    """(k_rows or None, v_rows, fetched [B, n_kv], x_rows [B]): the row buffers made to hold the rows of
    indices, fetching (`HostRows`) only those the buffers (slots.held) lack; K rows too where K is buffered
    (quest/hata)."""
    if slots.k_rows is None:
        (v_rows,), fetched, x_rows = refill_rows(slots.held, slots.held_valid, (slots.v_rows,), indices, num_valid,
                                                 rows, blk)
        return None, v_rows, fetched, x_rows
    (k_rows, v_rows), fetched, x_rows = refill_rows(slots.held, slots.held_valid, (slots.k_rows, slots.v_rows),
                                                    indices, num_valid, rows, blk)
    return k_rows, v_rows, fetched, x_rows


@functools.partial(jax.jit, static_argnames=("cfg", "attend"))
def speculate_layer(cfg, attend: CloAttend, lp, h, positions, src, tables, slots: CloSlots):
    """CLO's speculative prefetch for one layer l, dispatched before layer l-1's program:
    the approximate query of layer l from layer l-1's input hidden state h (layer l's input norm, W_Q and
    RoPE at the new token's positions), the same reuse rule and selection as the true query's
    (`CloAttend.selection_rule`) for the heads it predicts to miss, and the guessed rows gathered into
    layer l's buffers (only those the buffers lack). Returns layer l's slots holding the guess; its
    program then gathers only what the guess missed (`refill_rows`)."""
    fam = family(cfg)
    q = fam.qkv(cfg, lp, fam.attn_input(cfg, lp, h), positions)[0][:, :, 0]
    blk = pool_block_tokens(src.pool)
    reuse, select, _ = attend.selection_rule(q, src, tables, slots)  # replay: the same draw as the true query's
    g_idx, g_nv = unless_all(reuse, (slots.held, slots.held_valid), select, attend.conditionals)
    g_idx = jnp.where(reuse[..., None], slots.held, g_idx)  # predicted hits keep what they hold
    g_nv = jnp.where(reuse, slots.held_valid, g_nv)
    rows = HostRows.of(cfg, lp, src.pool, tables, ("v",) if slots.k_rows is None else ("k", "v"))
    k_rows, v_rows, fetched, x_rows = refill_buffers(slots, g_idx, g_nv, rows, blk)
    sel = slots.selection
    sel = dataclasses.replace(sel, counts=sel.counted(x_rows=x_rows))  # the guesses' X rows count with the layers'
    slots = dataclasses.replace(slots, selection=sel, v_rows=v_rows, k_rows=k_rows, held=g_idx, held_valid=g_nv,
                                guessed=jnp.ones((), bool), spec_rows_fetched=slots.spec_rows_fetched + fetched)
    return constrain_slots(slots, clo_slot_specs(slots))


@jax.jit
def guess_rates(last_guess):
    """(hit rate of the step, per layer [L]) from each group's and layer's last_guess (covered, needed),
    [groups][L]: the fraction of the fresh selections' rows the guess had fetched (nan where nothing was
    selected afresh). One program: summed in Python, each add would be a dispatch per layer."""
    per = jnp.sum(jnp.stack([jnp.stack(g) for g in last_guess]), axis=0).astype(jnp.float32)  # [L, 2]
    tot = jnp.sum(per, axis=0)
    return tot[0] / tot[1], per[:, 0] / per[:, 1]


# ---------------------------------------------------------------------------------------------
# the per-head rule: scores, thresholds, persistent heads
# ---------------------------------------------------------------------------------------------


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
        new = _key_metadata_layers(tuple(k_blocks[j] for j in live), tuple(slots[j].hata_w for j in live), r,
                                   self.attend.page_size, self.attend.quest_dtype)
        written = iter(write_blocks_many([a for j in live for a in slots[j].meta[extent]],
                                         [a for m in new for a in m], at))
        out = list(slots)
        for j in live:
            meta = slots[j].meta
            out[j] = dataclasses.replace(slots[j], meta=meta[:extent] + (tuple(next(written) for _ in meta[extent]),)
                                         + meta[extent + 1:])
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
                     persistent_v_placement="a layer whose every head is persistent (device_layers: layer 0 with "
                                            "layer0_full): its K/V blocks in GPU memory, attended whole as `full` "
                                            "does; another layer's persistent heads: V in the host pool (gathered "
                                            "whole on re-selection), K on the GPU")
            if ch["plan"] is not None:
                c["plan"] = {k: ch["plan"][k] for k in ("n_d", "n_p", "n_persist", "n_kept", "total_bytes")}
        if state is not None and state.groups and state.groups[0].slots:
            c.update(hit_rates(state))  # persistent heads count no hits (they re-select only at a flush)
            cached = ~h.chosen["persistent"]
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
