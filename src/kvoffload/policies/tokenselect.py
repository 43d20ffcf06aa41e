"""`tokenselect`: TokenSelect. At every decode step and layer, each KV head attends only the
pool tokens its query heads vote for, chosen by a soft vote and reused while the query stays similar.

Placement ``kv=gpu`` (the paper's): the block pool is in device memory, as for `full`; the speed comes
from attending fewer tokens. Placement ``kv=split``: a host pool whose K extents are created in device
memory (`LayerHooks.keys_on_device`) and V extents in pinned host memory; nothing is fetched (every
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
   scale each head's pool distribution by that head's pool share of the mass.
2. Top-k by vote (``ops.select_topk``), with the first ``num_sink`` tokens forced in and, where the tail
   holds fewer than ``num_recent`` tokens, the newest pool tokens forced in to make up ``num_recent``
   (the tail, 1 to 2*block_tokens newest tokens, is the paper's local window for free).
3. Attention over the selected rows only (gathered from the extents, then ``ops.sparse_attention``),
   merged into the accumulator (``ops.merge_attention_into``); the pipeline then folds the tail.
4. Selection cache (the layer's slots): the query and selection of the last selection per (request, KV
   head), reused while min over the group's query heads of cos(q_t, q_cached) >= cache_threshold and the
   pool has not grown. The pool grows by whole blocks at a flush (every block_tokens steps): a cached
   selection stays valid (block ids never move) but misses the new block, so the cache stores the pool
   token count it was made at and re-selects when it changes. The scoring runs under a ``lax.cond``
   only when some (request, head) of the layer misses. With ``replay_hit_rate`` (random-weight speed runs,
   shared with `clo`) the reuse of a valid cached selection is a seeded Bernoulli draw at real-model hit
   rates instead (`ReplayDraw`); the similarity is still computed and counted.

Why gather rather than masked paged attention: masked paged attention reads every block of the
request (K and V of the whole context: no saving at all); the gather reads the K selected rows of K
and V per (request, head), writes them once and the attention reads them again: 3 * K rows against
the context's S rows (K = 2048 of S = 128K: ~1/20 of the bytes). A kernel reading the rows straight
from the extents would read K rows once (future work, with a paged scoring kernel: see the report).
Scoring reads every K row of the pool once per layer (the vote needs every key) unless the cache hits,
each block against its owner's query only; the vote and the top-k then run per request over its own
tokens (`TokenSpace`: [B, n_kv, T] with T the most tokens one request owns, not the batch's pool: at batch
8 the top-k alone over the batch's pool cost 2 ms a layer on an H100).

Length extrapolation (``extrapolate=True``): prompts past the model's trained positions, attending only
the selected tokens at rank positions inside the window; a separate dense runner, see
`kvoffload.policies.extrapolation` (the scheme and its source in pzs19/TokenSelect).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.device import sharding as S
from kvoffload.runtime.attention import PoolSources, native_extent
from kvoffload.runtime.hooks import LayerHooks
from kvoffload.runtime.state import LayerRows
from kvoffload.policies import extrapolation
from kvoffload.policies.base import register_policy
from kvoffload.policies.layered import LayeredPolicy
from kvoffload.policies.options import Option, PolicyOptionError
from kvoffload.policies.selection import NEG_INF, choose_tokens

PLACEMENTS = ("gpu", "split")
IN_PLACE_EXTENT_MB = 1024.0  # the default extent of a pool read in place (`TokenSelectHooks.extent_mb_per_device`)
DEFAULT_BUDGET = 2048  # the paper's top-k (pzs19/TokenSelect config: top_k 2048)


class TokenSelectOptionError(PolicyOptionError):
    """A tokenselect option out of range or not supported."""


# ---------------------------------------------------------------------------------------------
# state and sources
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SelectionCache:
    """One layer's slots: the selection per (request, KV head) and what it was made from.
    Token indices are in the pool's block-id space: block id * block_tokens + offset in the block.
    Build one with `SelectionCache.of` (its parts) or `empty_selection`."""

    query: jax.Array  # [B, H, d] f32: the query of the last selection (per query head)
    indices: jax.Array  # [B, n_kv, K] int32: selected tokens, the first num_valid valid (ascending)
    # [B, n_kv, len(COUNTS)] int32: the selection's small integers (`COUNTS`: its valid count per head, the
    # request's pool tokens when selected, steps run) and the run's statistics, one array because every leaf
    # of the layer program costs the host ~4 us a call (BENCHMARKS 'Host cost of a decode step'); per-request and
    # per-layer values are written alike into every head's column, so the array splits by head like the rest
    counts: jax.Array
    replay: "ReplayDraw | None" = None  # with replay_hit_rate: the replayed reuse decisions (else None)

    num_valid = property(lambda self: self.counts[..., COUNTS["num_valid"]])  # [B, n_kv]
    pool_tokens = property(lambda self: self.counts[:, 0, COUNTS["pool_tokens"]])  # [B]: when selected (-1: never)
    steps = property(lambda self: self.counts[:, 0, COUNTS["steps"]])  # [B]: steps run
    hits = property(lambda self: self.counts[..., COUNTS["hits"]])  # [B, n_kv]: steps that reused the selection
    rule_hits = property(lambda self: self.counts[..., COUNTS["rule_hits"]])  # [B, n_kv]: `ReplayDraw`
    rows_fetched = property(lambda self: self.counts[..., COUNTS["rows_fetched"]])  # [B, n_kv]: clo's misses
    x_rows = property(lambda self: self.counts[:, 0, COUNTS["x_rows"]])  # [B]: X rows read (store=act)
    scored = property(lambda self: self.counts[0, 0, COUNTS["scored"]])  # []: steps on which scoring ran

    @classmethod
    def of(cls, query, indices, num_valid, pool_tokens, steps, counts=None, replay=None) -> "SelectionCache":
        """A selection cache from its parts: num_valid [B, n_kv], pool_tokens and steps [B] (int32), counts
        the statistics' array to start from (`selection_counts` when None)."""
        B, n_kv = indices.shape[:2]
        counts = selection_counts(B, n_kv) if counts is None else counts
        return cls(query=query, indices=indices, replay=replay,
                   counts=count_columns(counts, written=dict(num_valid=num_valid, pool_tokens=pool_tokens,
                                                             steps=steps)))

    def counted(self, written=None, **adds) -> jax.Array:
        """counts with adds by name (`COUNTS`) and the columns of `written` (a dict by name) replaced."""
        return count_columns(self.counts, written, **adds)

    def written(self, **values) -> "SelectionCache":
        """This selection with the named `COUNTS` columns replaced (e.g. pool_tokens=...)."""
        return dataclasses.replace(self, counts=count_columns(self.counts, values))


