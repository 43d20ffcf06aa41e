"""`tokenselect`: TokenSelect. At every decode step and layer, each KV head attends only the
pool tokens its query heads vote for, chosen by a soft vote and reused while the query stays similar.
Built on the shared selection machinery (`kvoffload.policies.selection`: the selection cache, the token
space, the rows, the options and `SelectionHooks`); here are the vote, the layer's attend and the policy.

Placement ``kv=gpu`` (the paper's): the block pool is in device memory, as for `full`; the speed comes
from attending fewer tokens. Placement ``kv=split``: a host pool whose K extents are created in device
memory (`Capabilities.keys_on_device`) and V extents in pinned host memory; nothing is fetched (every
extent's mode is "dev": the pool's own arrays go to the layer program as they are), the vote reads K on
the GPU and the gather reads only the selected V rows from the host arrays inside the layer program
(`ops.gather_pool_rows` -> `ops.gather_block_rows`: on the GPU a Pallas kernel reads the rows in place over PCIe).
Half of `kv=gpu`'s GPU KV bytes. The rows move inside the program, so the step records count no
bytes_kv for them (they move nothing the pipeline issues). With ``host_dtype="int4"`` the V extents are
stored quantized (K stays native on the GPU): the gather takes the selected rows' codes and
scales and dequantizes only those rows on the GPU.

Per layer, inside the layer's one jitted program (`TokenSelectAttend`), for each request and KV head:

1. Soft vote over every pool token of the request (all extents, through the block tables): each query
   head's softmax of scale*q.K over the request's pool tokens, summed over the heads of its GQA group.
   The softmax is normalised across extents exactly (per-extent logits, one global max and sum).
   The GPU tail is not in the normalisation: `attend` never sees it (the pipeline folds it after), and
   it is always attended in full, so the vote only has to rank pool tokens; including it would only
   scale each head's pool distribution by that head's pool share of the mass. Each block is scored
   against its owner's query, the vote and top-k run over each request's own tokens (`TokenSpace`).
2. Top-k by vote (``ops.select_topk``), with the first ``num_sink`` tokens forced in and, where the tail
   holds fewer than ``num_recent`` tokens, the newest pool tokens forced in to make up ``num_recent``
   (the tail, 1 to 2*block_tokens newest tokens, is the paper's local window for free).
3. Attention over the selected rows only (gathered from the extents, then ``ops.sparse_attention``),
   merged into the accumulator (``ops.merge_attention_into``); the pipeline then folds the tail.
4. Selection cache (the layer's slots, `selection.cache.SelectionCache`): the query and selection of the
   last selection per (request, KV head), reused while min over the group's query heads of
   cos(q_t, q_cached) >= cache_threshold and the pool has not grown; the scoring runs under a
   ``lax.cond`` only when some (request, head) of the layer misses. ``replay_hit_rate`` (random-weight
   speed runs, shared with `clo`) replays real-model hit rates instead (`ReplayDraw`).

``vote_keys=int8|int4``: the vote reads a quantized copy of the pool's keys kept in the slots
(``SelectionCache.vote``, written with the keys at prefill and each flush, `TokenSelectHooks.keys_written`) in
place of the keys themselves; the selected rows are attended from the exact K/V (`selection.vote_keys`).

Length extrapolation (``extrapolate=True``): prompts past the model's trained positions, attending only
the selected tokens at rank positions inside the window; a separate dense runner, see
`kvoffload.policies.extrapolation` (the scheme and its source in pzs19/TokenSelect).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.device import sharding as S
from kvoffload.runtime.attention import attend_pool, native_extent
from kvoffload.runtime.hooks import Capabilities
from kvoffload.policies import extrapolation
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
    query_similarity,
    replay_rates,
    reuse_or_select,
    selection_specs,
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
from kvoffload.policies.selection.rows import HostRows
from kvoffload.policies.selection.space import TokenSpace, token_space
from kvoffload.policies.selection.vote_keys import VOTE_KEYS, vote_key_copy, vote_key_values, vote_key_zeros
from kvoffload.runtime.pool import write_block_trees

PLACEMENTS = ("gpu", "split")
DEFAULT_BUDGET = 2048  # the paper's top-k (pzs19/TokenSelect config: top_k 2048)


class TokenSelectOptionError(PolicyOptionError):
    """A tokenselect option out of range or not supported."""


def soft_vote(q, keys, tables, scale=None, space: TokenSpace | None = None):
    """TokenSelect's soft vote over a request's pool tokens spread over extents.

    q [B, H, d]; keys: per extent [E_e, n_kv, blk, d] (or their quantized copy, `selection.vote_keys`);
    tables: BlockTables; space: the token space
    (`token_space`; default the pool's). Returns [B, n_kv, T] f32 over the space's tokens (the pool's: T = N,
    block-id order, block id * blk + offset): per query head the softmax of scale*q.k over the request's
    own pool tokens (one normalisation across every extent), summed over each KV head's query heads; -inf
    where the request owns no token. Each block is scored once, against its owner's query."""
    B, H, d = q.shape
    n_kv, blk = keys[0].shape[1], keys[0].shape[2]
    G = H // n_kv
    scale = d ** -0.5 if scale is None else scale
    space = token_space(tables, blk) if space is None else space
    qb = space.owner_rows(q.reshape(B, n_kv, G, d))
    logits, start = [], 0
    for k in keys:
        E = k.shape[0]
        k = vote_key_values(k, q.dtype)  # a quantized copy's values (vote_keys), exact keys as they are
        logits.append(jnp.einsum("ehgd,ehtd->ehgt", qb[start:start + E].astype(k.dtype), k,
                                 preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST))
        start += E
    s = space.per_request(jnp.concatenate(logits).reshape(start, H, blk) * scale)  # [B, H, T]
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # exp(-inf) = 0 outside the request
    z = jnp.sum(p, axis=-1, keepdims=True)
    votes = jnp.sum((p / jnp.where(z > 0, z, 1.0)).reshape(B, n_kv, G, -1), axis=2)
    return jnp.where(space.token_valid()[:, None], votes, NEG_INF)


@dataclasses.dataclass(frozen=True)
class TokenSelectAttend:
    """The policy's `attend` (hashable: a static argument of the layer program). Budget: token_budget
    tokens, or token_ratio of each request's context, per KV head, capped by the slots' K (static)."""

    token_budget: int | None
    token_ratio: float | None
    num_sink: int
    num_recent: int
    cache_threshold: float
    page_size: int
    conditionals: bool = True  # `conditionals_default`
    topk_method: str = "auto"  # `ops.select_topk`'s method
    token_min: int = 0  # with token_ratio: the fewest tokens selected (`selection_size`)
    vote_keys: str = "native"  # the keys the vote reads: the pool's, or the slots' int8 / int4 copy (`vote_keys`)

    def __call__(self, cfg, lp, q, acc, src, tables, slots: SelectionCache, recompute_impl, attention_impl):
        pool = src.pool
        if pool.key_start is not None:  # a sliding-window layer is a device layer (`TokenSelectHooks.device_layer`):
            # no vote, no selection; its window attended as `full` does (the window mask on the pool's blocks)
            acc, _ = attend_pool(cfg, lp, q, acc, pool, tables, None, recompute_impl, attention_impl)
            return acc, dataclasses.replace(slots, counts=slots.counted(steps=1))
        keys = pool.k
        B, H, d = q.shape
        n_kv, blk = keys[0].shape[1], keys[0].shape[2]
        K = slots.indices.shape[-1]
        ps = self.page_size
        pool_tokens = sum(tables.count) * blk
        context = pool_tokens + src.tail_len + 1
        n_select = selection_size(self.token_budget, self.token_ratio, self.num_sink, self.num_recent, ps, K, context,
                                  self.token_min)

        with jax.named_scope("cache"):  # named scopes: the parts in a profile (kvoffload.profile), as clo's
            reuse, rule_hits = cache_decision(query_similarity(q, slots.query, n_kv) >= self.cache_threshold,
                                              (slots.pool_tokens == pool_tokens)[:, None], slots)

        def select():
            space = token_space(tables, blk, src.request_blocks)
            votes = soft_vote(q, slots.vote or keys, tables, space=space)
            return choose_tokens(votes, space.positions(tables), pool_tokens,
                                 context, n_select, K, self.num_sink, self.num_recent, ps,
                                 token_ids=space.token_ids(), method=self.topk_method)

        with jax.named_scope("retrieval"):
            indices, num_valid = reuse_or_select(reuse, slots, select, self.conditionals)

        with jax.named_scope("transfer"):
            k_sel = native_extent(ops.gather_pool_rows(keys, indices, blk), q.dtype)
            # int4 host V: the rows dequantized; store=act: V recomputed from the selected tokens' X rows
            (v_sel,), x_rows = HostRows.of(cfg, lp, pool, tables, ("v",), recompute_impl)(
                indices, num_valid, (q.dtype,), blk)
        with jax.named_scope("attention"):
            slot_ids = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), indices.shape)
            part = ops.sparse_attention(q, k_sel, v_sel, slot_ids, num_valid=num_valid, impl=attention_impl)
            acc = ops.merge_attention_into(acc, part)

        keep_q = jnp.repeat(reuse, H // n_kv, axis=1)[..., None]
        counts = slots.counted(dict(num_valid=num_valid, pool_tokens=pool_tokens), steps=1, hits=reuse,
                               scored=jnp.any(~reuse), x_rows=x_rows, rule_hits=rule_hits)
        new = SelectionCache(query=jnp.where(keep_q, slots.query, q.astype(jnp.float32)), indices=indices,
                             counts=counts, replay=slots.replay, vote=slots.vote)
        return acc, constrain_slots(new, selection_specs(new))


# ---------------------------------------------------------------------------------------------
# hooks and policy
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("form",))
def _vote_copies(k_blocks, form):
    return tuple(vote_key_copy(k, form) for k in k_blocks)


