"""The selection cache the selective policies share (`tokenselect`, `clo`): one layer's slots hold the query
and selection of the last selection per (request, KV head) (`SelectionCache`), reused while the query stays
similar and the pool has not grown.

The pool grows by whole blocks at a flush (every block_tokens steps): a cached selection stays valid (block
ids never move) but misses the new block, so the cache stores the pool token count it was made at and
re-selects when it changes. The selection work runs under a ``lax.cond`` only when some (request, head) of
the layer misses (`unless_all`, `reuse_or_select`; off the GPU only, `conditionals_default`). With
``replay_hit_rate`` (random-weight speed runs) the reuse of a valid cached selection is a seeded Bernoulli
draw at real-model hit rates instead (`ReplayDraw`, `cache_decision`); the similarity is still computed and
counted. Also here: where the slots live on a tensor-parallel mesh (`selection_specs`, `place_slots`,
`constrain_slots`, `device_shapes`) and the run's hit rates (`hit_rates`, for describe)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload.device import sharding as S
from kvoffload.policies.options import PolicyOptionError


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
    # per extent, the copy of the pool's keys the vote reads ([E, n_kv, blk, ...] in block-slot order, kept by the
    # policy's `keys_written`; `selection.vote_keys`), or () where the vote reads the pool's keys themselves
    vote: tuple = ()

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
    error = error or PolicyOptionError
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
                          replay=None if sel.replay is None else ReplayDraw(rate=rep, key=rep),
                          vote=jax.tree.map(lambda _: heads, sel.vote))


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


def empty_selection(batch, H, n_kv, d, K) -> SelectionCache:
    """A selection cache that has selected nothing yet (pool_tokens -1: the first step selects)."""
    return SelectionCache.of(jnp.zeros((batch, H, d), jnp.float32), jnp.zeros((batch, n_kv, K), jnp.int32),
                             num_valid=0, pool_tokens=jnp.full((batch,), -1, jnp.int32), steps=0)


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


def hit_rates(state) -> dict:
    """Selection-cache hit rates over every request of the run: per layer and KV head, per layer, overall;
    and per layer the fraction of steps on which the scoring ran."""
    by_group = [gr.slots for gr in state.groups]
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