def count_columns(counts, written=None, **adds) -> jax.Array:
    """counts [B, n_kv, len(COUNTS)] with adds by name added to their columns and the columns named in
    written (a dict) replaced; each value [B, n_kv] per head, [B] per request or [] per layer. One stack."""
    cols = [counts[..., i] for i in range(counts.shape[-1])]

    def column(a):
        a = jnp.asarray(a, jnp.int32)
        return a[:, None] if a.ndim == 1 else a

    for name, a in adds.items():
        cols[COUNTS[name]] = cols[COUNTS[name]] + column(a)
    for name, a in (written or {}).items():
        cols[COUNTS[name]] = jnp.broadcast_to(column(a), cols[COUNTS[name]].shape)
    return jnp.stack(cols, -1)


jax.tree_util.register_dataclass(SelectionCache, data_fields=[f.name for f in dataclasses.fields(SelectionCache)],
                                 meta_fields=[])

# SelectionCache.counts' columns: reuses of the cached selection (per head), looks on which the similarity rule
# would have reused under replay (per head), rows gathered from the host on misses (per head; clo), activation
# rows read (per request; store=act), steps on which the scoring ran (per layer); and the selection's own
# state: its valid count (per head), the request's pool tokens when it was made and the steps run (per request)
COUNTS = {"hits": 0, "rule_hits": 1, "rows_fetched": 2, "x_rows": 3, "scored": 4, "num_valid": 5,
          "pool_tokens": 6, "steps": 7}


def selection_counts(batch: int, n_kv: int) -> jax.Array:
    """SelectionCache.counts of a selection that has counted nothing (its state columns 0)."""
    return jnp.zeros((batch, n_kv, len(COUNTS)), jnp.int32)


@dataclasses.dataclass(frozen=True)
class ReplayDraw:
    """Replayed cache decisions of one layer (option ``replay_hit_rate``, tokenselect and clo). Random
    weights give unrelated queries from step to step, so a random-weight speed run would almost never reuse
    a selection; a real model does (measured per layer on real prompts). With replay, each look at a valid
    cached selection -- per (request, KV head, step) -- reuses it with probability ``rate``: a Bernoulli draw
    from ``key`` folded with the request's step counter and its row (on the device, no host sync). Where the
    cache is not valid (nothing selected yet, the pool grew) the head selects as always. The similarity
    rule is still evaluated (its cost is paid, as in a real run) and counted (`SelectionCache.rule_hits`)."""

    rate: jax.Array  # [] f32: probability that a valid cached selection is reused
    key: jax.Array  # [2] uint32: the layer's PRNG key (jax.random.PRNGKey data)


jax.tree_util.register_dataclass(ReplayDraw, data_fields=["rate", "key"], meta_fields=[])

REPLAY_SEED = 20261126  # the replayed draws' root key; each layer folds in its index


def replay_rates(replay_hit_rate, num_layers: int | None = None, error=None) -> np.ndarray | None:
    """[L] float64: the per-layer reuse probability of option ``replay_hit_rate`` (a number for every
    layer, or one per layer), checked; None without replay. num_layers None (the model not known yet):
    the values are checked, a number stays 0-d."""
    error = error or TokenSelectOptionError
    if replay_hit_rate is None:
        return None
    try:
        rates = np.asarray(replay_hit_rate, np.float64)
    except (TypeError, ValueError):
        raise error(f"replay_hit_rate must be a number in [0, 1] or a list of one per layer, "
                    f"got {replay_hit_rate!r}") from None
    if rates.ndim == 0 and num_layers is not None:
        rates = np.full(num_layers, float(rates))
    if rates.ndim > 1 or (num_layers is not None and len(rates) != num_layers):
        raise error(f"replay_hit_rate must be a number or a list of {num_layers} (one per layer), "
                    f"got {len(rates) if rates.ndim == 1 else rates.shape} values")
    if not np.all((rates >= 0) & (rates <= 1)):
        raise error(f"replay_hit_rate values must be in [0, 1], got {replay_hit_rate!r}")
    return rates


def with_replay(sel: SelectionCache, rate: float, layer: int) -> SelectionCache:
    """sel (an empty selection) with replayed reuse decisions at probability rate for this layer."""
    key = jax.random.fold_in(jax.random.PRNGKey(REPLAY_SEED), layer)
    return dataclasses.replace(sel, replay=ReplayDraw(rate=jnp.asarray(rate, jnp.float32), key=key))


def cache_decision(rule, valid, sel: SelectionCache):
    """(reuse [B, n_kv], the rule's reuses to count [B, n_kv] int32 or 0): rule & valid (rule: the similarity
    clears the threshold; valid: the cached selection may be reused), or with replay a Bernoulli(rate) draw &
    valid, the rule still evaluated and counted (`ReplayDraw`, `SelectionCache.rule_hits`)."""
    if sel.replay is None:
        return rule & valid, 0
    B, n_kv = rule.shape

    def draw(b, step):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(sel.replay.key, step), b), (n_kv,))

    u = jax.vmap(draw)(jnp.arange(B, dtype=jnp.int32), sel.steps)
    return (u < sel.replay.rate) & valid, (rule & valid).astype(jnp.int32)


def selection_specs(sel: SelectionCache) -> SelectionCache:
    """Where a selection cache lives on a tensor-parallel mesh (PartitionSpecs in its place): per head parts
    (queries per query head, selections and counters per KV head: axis 1) split by head like the K/V they
    select from, so each device keeps its own heads' (query head h goes with KV head h // G: contiguous groups,
    one device's), the counts too (axis 1; their per-request columns, pool tokens and steps, hold the same value
    in every head's column); the replayed draw's rate and key replicated."""
    heads, rep = S.KV_SPEC, S.REPLICATED
    return SelectionCache(query=heads, indices=heads, counts=heads,
                          replay=None if sel.replay is None else ReplayDraw(rate=rep, key=rep))


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def place_slots(pipe, slots, specs):
    """slots committed where the run keeps them: the pipeline's device, or on its mesh as specs (a pytree of
    PartitionSpecs shaped like slots) say."""
    if pipe.mesh is None:
        return jax.device_put(slots, pipe.dev)
    return jax.tree.map(lambda s, a: S.put(a, jax.sharding.NamedSharding(pipe.mesh, s)), specs, slots, is_leaf=_is_spec)