class TokenSelectHooks(SelectionHooks):
    name = "tokenselect"
    option_error = TokenSelectOptionError

    @property
    def capabilities(self) -> Capabilities:
        # kv=split: K extents on the GPU (the soft vote scores every key there), V in the host pool read in place
        return dataclasses.replace(super().capabilities, keys_on_device=self.split)

    def slot_parts(self, slot) -> dict:
        """GPU bytes of one layer's slots by part name (the memory plan's entries)."""
        parts = {"selection cache (queries, indices)": tree_nbytes(dataclasses.replace(slot, vote=()))}
        if slot.vote:
            parts[f"vote keys ({self.attend.vote_keys})"] = tree_nbytes(slot.vote)
        return parts

    def keys_written(self, pipe, slots, extent, k_blocks, at):
        """The vote's key copy (vote_keys int8 / int4) written where the blocks entered the pool: every layer's
        copy made in one program and written in one (`write_block_trees`)."""
        live = [j for j, sl in enumerate(slots) if sl.vote]  # a device layer (sliding window) votes on nothing
        if not live:
            return slots
        form = self.attend.vote_keys
        written = write_block_trees([slots[j].vote[extent] for j in live],
                                    _vote_copies(tuple(k_blocks[j] for j in live), form), at)
        out = list(slots)
        for j, c in zip(live, written):
            out[j] = dataclasses.replace(slots[j], vote=slots[j].vote[:extent] + (c,) + slots[j].vote[extent + 1:])
        return tuple(out)

    def slot_specs(self, slot):
        """Where one layer's slots live on a tensor-parallel mesh (`selection_specs`)."""
        return selection_specs(slot)

    def slot_maker(self, pipe, model, layout, batch):
        """A function of no arguments making the slots' arrays (every host-side decision taken before), so
        that `init_slots` runs it and `slot_memory` takes its shapes."""
        cfg = model.config
        K = self.static_budget(layout, batch)
        rates = self.replay_rates(cfg)

        form, dtype = self.attend.vote_keys, model.params.layers[0].wk.dtype
        shapes = [(layout.size(e), cfg.num_kv_heads, layout.block_tokens, cfg.head_dim)
                  for e in range(layout.num_extents)]

        dense = [self.device_layer(pipe, i) for i in range(cfg.num_layers)]

        def make():  # each layer its own arrays: a layer's program donates its slots
            def one(i):
                # a device layer (sliding window) selects nothing: one row, no vote copy
                sel = empty_selection(batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1 if dense[i] else K)
                if form != "native" and not dense[i]:  # the vote's key copy, written with the keys (`keys_written`)
                    sel = dataclasses.replace(sel, vote=tuple(vote_key_zeros(sh, form, dtype) for sh in shapes))
                return sel if rates is None else with_replay(sel, rates[i], i)
            return tuple(one(i) for i in range(cfg.num_layers))
        return make



