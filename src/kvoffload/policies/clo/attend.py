"""clo's layer state and attention: one layer's slots (`CloSlots`: the selection cache, row buffers, the per-head
reuse rule, the retrieval metadata), the policy's `attend` (`CloAttend`: reuse or select, refill, attend) and the
speculative guess of the next layer's rows (`speculate_layer`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.device import sharding as S
from kvoffload.models.transformer import family
from kvoffload.policies.clo.retrieval import aggregate_similarity, exact_scores, hata_token_scores, quest_token_scores
from kvoffload.policies.clo.rows import refill_rows
from kvoffload.policies.options import PolicyOptionError
from kvoffload.policies.selection.cache import (
    SelectionCache,
    cache_decision,
    constrain_slots,
    query_cosines,
    reuse_or_select,
    selection_specs,
    unless_all,
)
from kvoffload.policies.selection.choose import NEG_INF, choose_tokens
from kvoffload.policies.selection.options import selection_size
from kvoffload.policies.selection.rows import HostRows, rows_attention
from kvoffload.policies.selection.space import pool_block_tokens, token_space
from kvoffload.runtime.attention import attend_pool, native_extent


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