def constrain_slots(slots, specs):
    """Inside a program: slots kept where specs say on the context mesh, so a step returns them as it took them
    (the layer program compiles once); slots themselves without a mesh."""
    if S.context_size() == 1:
        return slots
    mesh = jax.sharding.get_abstract_mesh()
    return jax.tree.map(lambda s, a: jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, s)), specs,
                        slots, is_leaf=_is_spec)


def device_shapes(shapes, specs, n: int):
    """ShapeDtypeStructs of one device's share of a pytree (`jax.eval_shape`'s) on an n-way mesh: the axes
    specs split over the model axis divided by n (what the per-device memory plan counts)."""
    def one(s, a):
        dims = [dim // n if ax == S.MODEL else dim for dim, ax in zip(a.shape, tuple(s) + (None,) * a.ndim)]
        return jax.ShapeDtypeStruct(tuple(dims), a.dtype)
    return jax.tree.map(one, specs, shapes, is_leaf=_is_spec)


@dataclasses.dataclass(frozen=True)
class SelectSources:
    """The layer program's sources: the pool (as every policy's) and each request's tail length
    before this step's token (to count how many recent tokens the tail already covers)."""

    pool: object  # PoolSources
    tail_len: jax.Array  # [B] int32
    # static: the most blocks one request owns (`request_token_bound` / blk), the size of the per-request
    # token space the selection scores and ranks (`TokenSpace`); 0: not known (the whole pool's space)
    request_blocks: int = 0
    # [] int32 added to every pool token id a row is read at, or None (0): an extent holding several layers'
    # blocks, layer j's at j x E x blk (a step run as one loop over stacked layers: `loop_layers`)
    row_offset: jax.Array | None = None


jax.tree_util.register_dataclass(SelectSources, data_fields=["pool", "tail_len", "row_offset"],
                                 meta_fields=["request_blocks"])


# ---------------------------------------------------------------------------------------------
# the pure pieces (inside the layer program)
# ---------------------------------------------------------------------------------------------


def block_owners(tables):
    """[num_blocks] int32: the request owning each block of the pool (block-id order), -1 where none."""
    if tables.owner is not None:  # built with the tables (`BlockAllocator.device_tables`)
        return tables.owner
    out = []
    for table, count, first in zip(tables.table, tables.count, tables.first_pos):
        B, M = table.shape
        slot = jnp.where(jnp.arange(M, dtype=jnp.int32)[None] < count[:, None], table, first.shape[0])
        req = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, M))
        out.append(jnp.full(first.shape, -1, jnp.int32).at[slot.reshape(-1)].set(req.reshape(-1), mode="drop"))
    return jnp.concatenate(out)


@dataclasses.dataclass(frozen=True)
class TokenSpace:
    """The token space a selection scores and ranks, per request: [B, T] over its own pool blocks.

    Scoring: every pool block is scored once, against its owner's query (``owner_rows``: no request scores
    another's blocks: 1x the flops of the pool, not B x), as per-block values [num_blocks, C, blk];
    ``per_request`` lays them out per request. Two layouts:
    * per request (``blocks`` given, batch > 1 with a known bound): each request's blocks in ascending
      block-id order, padded to R = the most blocks one request owns (`request_token_bound`), T = R * blk;
      the top-k runs over T, not over the batch's pool, and ``token_ids`` maps a slot back to its pool token.
    * the pool (``blocks`` None: batch 1, or no bound): T = N, every pool token, the request's valid (at
      batch 1 the request owns the pool: nothing to gather, the scores as computed).
    Either way a request's own tokens come in ascending pool token order, so the top-k (ties to the lower
    index) picks the same tokens in both layouts, and in the pool of the request alone."""

    owner: jax.Array  # [num_blocks] int32: each block's request (-1: free)
    blocks: jax.Array | None  # [B, R] int32: each request's blocks, ascending (0 past its count); None: the pool
    valid: jax.Array  # [B, R] (per request) or [B, num_blocks] (the pool) bool: the request owns the block
    blk: int

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def owner_rows(self, x):
        """[num_blocks, ...]: per block its owner's row of x [B, ...] (request 0's where free)."""
        if self.batch == 1:
            return jnp.broadcast_to(x, (self.owner.shape[0],) + x.shape[1:])
        return x[jnp.maximum(self.owner, 0)]

    def token_valid(self):
        """[B, T] bool: the slot holds one of the request's tokens."""
        return jnp.repeat(self.valid, self.blk, axis=1)

    def per_request(self, x):
        """[B, C, T] f32 from per-block values x [num_blocks, C, blk], -inf where the request owns no token."""
        n, C, blk = x.shape
        if self.blocks is None:
            y = jnp.swapaxes(x, 0, 1).reshape(1, C, n * blk)
        else:
            y = jnp.swapaxes(x[self.blocks], 1, 2).reshape(self.batch, C, -1)  # [B, R, C, blk] -> [B, C, R blk]
        return jnp.where(self.token_valid()[:, None], y.astype(jnp.float32), NEG_INF)

    def token_ids(self):
        """[B, T] int32: the pool token (block id * blk + offset) of each slot; None for the pool's own space."""
        if self.blocks is None:
            return None
        return (self.blocks[..., None] * self.blk + jnp.arange(self.blk, dtype=jnp.int32)).reshape(self.batch, -1)

    def positions(self, tables):
        """[T] (the pool) or [B, T] int32: each slot's token position (``token_positions``)."""
        pos = token_positions(tables, self.blk)
        ids = self.token_ids()
        return pos if ids is None else pos[ids]


jax.tree_util.register_dataclass(TokenSpace, data_fields=["owner", "blocks", "valid"], meta_fields=["blk"])


def token_space(tables, blk: int, request_blocks: int = 0) -> TokenSpace:
    """The selection's token space for these tables (`TokenSpace`): per request, R = request_blocks blocks
    each, where the batch has more than one request and R is known and below the pool's blocks; else the
    pool's. request_blocks must bound every request's blocks (the slots' sizes rest on the same bound)."""
    owner = block_owners(tables)
    B, n = tables.count[0].shape[0], owner.shape[0]
    mine = owner[None] == jnp.arange(B, dtype=jnp.int32)[:, None]  # [B, num_blocks]
    if B == 1 or not 0 < request_blocks < n:
        return TokenSpace(owner=owner, blocks=None, valid=mine, blk=blk)
    blocks = jax.vmap(lambda m: jnp.nonzero(m, size=request_blocks, fill_value=0)[0].astype(jnp.int32))(mine)
    valid = jnp.arange(request_blocks)[None] < jnp.sum(mine, axis=1, dtype=jnp.int32)[:, None]
    return TokenSpace(owner=owner, blocks=blocks, valid=valid, blk=blk)