@register_policy("tokenselect")
class TokenSelectPolicy(LayeredPolicy):
    host_pool = False
    int4_k_quant_default = "token"  # rows are gathered one by one (`LayeredPolicy.int4_k_quant_default`)
    streams_weights = False
    option_error = TokenSelectOptionError
    hook_options = (
        Option("token_budget", "int", "tokens selected per head (none: 2048 unless token_ratio)", low=1),
        Option("token_ratio", "float", "tokens selected per head as a share of the context", low=0, high=1,
               low_open=True),
        Option("token_min", "int", "with token_ratio: the fewest tokens selected", low=0),
        *SELECTION_WINDOW_OPTIONS,
        Option("cache_threshold", "float", "reuse the cached selection while the query's cosine to the cached "
               "one is at least this"),
        Option("kv", "choice", "gpu: the pool in device memory; split: K on the GPU, V in the host pool",
               choices=PLACEMENTS),
        Option("page_size", "int", "tokens per selected page (divides block_tokens)", low=1),
        Option("vote_keys", "choice", "the keys the vote reads: the pool's, or an int8 / int4 copy beside them on the "
               "GPU (0.56x / 0.31x the bytes of bf16 keys at head_dim 128)", choices=VOTE_KEYS),
        Option("extrapolate", "bool", "accept prompts past the model's positions (a dense runner)"),
        Option("prefill_chunk", "int", "extrapolate: prompt tokens per prefill chunk", low=1),
        *SELECTION_RUN_OPTIONS,
    )
    extrapolation = None  # an Extrapolation with extrapolate=True: prompts past the trained positions

    def __init__(self, **options):
        # kv=split: a host pool (V extents in pinned host memory, K extents on the device, see the hooks);
        # its V extents may be stored as int4 (the selected rows dequantized on the GPU)
        self.host_pool = options.get("kv", "gpu") == "split"
        self.host_dtypes = ("native", "int4") if self.host_pool else ("native",)
        super().__init__(**options)

    def make_hooks(self, token_budget=None, token_ratio=None, num_sink=4, num_recent=64, cache_threshold=0.9,
                   kv="gpu", page_size=1, extrapolate=False, prefill_chunk=512, store="kv", replay_hit_rate=None,
                   conditionals=None, topk_method="auto", token_min=0, vote_keys="native"):
        if extrapolate not in (True, False):
            raise TokenSelectOptionError(f"extrapolate must be true or false, got {extrapolate!r}")
        if kv not in PLACEMENTS:
            raise TokenSelectOptionError(f"kv must be one of {PLACEMENTS}, got {kv!r}")
        check_store(store, TokenSelectOptionError)
        if vote_keys not in VOTE_KEYS:
            raise TokenSelectOptionError(f"vote_keys must be one of {VOTE_KEYS}, got {vote_keys!r}")
        if vote_keys != "native" and (store != "kv" or extrapolate):
            raise TokenSelectOptionError(f"vote_keys={vote_keys!r} keeps a copy of the pool's K blocks: it needs "
                                         f"store=kv (got {store!r}) and the layer pipeline (not extrapolate=True)")
        if store != "kv" and kv != "split":
            raise TokenSelectOptionError(f"store={store!r} applies to kv=split (a host pool holding V rows or activations); "
                                         f"kv={kv!r} keeps the pool on the GPU")
        page_size = int(page_size)
        blk = self.options.block_tokens
        if page_size < 1 or blk % page_size:
            raise TokenSelectOptionError(f"page_size must divide block_tokens ({blk}), got {page_size}")
        token_budget, token_ratio, num_sink, num_recent, token_min = selection_budget(
            token_budget, token_ratio, num_sink, num_recent, default_budget=DEFAULT_BUDGET, token_min=token_min,
            error=TokenSelectOptionError)
        replay_rates(replay_hit_rate, error=TokenSelectOptionError)  # the values; their number once the model is known
        if extrapolate:
            if self.options.mesh is not None or self.options.tensor_parallel != 1:
                raise S.TensorParallelError("tokenselect's extrapolate=True runs its own dense runner on one device; "
                                            "it does not run tensor-parallel (tensor_parallel / mesh)")
            if replay_hit_rate is not None:
                raise TokenSelectOptionError("replay_hit_rate applies to the layer pipeline, not to extrapolate=True")
            self.extrapolation = extrapolation_options(token_budget, token_ratio, num_sink, num_recent, kv, page_size,
                                                       prefill_chunk)
        conditionals = conditionals_default(conditionals, TokenSelectOptionError)
        check_topk_method(topk_method, TokenSelectOptionError)
        attend = TokenSelectAttend(token_budget=token_budget, token_ratio=token_ratio, num_sink=num_sink,
                                   num_recent=num_recent, cache_threshold=float(cache_threshold), page_size=page_size,
                                   conditionals=conditionals, topk_method=topk_method, token_min=token_min,
                                   vote_keys=vote_keys)
        return TokenSelectHooks(attend, split=kv == "split", store=store, replay_hit_rate=replay_hit_rate)

    @property
    def extrapolates(self) -> bool:
        """Whether prompts past the model's trained positions are accepted (the engine asks)."""
        return self.extrapolation is not None

    def prefill(self, model, tokens, lengths, capacity):
        if self.extrapolation is not None:
            return extrapolation.prefill(model, self.extrapolation, tokens, lengths, capacity)
        return super().prefill(model, tokens, lengths, capacity)

    def decode_step(self, model, state, tokens):
        if self.extrapolation is not None:
            self.check_step_tokens(model, tokens)
            return extrapolation.decode_step(model.config, self.extrapolation, model.params, state,
                                             jnp.asarray(tokens, jnp.int32))
        return super().decode_step(model, state, tokens)

    def release(self, state, rows):
        if self.extrapolation is not None:  # one dense cache for the batch: nothing to free per row
            return state
        return super().release(state, rows)

    def describe(self, state=None) -> dict:
        if self.extrapolation is not None:
            d = {"policy": self.name, "extrapolate": dataclasses.asdict(self.extrapolation)}
            if state is not None:
                d["extrapolate"]["max_position"] = int(state.max_position)
            return d
        d = super().describe(state)
        a = self.pipeline.hooks.attend
        d["selection"] = {"token_budget": a.token_budget, "token_ratio": a.token_ratio, "token_min": a.token_min,
                          "num_sink": a.num_sink,
                          "num_recent": a.num_recent, "cache_threshold": a.cache_threshold, "page_size": a.page_size,
                          "kv": "split" if self.pipeline.hooks.split else "gpu", "conditionals": a.conditionals,
                          "topk_method": a.topk_method, "vote_keys": a.vote_keys}
        if self.pipeline.hooks.split:
            d["selection"].update(self.pipeline.hooks.store_report(state))
        d["selection"].update(self.pipeline.hooks.replay_description())
        dev = [int(i) for i in np.flatnonzero(self.pipeline.hooks.device_layers)]
        if dev:
            d["selection"]["device_layers"] = dev
            d["selection"]["device_layer_placement"] = (
                "sliding-window layers select nothing: their K/V blocks stay on the GPU and each attends its window "
                "as `full` does (the window mask); hit rates count no hits there")
        if state is not None and state.groups and state.groups[0].slots:
            slots = state.groups[0].slots
            selecting = [i for i in range(len(slots)) if i not in dev] or [0]
            d["selection"]["selected_per_head"] = int(slots[selecting[0]].indices.shape[-1])
            d["selection"].update(hit_rates(state))
        return d


def extrapolation_options(token_budget, token_ratio, num_sink, num_recent, kv, page_size, prefill_chunk):
    """The Extrapolation of extrapolate=True, its options checked (the model's limits at prefill)."""
    if kv != "gpu" or page_size != 1 or token_ratio is not None:
        raise TokenSelectOptionError("extrapolate=True runs with kv=gpu, page_size=1 and a token_budget (count); "
                                     f"got kv={kv!r}, page_size={page_size}, token_ratio={token_ratio}")
    prefill_chunk = int(prefill_chunk)
    if num_recent < 1:
        raise TokenSelectOptionError("extrapolate=True needs num_recent >= 1 (the query's own token is attended)")
    if prefill_chunk < 1 or token_budget < prefill_chunk + num_sink + num_recent:
        raise TokenSelectOptionError(
            f"extrapolate=True needs token_budget ({token_budget}) >= prefill_chunk ({prefill_chunk}) + num_sink "
            f"({num_sink}) + num_recent ({num_recent}): a prompt chunk attends itself and a selection of its past")
    return extrapolation.Extrapolation(token_budget=token_budget, num_sink=num_sink, num_recent=num_recent,
                                       prefill_chunk=prefill_chunk)