def soft_vote(q, keys, tables, scale=None, space: TokenSpace | None = None):
    """TokenSelect's soft vote over a request's pool tokens spread over extents.

    q [B, H, d]; keys: per extent [E_e, n_kv, blk, d]; tables: BlockTables; space: the token space
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
        logits.append(jnp.einsum("ehgd,ehtd->ehgt", qb[start:start + E].astype(k.dtype), k,
                                 preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST))
        start += E
    s = space.per_request(jnp.concatenate(logits).reshape(start, H, blk) * scale)  # [B, H, T]
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # exp(-inf) = 0 outside the request
    z = jnp.sum(p, axis=-1, keepdims=True)
    votes = jnp.sum((p / jnp.where(z > 0, z, 1.0)).reshape(B, n_kv, G, -1), axis=2)
    return jnp.where(space.token_valid()[:, None], votes, NEG_INF)


def token_positions(tables, blk):
    """[N] int32: the position of every token of the pool's token space (0 for free blocks)."""
    first = jnp.concatenate(tables.first_pos)
    return (first[:, None] + jnp.arange(blk, dtype=jnp.int32)[None]).reshape(-1)


def sorted_positions(sorted_rows, values):
    """[R, V] int32: per row, jnp.searchsorted(sorted_rows[r], values[r]) (side left). Unrolled: the default
    'scan' method is an XLA while loop, which on the GPU runs its ~log2(n) iterations from the host, each
    waiting for the device (measured 0.45 ms per call at n = 3.3K on an H200, the larger part of a clo layer's
    host time); unrolled it is straight-line device code."""
    return jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"))(sorted_rows, values).astype(jnp.int32)


def tier_index(sizes, most):
    """The lax.switch branch for a gather of `most` rows: 0 (nothing) when most == 0, else 1 + the first of the
    ascending static `sizes` that holds it (a comparison count: no searchsorted loop)."""
    below = sum((jnp.asarray(most) > c).astype(jnp.int32) for c in sizes)
    return jnp.where(most == 0, 0, 1 + below).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# top-k over activations (store=act): the selected tokens' K/V recomputed from their X rows
# ---------------------------------------------------------------------------------------------

STORES = ("kv", "act", "auto")

# options tokenselect and clo share (their meaning is the same in both)
SELECTION_WINDOW_OPTIONS = (
    Option("num_sink", "int", "first tokens always attended", low=0),
    Option("num_recent", "int", "most recent tokens always attended", low=0),
)
SELECTION_RUN_OPTIONS = (
    Option("store", "choice", "kv: K/V (V) rows in the host pool; act: activations, the selected K/V recomputed; "
           "auto: per layer by the cost model", choices=STORES),
    Option("replay_hit_rate", "floats", "replay this reuse rate (one number, or one per layer) instead of the rule",
           low=0, high=1),
    Option("conditionals", "bool", "skip a layer's selection work under lax.cond when every head reuses; "
           "none: only off the GPU"),
    Option("topk_method", "choice", "the top-k implementation", choices=ops.TOPK_METHODS),
)
UNION_TIER = 4  # the X-row gathers take K, 4K, 16K, ... rows (up to the whole union's bound), the smallest that fits


def union_tiers(K: int, n_kv: int, N: int) -> list:
    """Static sizes of the X-row gather: K rows per (request, head) make a union of at most min(n_kv K, N) tokens."""
    cap = max(1, min(n_kv * K, N))
    sizes, c = [], max(1, min(K, cap))
    while c < cap:
        sizes.append(c)
        c *= UNION_TIER
    return sizes + [cap]


def recompute_rows(cfg, lp, x, positions, want_k: bool, impl="reference"):
    """(k or None, v) [B, n_kv, T, d] of activation rows x [B, T, H] at positions [B, T] (RoPE on K at each
    token's own position, through the family's recompute_kv); want_k False: V alone (K is on the GPU)."""
    from kvoffload.models.transformer import family

    if want_k:
        return family(cfg).recompute_kv(cfg, lp, x, positions, impl=impl)
    return ops.recompute_kv(x, None, None, lp.wv, lp.bv, n_kv=cfg.num_kv_heads)


def act_rows(cfg, lp, acts, blk, positions, indices, valid, want_k, dtype, impl="reference"):
    """(rows, x_rows): the K and V rows (want_k) or the V rows, each [B, n_kv, K, d] in dtype, of the tokens
    indices [B, n_kv, K] where valid, recomputed on the GPU from activation rows gathered from the X extents
    acts [E_e, blk, H] (host memory: `ops.gather_pool_rows`, zero-copy on the GPU). X is per token, shared by every
    head: a request's rows are those of the union of its heads' valid tokens (x_rows [B] of them), gathered
    once, in the smallest of `union_tiers` that holds the largest union (a ``lax.switch``; none when empty).
    positions [N]: each token of the pool's token space its position (RoPE; OPT's X carries its learned
    position already, added by the embedding)."""
    B, n_kv, K = indices.shape
    N = positions.shape[0]
    rows_b = jnp.arange(B)[:, None]
    mask = jnp.zeros((B, N), bool).at[rows_b, jnp.where(valid, indices, N).reshape(B, -1)].set(True, mode="drop")
    count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    rank = jnp.where(mask, jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1, N)
    d = cfg.head_dim
    sizes = union_tiers(K, n_kv, N)

    def tier(c):
        def run():
            union = jnp.full((B, c), -1, jnp.int32).at[rows_b, rank].set(
                jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)), mode="drop")  # ascending, then -1
            x = native_extent(ops.gather_pool_rows(acts, union, blk), dtype)
            k, v = recompute_rows(cfg, lp, x, positions[jnp.maximum(union, 0)], want_k, impl)
            keyed = jnp.where(union >= 0, union, jnp.int32(2 ** 30))
            at = jnp.minimum(sorted_positions(keyed, indices.reshape(B, -1)), c - 1).reshape(B, n_kv, K, 1)
            return tuple(jnp.take_along_axis(a, at, axis=2).astype(dtype) for a in ((k, v) if want_k else (v,)))
        return run

    zeros = lambda: tuple(jnp.zeros((B, n_kv, K, d), dtype) for _ in range(2 if want_k else 1))  # noqa: E731
    most = jnp.max(count)
    return jax.lax.switch(tier_index(sizes, most), [zeros] + [tier(c) for c in sizes]), count


def stores_acts(pool) -> bool:
    """Whether a layer's sources hold activation extents in place of its V extents (store=act)."""
    return pool.v[0] is None and pool.x[0] is not None


def pool_block_tokens(pool) -> int:
    """blk of a layer's extents (whichever it stores: K/V [E, n_kv, blk, d] or X [E, blk, H])."""
    for ext, axis in ((pool.k, 2), (pool.v, 2), (pool.x, 1)):
        if ext[0] is not None:
            return jax.tree.leaves(ext[0])[0].shape[axis]
    raise ValueError("a layer with no extents")


def rows_attention(q, k_rows, v_rows, num_valid, impl):
    """Attention over a selection's row buffers [B, n_kv, K, d] (the first num_valid valid): arrays, or
    `LayerRows` read in place at the layer's offset (`ops.rows_attention`)."""
    if isinstance(k_rows, LayerRows):
        if not isinstance(v_rows, LayerRows) or v_rows.dtype != k_rows.dtype or v_rows.rows != k_rows.rows:
            raise ValueError("K and V row buffers must both be LayerRows of one dtype and row count")
        return ops.rows_attention(q, k_rows.stacked, v_rows.stacked, num_valid, k_rows.rows, row_offset=k_rows.offset,
                                  impl=impl)
    return ops.rows_attention(q, k_rows, jnp.asarray(v_rows).astype(k_rows.dtype), num_valid, k_rows.shape[2],
                              impl=impl)


@dataclasses.dataclass(frozen=True)
class HostRows:
    """Where a layer's selected rows come from on the host side (built inside a layer program): gathered
    from the extents of each buffer's part (store=kv: V, or K and V), or recomputed from X rows (store=act,
    `act_rows`: acts, the layer's weights lp and the pool's token positions)."""

    extents: tuple = ()  # per buffer its extents (kv)
    acts: tuple | None = None  # X extents (act)
    cfg: object = None
    lp: object = None
    positions: object = None  # [N] int32
    impl: str = "reference"
    offset: object = None  # [] int32 added to the token ids read from the extents (`SelectSources.row_offset`)

    @classmethod
    def of(cls, cfg, lp, pool, tables, parts, impl="reference", offset=None):
        """The rows of parts ("v", or "k" and "v") of a layer's sources; offset: `SelectSources.row_offset`."""
        if stores_acts(pool):
            if offset is not None:
                raise ValueError("a row offset (several layers' blocks in one extent) needs K/V extents, not X")
            return cls(acts=pool.x, cfg=cfg, lp=lp, positions=token_positions(tables, pool_block_tokens(pool)),
                       impl=impl)
        return cls(extents=tuple(pool.k if p == "k" else pool.v for p in parts), offset=offset)

    @staticmethod
    def wanted(indices, num_valid):
        """[B, n_kv, K] bool: the first num_valid entries of each (request, head)."""
        return jnp.arange(indices.shape[-1]) < num_valid[..., None]

    def tokens(self, indices, num_valid):
        """The token ids read: indices (+ offset) for the first num_valid of each row, -1 (read nothing) after."""
        ids = indices if self.offset is None else indices + self.offset
        return jnp.where(self.wanted(indices, num_valid), ids, -1)

    def __call__(self, indices, num_valid, dtypes, blk):
        """(rows [B, n_kv, K, d], one per part in `dtypes`, x_rows [B] int32: the X rows read) for indices
        [B, n_kv, K], the first num_valid [B, n_kv] of each (request, head) wanted (the others come back 0 and
        cost no transfer: a hit head's count of 0 moves nothing)."""
        if self.acts is None:  # rows past num_valid are not read (-1: outside every extent; a masked load)
            indices = self.tokens(indices, num_valid)
            rows = tuple(native_extent(ops.gather_pool_rows(ext, indices, blk), dt).astype(dt)
                         for ext, dt in zip(self.extents, dtypes))
            return rows, jnp.zeros(indices.shape[:1], jnp.int32)
        return act_rows(self.cfg, self.lp, self.acts, blk, self.positions, indices, self.wanted(indices, num_valid),
                        len(dtypes) == 2, dtypes[-1], self.impl)

    def refill(self, buffers, indices, num_valid, blk):
        """(buffers, x_rows [B]): each buffer [B, n_kv, K, d] (one per part) with rows [0, num_valid) of every
        (request, head) replaced by the rows of indices [B, n_kv, K] (a head with num_valid 0 keeps its rows;
        rows past num_valid keep theirs, never read). Extents: ``ops.refill_block_rows`` (on the GPU one kernel
        per buffer writing only the replaced rows, in place); X rows: recomputed (``__call__``) and merged."""
        if self.acts is None:
            tokens = self.tokens(indices, num_valid)
            return (tuple(buf.with_stacked(ops.refill_block_rows(buf.stacked, ext, tokens, blk, row_offset=buf.offset))
                          if isinstance(buf, LayerRows) else ops.refill_block_rows(buf, ext, tokens, blk)
                          for buf, ext in zip(buffers, self.extents)),
                    jnp.zeros(indices.shape[:1], jnp.int32))
        if any(isinstance(b, LayerRows) for b in buffers):
            raise ValueError("row buffers of stacked layers (LayerRows) take K/V extents, not X")
        rows, x_rows = self(indices, num_valid, tuple(b.dtype for b in buffers), blk)
        keep = self.wanted(indices, num_valid)[..., None]
        return tuple(jnp.where(keep, r, buf) for r, buf in zip(rows, buffers)), x_rows


def query_cosines(q, cached):
    """[B, H]: cos(q, cached) per query head (0 where a norm is 0)."""
    q = q.astype(jnp.float32)
    dot = jnp.sum(q * cached, axis=-1)
    norms = jnp.linalg.norm(q, axis=-1) * jnp.linalg.norm(cached, axis=-1)
    return jnp.where(norms > 0, dot / jnp.where(norms > 0, norms, 1.0), 0.0)


def query_similarity(q, cached, n_kv):
    """[B, n_kv]: min over each KV head's query heads of cos(q, cached) (0 where a norm is 0)."""
    B, H, _ = q.shape
    return jnp.min(query_cosines(q, cached).reshape(B, n_kv, H // n_kv), axis=-1)


def selection_size(token_budget, token_ratio, num_sink, num_recent, page_size, K, context, token_min=0):
    """[B] int32: the tokens to select per request: token_budget (then K, the slots' static size), or
    token_ratio of the request's context (at least num_sink + num_recent and token_min), in whole pages,
    capped by K."""
    if token_budget is not None:
        want = jnp.full(context.shape, K, jnp.int32)
    else:
        want = jnp.ceil(token_ratio * context.astype(jnp.float32)).astype(jnp.int32)
        want = jnp.maximum(want, max(num_sink + num_recent, token_min))
    return jnp.minimum(-(-want // page_size) * page_size, K)


def conditionals_default(conditionals, error) -> bool:
    """Whether a layer skips its selection work under a ``lax.cond`` when every head reuses: None = only off
    the GPU. On the GPU a conditional reads its predicate on the host mid-program (a device sync per
    conditional per layer, measured ~0.5 ms), so there the work always runs and its kernels skip a reusing
    head's share themselves (scores: a per-head length of 0; gathers: a count of 0; the radix top-k costs
    the same either way)."""
    if conditionals is None:
        return jax.default_backend() == "cpu"
    if conditionals not in (True, False):
        raise error(f"conditionals must be true, false or unset, got {conditionals!r}")
    return bool(conditionals)


def check_topk_method(method, error):
    if method not in ops.TOPK_METHODS:
        raise error(f"topk_method must be one of {ops.TOPK_METHODS}, got {method!r}")


def unless_all(reuse, kept, compute, conditionals: bool):
    """compute() (a pytree like kept); with conditionals, kept without running compute when every (request,
    head) of reuse [B, n_kv] reuses. Callers take a reusing head's values from kept either way."""
    if conditionals:
        return jax.lax.cond(jnp.all(reuse), lambda: kept, compute)
    return compute()


def reuse_or_select(reuse, slots, select, conditionals=True):
    """(indices, num_valid): the cached selection where reuse [B, n_kv], else select()'s (`unless_all`)."""
    fresh_idx, fresh_nv = unless_all(reuse, (slots.indices, slots.num_valid), select, conditionals)
    return jnp.where(reuse[..., None], slots.indices, fresh_idx), jnp.where(reuse, slots.num_valid, fresh_nv)


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

    def __call__(self, cfg, lp, q, acc, src, tables, slots: SelectionCache, recompute_impl, attention_impl):
        pool = src.pool
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
            return choose_tokens(soft_vote(q, keys, tables, space=space), space.positions(tables), pool_tokens,
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
                             counts=counts, replay=slots.replay)
        return acc, constrain_slots(new, selection_specs(new))


# ---------------------------------------------------------------------------------------------
# hooks and policy
# ---------------------------------------------------------------------------------------------


def empty_selection(batch, H, n_kv, d, K) -> SelectionCache:
    """A selection cache that has selected nothing yet (pool_tokens -1: the first step selects)."""
    return SelectionCache.of(jnp.zeros((batch, H, d), jnp.float32), jnp.zeros((batch, n_kv, K), jnp.int32),
                             num_valid=0, pool_tokens=jnp.full((batch,), -1, jnp.int32), steps=0)


def _tree_nbytes(tree) -> int:
    """Bytes of a pytree's arrays (or their shapes, from eval_shape)."""
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def request_token_bound(layout, batch: int) -> int:
    """The most pool tokens one request can own in this layout: what every per-request buffer (selection
    indices, row buffers, a whole-context head's selection) is sized by. From the planner
    (`PoolLayout.request_blocks`: the longest prompt's full blocks plus one block per lockstep flush); for a
    layout that does not say, every prompt block (as if one request held them all) plus its share of the
    generated blocks."""
    if layout.request_blocks:
        return layout.block_tokens * min(layout.num_blocks, layout.request_blocks)
    prompt = layout.start(layout.prompt_extents)
    gen = layout.num_blocks - prompt
    return layout.block_tokens * min(layout.num_blocks, prompt + -(-gen // max(1, batch)))


class TokenSelectHooks(LayerHooks):
    name = "tokenselect"
    kinds = ("kv",)
    # the layer programs read the pool in place (selected rows; no extent is ever moved whole), so an extent
    # is only an allocation and, per extent, leaves of every layer call (pool arrays, block table, counts, first
    # positions, Quest pages): clo at 128K (Llama-3-8B) has 66 arguments in 4 extents, 42 in one, and on an H100
    # the host's cost of a layer call fell from 574-658 to 477-562 us (BENCHMARKS,
    # host cost). Capped so one extent stays well inside 32-bit element offsets (1M tokens: 2 extents).
    extent_mb_per_device = IN_PLACE_EXTENT_MB

    def __init__(self, attend: TokenSelectAttend, split: bool = False, store: str = "kv", replay_hit_rate=None):
        self.attend = attend
        self.split = split  # kv=split: K extents on the device, V extents in the host pool
        self.store = store  # kv | act | auto: per layer, the host pool holds V (or K/V) rows or activations X
        self.stores: tuple = ()  # per layer, decided at prefill (`pool_layouts`)
        self.device_layers: tuple = ()  # per layer: every head persistent (`device_layer`), decided with the stores
        self.store_reasons: tuple = ()
        self.x_row_bytes = 0.0  # one token's X as the host pool stores it
        self.replay_hit_rate = replay_hit_rate  # checked values (a number or one per layer), or None

    def sliding_refusal(self, pipe) -> str | None:
        return (f"{self.name}'s selection scores and gathers rows of the whole context, so a sliding layer would "
                "attend keys older than its window (a local layer as full attention over its window is not built "
                "yet); use 'full', 'offload', 'kvpr' or 'hybrid'")

    def replay_rates(self, cfg) -> np.ndarray | None:
        """[L] the replayed reuse probability per layer, or None (the similarity rule decides)."""
        return replay_rates(self.replay_hit_rate, cfg.num_layers, self.option_error)

    option_error = TokenSelectOptionError

    def replay_description(self) -> dict:
        """What describe() says about the cache decision."""
        if self.replay_hit_rate is None:
            return {"cache_decision": "similarity rule"}
        rate = self.replay_hit_rate
        return {"cache_decision": "REPLAYED: each look at a valid cached selection (per request, layer, KV head and "
                                  "step) reuses it with probability replay_hit_rate (a seeded Bernoulli draw on the "
                                  "device); the similarity rule is computed and counted but does not decide",
                "replay_hit_rate": float(rate) if np.ndim(rate) == 0 else [float(x) for x in rate]}

    def keys_on_device(self, pipe) -> bool:
        return self.split

    # -- store=kv|act|auto: which layers keep activations in place of V (or K and V) -----------------
    def persistent_for_stores(self, pipe, model, layout, batch: int, K: int):
        """[L, n_kv] bool: heads that select their whole context (clo's persistent heads; none here)."""
        return np.zeros((model.config.num_layers, model.config.num_kv_heads), bool)

    def choose_stores(self, pipe, model, layout, batch: int):
        """(stores, reasons) per layer: "kv" or "act". store=auto asks the cost model per layer
        (`plan.split.choose_row_store`: one re-selection's rows as K/V (V) rows or as the X rows of the union
        of the heads' selections plus their recomputation; the union estimated for independent heads, a
        persistent head's being the whole context); store=kv|act as asked, with the cost model's view."""
        from kvoffload.plan.split import choose_row_store, expected_union

        cfg = model.config
        n_kv, L = cfg.num_kv_heads, cfg.num_layers
        K = self.static_budget(layout, batch)
        bound = request_token_bound(layout, batch)
        persistent = self.persistent_for_stores(pipe, model, layout, batch, K)
        forced = self.attend.num_sink + self.attend.num_recent
        # a layer whose every head selects its whole context keeps its K/V blocks on the GPU (`device_layer`)
        self.device_layers = tuple(bool(x) for x in persistent.all(1))
        stores, reasons = [], []
        for layer in range(L):
            if self.device_layers[layer]:
                stores.append("kv")
                reasons.append("kv: every head persistent, so the layer's K/V blocks stay on the GPU in the model's "
                               "dtype and it attends them whole, as `full` does")
                continue
            n_p = int(persistent[layer].sum())
            kv_tokens = batch * (n_p * bound + (n_kv - n_p) * K) / n_kv
            x_tokens = batch * (bound if n_p else expected_union(K, bound, n_kv, forced))
            plan = choose_row_store(pipe.cost, pipe.shape(model), k_on_device=self.keys_on_device(pipe),
                                    kv_tokens=kv_tokens, x_tokens=x_tokens)
            if self.store == "auto":
                stores.append(plan.store), reasons.append(plan.reason)
            else:
                stores.append(self.store)
                reasons.append(f"{self.store}: as asked (store={self.store}); the cost model: {plan.reason}")
        return tuple(stores), tuple(reasons)

    def device_layer(self, pipe, layer) -> bool:
        return bool(self.device_layers and self.device_layers[layer])

    def pool_layouts(self, pipe, model, dtype, rows, lengths, capacity):
        layouts = super().pool_layouts(pipe, model, dtype, rows, lengths, capacity)
        if not self.split:
            return layouts
        a, z = rows[0]
        self.stores, self.store_reasons = self.choose_stores(pipe, model, layouts[0], z - a)
        self.x_row_bytes = pipe.shape(model).x_host_tok
        if "act" in self.stores:  # activation extents beside K/V ones; each layer keeps its parts (layer_parts)
            layouts = [dataclasses.replace(lay, act_extents=(0, lay.num_extents)) for lay in layouts]
        return layouts

    def layer_parts(self, pipe, layer):
        if not self.stores or "act" not in self.stores:
            return None
        keys = ("k",) if self.keys_on_device(pipe) else ()
        return keys + (("x",) if self.stores[layer] == "act" else ("v",) if keys else ("k", "v"))

    def store_report(self, state=None) -> dict:
        """describe's view of store=kv|act|auto: per layer the choice and why; X rows and bytes read."""
        out = {"store": self.store, "store_per_layer": list(self.stores), "store_reasons": list(self.store_reasons)}
        if state is not None and state.groups and state.groups[0].slots and "act" in self.stores:
            sel = lambda s: getattr(s, "selection", s)  # noqa: E731  (clo's slots hold a SelectionCache)
            rows = [sum(int(np.asarray(sel(gr.slots[i]).x_rows).sum()) for gr in state.groups)
                    for i in range(len(self.stores))]
            out.update(x_rows_fetched=int(sum(rows)), x_bytes_fetched=int(sum(rows) * self.x_row_bytes),
                       x_bytes_fetched_per_layer=[int(r * self.x_row_bytes) for r in rows])
        return out

    def fetches_extents(self, pipe) -> bool:
        return not self.split  # kv=split reads the selected rows in place; kv=gpu: a device pool

    def slot_parts(self, slot) -> dict:
        """GPU bytes of one layer's slots by part name (the memory plan's entries)."""
        return {"selection cache (queries, indices)": _tree_nbytes(slot)}

    def slot_specs(self, slot):
        """Where one layer's slots live on a tensor-parallel mesh (`selection_specs`)."""
        return selection_specs(slot)

    def slot_memory(self, pipe, model, layouts, batch):
        """One device's slot bytes, from their shapes (``jax.eval_shape`` of `slot_maker`'s function: nothing
        allocated; on a mesh each device's share, `slot_specs`), for GPU batches of equal size (the default
        `group_rows`)."""
        b = -(-batch // max(1, len(layouts)))
        out: dict = {}
        for layout in layouts:
            for one in jax.eval_shape(self.slot_maker(pipe, model, layout, b)):
                for k, v in self.slot_parts(device_shapes(one, self.slot_specs(one), pipe.tp)).items():
                    out[k] = out.get(k, 0) + v
        if "act" in self.stores:  # one layer's X rows of the largest union (whole on every device) and their K/V
            cfg = model.config
            p = jnp.dtype(model.params.layers[0].wk.dtype).itemsize
            cap = max(union_tiers(self.static_budget(lay, b), cfg.num_kv_heads, request_token_bound(lay, b))[-1]
                      for lay in layouts)
            kv_tok = S.device_config(cfg, pipe.tp).kv_bytes_per_token
            out["activation-row recompute workspace"] = b * cap * (cfg.hidden_size + kv_tok) * p
        return out

    def plan_group(self, pipe, model, group):
        plan = super().plan_group(pipe, model, group)
        if not self.split:
            return plan
        # every extent as the pool holds it ("dev": the pool's own array, nothing fetched): K in device
        # memory, V in host memory read in place; the cost model then counts no transfer either
        return dataclasses.replace(plan, modes=("dev",) * group.layout.num_extents)

    def static_budget(self, layout, batch: int) -> int:
        """K: the selected tokens per (request, KV head), static for the run (the slots' shape)."""
        a = self.attend
        bound = request_token_bound(layout, batch)
        if a.token_budget is not None:
            k = a.token_budget
        else:  # the ratio of the longest context this layout holds (its tail included)
            k = max(math.ceil(a.token_ratio * (bound + 2 * layout.block_tokens)), a.num_sink + a.num_recent,
                    a.token_min)
        ps = a.page_size
        return max(ps, min(-(-k // ps) * ps, bound))

    def slot_maker(self, pipe, model, layout, batch):
        """A function of no arguments making the slots' arrays (every host-side decision taken before), so
        that `init_slots` runs it and `slot_memory` takes its shapes."""
        cfg = model.config
        K = self.static_budget(layout, batch)
        rates = self.replay_rates(cfg)

        def make():  # each layer its own arrays: a layer's program donates its slots
            def one(i):
                sel = empty_selection(batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, K)
                return sel if rates is None else with_replay(sel, rates[i], i)
            return tuple(one(i) for i in range(cfg.num_layers))
        return make

    def init_slots(self, pipe, model, layout, batch):
        # committed, like a step's outputs (no recompilation); on a mesh split by head (`slot_specs`)
        slots = self.slot_maker(pipe, model, layout, batch)()
        return place_slots(pipe, slots, tuple(self.slot_specs(s) for s in slots))

    def reads_rows(self, pipe) -> bool:
        return True  # selected rows by token id (`HostRows`), from extents read in place or fetched

    def sources(self, pipe, group, plan, layer, fetched):
        if self.split:  # the pool's arrays as they are, as for a device pool (no zero stand-ins: nothing fetched)
            pool = PoolSources(k=group.pool_k[layer], v=group.pool_v[layer], x=group.pool_x[layer],
                               recompute=pipe.scalar(0), prompt_extents=group.layout.prompt_extents)
        else:
            pool = super().sources(pipe, group, plan, layer, fetched)
        return SelectSources(pool=pool, tail_len=group.tail_len,
                             request_blocks=request_token_bound(group.layout, group.size) // group.layout.block_tokens)


def check_store(store, error):
    """store=kv|act|auto, or one clear error (tokenselect, clo)."""
    if store not in STORES:
        raise error(f"store must be one of {STORES} (kv: K/V (V) rows in the host pool; act: activations X, the "
                    f"selected tokens' K/V recomputed on the GPU; auto: per layer by the cost model), got {store!r}")


def selection_budget(budget, ratio, num_sink, num_recent, *, default_budget=None, default_ratio=None,
                     names=("token_budget", "token_ratio"), error=TokenSelectOptionError, token_min=0,
                     min_name="token_min"):
    """A selection policy's checked (budget, ratio, num_sink, num_recent, token_min): a token count or a ratio of
    the context (not both; the default when neither is given), sinks and recent tokens >= 0, a count that holds
    them, and with a ratio the fewest tokens to select (token_min >= 0; a ratio of a short context is a handful
    of tokens). names / min_name / error: how the policy calls the options and what it raises (tokenselect,
    clo)."""
    b_name, r_name = names
    if isinstance(token_min, bool) or not isinstance(token_min, (int, np.integer)) or token_min < 0:
        raise error(f"{min_name} must be a whole number of tokens >= 0, got {token_min!r}")
    token_min = int(token_min)
    if budget is not None and ratio is not None:
        raise error(f"give {b_name} (tokens) or {r_name} (of the context), not both")
    if budget is None and ratio is None:
        budget, ratio = default_budget, default_ratio
    num_sink, num_recent = int(num_sink), int(num_recent)
    if num_sink < 0 or num_recent < 0:
        raise error(f"num_sink and num_recent must be >= 0, got {num_sink}, {num_recent}")
    if budget is not None:
        budget = int(budget)
        if budget < max(1, num_sink + num_recent):
            raise error(f"{b_name} ({budget}) must be at least num_sink + num_recent ({num_sink} + {num_recent}) "
                        f"and >= 1")
        if token_min:
            raise error(f"{min_name} is the floor of a {r_name} selection; with {b_name} (a fixed count) leave it out")
    else:
        ratio = float(ratio)
        if not 0 < ratio <= 1:
            raise error(f"{r_name} must be in (0, 1], got {ratio}")
    return budget, ratio, num_sink, num_recent, token_min


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
                   conditionals=None, topk_method="auto", token_min=0):
        if extrapolate not in (True, False):
            raise TokenSelectOptionError(f"extrapolate must be true or false, got {extrapolate!r}")
        if kv not in PLACEMENTS:
            raise TokenSelectOptionError(f"kv must be one of {PLACEMENTS}, got {kv!r}")
        check_store(store, TokenSelectOptionError)
        if store != "kv" and kv != "split":
            raise TokenSelectOptionError(f"store={store!r} applies to kv=split (a host pool holding V rows or activations); "
                                         f"kv={kv!r} keeps the pool on the GPU")
        page_size = int(page_size)
        blk = self.options.block_tokens
        if page_size < 1 or blk % page_size:
            raise TokenSelectOptionError(f"page_size must divide block_tokens ({blk}), got {page_size}")
        token_budget, token_ratio, num_sink, num_recent, token_min = selection_budget(
            token_budget, token_ratio, num_sink, num_recent, default_budget=DEFAULT_BUDGET, token_min=token_min)
        replay_rates(replay_hit_rate)  # the values checked here, their number once the model is known
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
                                   conditionals=conditionals, topk_method=topk_method, token_min=token_min)
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
                          "topk_method": a.topk_method}
        if self.pipeline.hooks.split:
            d["selection"].update(self.pipeline.hooks.store_report(state))
        d["selection"].update(self.pipeline.hooks.replay_description())
        if state is not None and state.groups and state.groups[0].slots:
            d["selection"]["selected_per_head"] = int(state.groups[0].layer_slot(0).indices.shape[-1])
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


def hit_rates(state) -> dict:
    """Selection-cache hit rates over every request of the run: per layer and KV head, per layer, overall;
    and per layer the fraction of steps on which the scoring ran."""
    by_group = [gr.slots_by_layer() for gr in state.groups]  # a looped run's copied out of its stack
    hits = sum(np.stack([np.asarray(s.hits).sum(0) for s in sl]) for sl in by_group)  # [L, n_kv]
    looks = sum(np.asarray([int(np.asarray(s.steps).sum()) for s in sl]) for sl in by_group)  # [L]
    scored = sum(np.asarray([int(s.scored) for s in sl]) for sl in by_group)
    steps = max(1, state.step) * len(state.groups)
    looks = np.maximum(looks, 1)
    per_head = hits / looks[:, None]
    out = {"hit_rate": float(hits.sum() / (looks.sum() * hits.shape[1])),
           "hit_rate_per_layer": [round(float(x), 4) for x in per_head.mean(1)],
           "hit_rate_per_layer_head": [[round(float(x), 4) for x in row] for row in per_head],
           "scored_fraction_per_layer": [round(float(x) / steps, 4) for x in scored]}
    slots0 = by_group[0]
    if slots0[0].replay is not None:  # replayed decisions: the configured rates, and what the rule would have done
        rule = sum(np.stack([np.asarray(s.rule_hits).sum(0) for s in sl]) for sl in by_group)
        out["replayed_hit_rate_per_layer"] = [round(float(s.replay.rate), 6) for s in slots0]
        out["similarity_rule_hit_rate"] = float(rule.sum() / (looks.sum() * rule.shape[1]))
        out["similarity_rule_hit_rate_per_layer"] = [round(float(x), 4) for x in (rule / looks[:, None]).mean(1)]
    return out
