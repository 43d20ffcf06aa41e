"""Policy `clo` (retrieval=exact): against `full` when everything is selected and nothing
reused, the per-head thresholds and GQA aggregation against the paper's formulas worked by hand, the
cache's reuse rule around tau (and its V-row buffer), persistent heads, a small top-k, options
(CPU, tiny random models, fp32)."""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload import ops
from kvoffload.plan.deploy import group_similarity
from kvoffload.models import tiny_random_model
from kvoffload.runtime.attention import PoolSources
from kvoffload.plan.clo import CloProfile, kv_thresholds, plan_persistent_heads, save_clo_profile
from kvoffload.policies import clo as clo_mod
from kvoffload.policies.clo import rows as clo_rows
from kvoffload.policies import make_policy
from kvoffload.policies.clo import CloAttend, CloOptionError, CloSlots, exact_scores
from kvoffload.policies.selection.cache import COUNTS, SelectionCache
from kvoffload.policies.selection.rows import SelectSources
# the same ragged prompts, blocks and decode loop as tokenselect's tests
from test_tokenselect import BLOCK, NEW, PROMPTS, _decode, _pool, _with_cosine


# OPT (MHA) behind the slow marker: the default suite keeps the GQA family, where the group aggregation acts
@pytest.fixture(scope="module", params=[pytest.param("opt", marks=pytest.mark.slow), "llama"])
def ref(request):
    model = tiny_random_model(request.param, seed=1)
    _, logits, _ = _decode(model, "full", NEW)
    return request.param, model, logits


def test_everything_selected_never_reused_equals_full(ref):
    arch, model, want = ref
    pol, got, state = _decode(model, "clo", NEW, topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False)
    assert (got.argmax(-1) == want.argmax(-1)).all(), arch
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    gr = state.groups[0]
    assert gr.since_flush == NEW - BLOCK and gr.used_extents > 1  # a flush, several extents
    c = pol.describe(state)["clo"]
    assert c["hit_rate"] == 0.0 and c["tau"] == [[2.0] * model.config.num_kv_heads] * model.config.num_layers
    assert c["persistent_heads"] == [] and c["v_bytes_fetched"] > 0


def test_persistent_heads_attend_everything_equals_full(ref):
    """Every head persistent but head 0 of layers 1.., a top-k of 8: the persistent heads attend their whole
    context anyway (re-selected only at a flush) and layer 0, all persistent (layer0_full), is a device layer."""
    arch, model, want = ref
    cfg = model.config
    L, n_kv = cfg.num_layers, cfg.num_kv_heads
    some = [(l, h) for l in range(1, L) for h in range(1, n_kv)]
    pol, got, state = _decode(model, "clo", NEW, topk=8, num_recent=4, persistent_heads=some)
    c = pol.describe(state)["clo"]
    assert sorted(map(tuple, c["persistent_heads"])) == sorted(some + [(0, h) for h in range(n_kv)])
    assert c["device_layers"] == [0]
    # the row buffers of a persistent head hold the layer's whole bound; the rest select 8
    slots = state.groups[0].slots
    assert slots[0].dense and slots[0].v_rows.shape[2] == 1 and int(slots[0].scored) == 0
    assert all(s.v_rows.shape[2] > 8 and not s.dense for s in slots[1:])
    pv = state.groups[0].pool_v
    on_host = lambda a: jax.typeof(jax.tree.leaves(a)[0]).memory_space == jax.memory.Space.Host  # noqa: E731
    assert not any(on_host(e) for e in pv[0]) and all(on_host(e) for e in pv[1])

    # every head persistent: every layer a device layer, attended as `full` attends its pool: the same bits
    every = [(l, h) for l in range(L) for h in range(n_kv)]
    pol, got, state = _decode(model, "clo", NEW, topk=8, num_recent=4, persistent_heads=every)
    assert (got.argmax(-1) == want.argmax(-1)).all(), arch
    np.testing.assert_array_equal(got, want)
    c = pol.describe(state)["clo"]
    assert sorted(map(tuple, c["persistent_heads"])) == every and c["device_layers"] == list(range(L))
    assert c["hit_rate"] == 0.0 and c["hit_rate_cached_heads"] is None  # persistent heads count no hits
    assert c["v_bytes_fetched"] == 0 and all(int(s.scored) == 0 for s in state.groups[0].slots)
    mem = pol.pipeline.memory_plan
    assert mem.host["K/V blocks"] == 0 and mem.gpu["K/V blocks (GPU-resident)"] > 0


def test_persistent_heads_reselect_at_a_flush(ref):
    """Persistent heads outside a device layer (layer0_full off, one head of each layer not persistent): the
    whole context, selected at the first step and again after the flush only."""
    arch, model, want = ref
    cfg = model.config
    some = [(l, h) for l in range(cfg.num_layers) for h in range(1, cfg.num_kv_heads)]
    pol, got, state = _decode(model, "clo", NEW, topk_ratio=1.0, fixed_threshold=2.0, persistent_heads=some,
                              layer0_full=False)
    assert (got.argmax(-1) == want.argmax(-1)).all(), arch
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    c = pol.describe(state)["clo"]
    assert c["device_layers"] == [] and sorted(map(tuple, c["persistent_heads"])) == some
    # the persistent heads' V rows: each head's whole pool gathered twice (first step, after the flush)
    gr = state.groups[0]
    fetched = np.stack([np.asarray(s.v_rows_fetched) for s in gr.slots])  # [L, B, n_kv]
    first = (np.asarray([len(p) for p in PROMPTS]) // BLOCK) * BLOCK
    np.testing.assert_array_equal(fetched[:, :, 1:], np.broadcast_to((2 * first + BLOCK)[None, :, None],
                                                                     fetched[:, :, 1:].shape))


# ------------------------------------------------------------------------------------------------
# thresholds and aggregation by hand
# ------------------------------------------------------------------------------------------------


def _tau_by_hand(s, eta, p):
    theta_star = math.acos(eta)
    lam = s ** p
    return math.cos(lam * theta_star + (1 - lam) * math.pi)


def test_thresholds_and_aggregation_by_hand(tmp_path):
    # theta* = arccos(0.8) = 0.643501; s = 0.5, p = 3: lambda = 0.125, theta = 0.125 * 0.643501 + 0.875 pi
    # = 2.829331, tau = cos(2.829331) = -cos(0.312261) = -0.951641; s = 1: tau = eta; s = 0: tau = -1
    assert _tau_by_hand(0.5, 0.8, 3) == pytest.approx(-0.951641, abs=1e-6)
    scores = np.asarray([[1.0, 0.5], [0.0, 0.9]])
    want = np.asarray([[_tau_by_hand(s, 0.8, 3) for s in row] for row in scores])
    np.testing.assert_allclose(want[0, 0], 0.8, atol=1e-12)
    np.testing.assert_allclose(want[1, 0], -1.0, atol=1e-12)
    np.testing.assert_allclose(kv_thresholds(scores, 2, 0.8, 3), want, atol=1e-6)
    # per query head [L, 4] -> the group's mean: heads (0.8, 1.0) -> 0.9
    np.testing.assert_allclose(kv_thresholds([[0.8, 1.0, 0.4, 0.6]] * 2, 2, 0.8, 3)[0],
                               [_tau_by_hand(0.9, 0.8, 3), _tau_by_hand(0.5, 0.8, 3)], atol=1e-6)
    # Eq. 10: sum w / sum (w / c); c = (0.9, 0.6), w = (1, 3): 4 / (1.1111 + 5) = 0.654545
    assert float(group_similarity([0.9, 0.6], [1.0, 3.0])) == pytest.approx(4 / (1 / 0.9 + 3 / 0.6), rel=1e-6)

    # the policy hands these tau and weights to its slots (scores from an .npz as `importance` writes them)
    path = str(tmp_path / "scores.npz")
    np.savez(path, alpha=scores)
    model = tiny_random_model("llama", seed=1)  # 2 layers, 4 query heads, 2 KV heads
    pol, _, state = _decode(model, "clo", 2, importance=path, layer0_full=False)
    np.testing.assert_allclose(pol.describe(state)["clo"]["tau"], want, atol=1e-5)
    for layer, slot in enumerate(state.groups[0].slots):
        np.testing.assert_allclose(np.asarray(slot.tau), want[layer], atol=1e-6)
        np.testing.assert_allclose(np.asarray(slot.weights), np.repeat(scores[layer][:, None], 2, -1), rtol=1e-6)
    # fixed threshold: one value everywhere; no scores for this model: uniform 1.0, tau = eta
    pol, _, state = _decode(model, "clo", 0, fixed_threshold=0.3)
    assert pol.describe(state)["clo"]["tau"] == [[0.3, 0.3], [0.3, 0.3]]
    pol, _, state = _decode(model, "clo", 0, eta=0.7)
    np.testing.assert_allclose(pol.describe(state)["clo"]["tau"], 0.7, atol=1e-6)
    assert pol.describe(state)["clo"]["importance"].startswith("uniform")


# ------------------------------------------------------------------------------------------------
# the reuse rule
# ------------------------------------------------------------------------------------------------


def _cosines_for(target, weights, first):
    """Two query-head cosines (first, c) whose weighted harmonic mean is target."""
    w0, w1 = weights
    return [first, w1 / ((w0 + w1) / target - w0 / first)]


@pytest.mark.parametrize("aggregation", ["harmonic", "min"])
def test_cache_reuses_exactly_when_the_aggregated_similarity_clears_tau(aggregation):
    rng = np.random.default_rng(1)
    owners = [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    layout, alloc, tables, keys, vals = _pool(rng, owners=owners)
    B, H, n_kv, d, G, K = 2, 4, 2, 8, 2, 8
    tau = np.asarray([0.7, 0.5], np.float32)
    weights = np.asarray([[1.0, 3.0], [1.0, 1.0]], np.float32)
    attend = CloAttend(token_budget=K, token_ratio=None, num_sink=0, num_recent=0, gqa_aggregation=aggregation)
    pool_tokens = np.asarray([len(t) for t in alloc.tables]) * layout.block_tokens
    q0 = rng.normal(size=(B, H, d)).astype(np.float32)
    marker_v = np.full((B, n_kv, K, d), 7.0, np.float32)  # the cached V rows: a value no gather gives

    def slots(persistent=(False, False), pool=pool_tokens):
        sel = SelectionCache.of(jnp.asarray(q0), jnp.full((B, n_kv, K), 3, jnp.int32),
                                num_valid=jnp.full((B, n_kv), 1, jnp.int32), pool_tokens=jnp.asarray(pool, jnp.int32),
                                steps=jnp.zeros((B,), jnp.int32))
        return CloSlots(selection=sel, v_rows=jnp.asarray(marker_v), rule=clo_mod.rule_array(tau, weights, persistent),
                        k_rows=jnp.zeros((B, n_kv, K, d), jnp.float32))

    src = SelectSources(pool=PoolSources(k=tuple(map(jnp.asarray, keys)), v=tuple(map(jnp.asarray, vals)),
                                         x=(None,) * len(keys), recompute=jnp.int32(0)),
                        tail_len=jnp.asarray([5, 2], jnp.int32))

    def run(q, s):
        acc = ops.empty_attention(jnp.asarray(q))
        return jax.jit(attend, static_argnums=(0, 7, 8))(None, None, jnp.asarray(q), acc, src, tables, s,
                                                          "reference", "reference")

    # the aggregated similarity 1e-3 above / below tau; request 0: KV head 0 above, 1 below; request 1: the
    # other way round (harmonic: Eq. 10 solved for the second head's cosine; min: the other head at 0.99)
    e = 1e-3
    if aggregation == "harmonic":
        pair = lambda target, h: _cosines_for(target, weights[h], 0.9 if h == 0 else 0.95)  # noqa: E731
    else:
        pair = lambda target, h: [target, 0.99]  # noqa: E731
    cos = np.asarray([pair(tau[0] + e, 0) + pair(tau[1] - e, 1), pair(tau[0] - e, 0) + pair(tau[1] + e, 1)])
    q1 = np.stack([[_with_cosine(q0[b, h], cos[b, h], rng) for h in range(H)] for b in range(B)])
    agg = np.asarray(group_similarity(cos.reshape(B, n_kv, G), weights[None])) if aggregation == "harmonic" \
        else cos.reshape(B, n_kv, G).min(-1)
    np.testing.assert_allclose(agg, [[tau[0] + e, tau[1] - e], [tau[0] - e, tau[1] + e]], atol=1e-5)
    reuse = np.asarray([[True, False], [False, True]])
    (out, _), new = run(q1, slots())
    idx, out = np.asarray(new.selection.indices), np.asarray(out)
    for b in range(B):
        for h in range(n_kv):
            assert (idx[b, h] == 3).all() == reuse[b, h], (b, h)
            # a hit attends its cached selection (one row) with the cached V rows: exactly the buffer's 7.0
            assert np.allclose(out[b, 2 * h:2 * h + 2], 7.0) == reuse[b, h], (b, h)
    np.testing.assert_array_equal(np.asarray(new.selection.hits), reuse.astype(int))
    np.testing.assert_array_equal(np.asarray(new.v_rows_fetched), np.where(reuse, 0, K))
    assert int(new.selection.scored) == 1
    # the re-selected heads: the top 8 of max over the group of q.k (float64)
    flat_k = np.concatenate(keys).transpose(1, 0, 2, 3).reshape(n_kv, -1, d).astype(np.float64)
    for b, h in zip(*np.nonzero(~reuse)):
        own = np.zeros(flat_k.shape[1], bool)
        for blk_id in alloc.tables[b]:
            own[blk_id * 4:(blk_id + 1) * 4] = True
        s = np.where(own, np.max(q1[b, 2 * h:2 * h + 2].astype(np.float64) @ flat_k[h].T, axis=0), -np.inf)
        # best first (clo without speculation needs no order), the set of the top 8
        np.testing.assert_array_equal(np.sort(idx[b, h]), np.sort(np.argsort(-s, kind="stable")[:K]))
    # persistent heads: reuse while the pool is unchanged whatever the query (no hit counted); a grown
    # pool re-selects them: every token of the request
    (_, _), pers = run(-q1, slots(persistent=(True, True)))
    assert int(pers.selection.scored) == 0 and (np.asarray(pers.selection.hits) == 0).all()
    (_, _), grown = run(q0, slots(persistent=(True, False), pool=pool_tokens - 4))
    nv = np.asarray(grown.selection.num_valid)
    np.testing.assert_array_equal(nv[:, 0], [min(K, n) for n in pool_tokens])
    np.testing.assert_array_equal(nv[:, 1], K)  # re-selected at cosine 1: the pool grew


def test_exact_scores_max_over_the_group():
    rng = np.random.default_rng(0)
    owners = [0, 1, 0, 1, 0, -1, 1, 0, 1, 0, 0]
    layout, alloc, tables, keys, _ = _pool(rng, owners=owners)
    q = rng.normal(size=(2, 6, 8)).astype(np.float32)
    got = np.asarray(jax.jit(exact_scores)(jnp.asarray(q), [jnp.asarray(k) for k in keys], tables))
    flat = np.concatenate(keys).transpose(1, 0, 2, 3).reshape(2, -1, 8).astype(np.float64)
    for b, ids in enumerate(alloc.tables):
        own = np.zeros(flat.shape[1], bool)
        for i in ids:
            own[i * 4:(i + 1) * 4] = True
        for h in range(2):
            want = np.max(q[b, 3 * h:3 * h + 3].astype(np.float64) @ flat[h].T, axis=0) / np.sqrt(8)
            np.testing.assert_allclose(got[b, h][own], want[own], rtol=1e-5, atol=1e-6)
            assert np.isneginf(got[b, h][~own]).all()


@functools.partial(jax.jit, static_argnames=("scoring", "K", "page"))
def _selection(scoring, q, keys, tables, space, context, n_select, K, w, page):
    """(indices, num_valid) of one scoring over a token space (the whole pool's where space is None)."""
    from kvoffload.plan.deploy import encode_keys
    from kvoffload.policies.selection.choose import choose_tokens
    from kvoffload.policies.selection.space import token_positions, token_space
    from kvoffload.policies.tokenselect import soft_vote

    blk = keys[0].shape[2]
    space = token_space(tables, blk) if space is None else space
    if scoring == "quest":
        meta = [clo_mod.key_metadata(k, None, "quest", page) for k in keys]
        scores = clo_mod.quest_token_scores(q, meta, tables, blk, space)
    elif scoring == "hata":
        scores = clo_mod.hata_token_scores(q, [(encode_keys(w, k),) for k in keys], w, tables, space)
    elif scoring == "vote":
        scores = soft_vote(q, keys, tables, space=space)
    else:
        scores = exact_scores(q, keys, tables, space)
    assert scores.shape[-1] == space.valid.shape[1] * blk
    positions = token_positions(tables, blk) if space.blocks is None else space.positions(tables)
    idx, nv = choose_tokens(scores, positions, None, context, n_select, K, 2, 3, page if scoring == "quest" else 1,
                            token_ids=space.token_ids())
    return idx, nv


@pytest.mark.parametrize("scoring", ["exact"] + [pytest.param(s, marks=pytest.mark.slow) for s in ("quest", "hata", "vote")])
def test_per_request_selection_equals_the_pools_and_each_request_alone(scoring):
    """A ragged batch of 3 (blocks interleaved over 3 extents, one free slot) scored and ranked over each
    request's own blocks (`token_space` with a bound: [B, n_kv, R blk], not the batch's pool) selects the same
    pool tokens as over the batch's whole pool, and the same positions as each request alone at batch 1 in a
    pool of its own (hata: integer scores, many ties, broken alike)."""
    from kvoffload.runtime.pool import BlockTables
    from kvoffload.policies.selection.space import token_positions, token_space

    rng = np.random.default_rng(5)
    blk, n_kv, G, d, page, K = 8, 2, 3, 16, 4, 16
    owners = [0, 1, 2, 0, 1, 2, 0, -1, 2, 0, 1, 2, 0, 2, 0, 0]  # 7, 3 and 5 blocks, position-major
    layout, alloc, tables, keys, _ = _pool(rng, n_kv=n_kv, d=d, blk=blk, sizes=(5, 5, 6), owners=owners)
    B = 3
    q = jnp.asarray(3 * rng.normal(size=(B, n_kv * G, d)), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (n_kv, d, 64)) / np.sqrt(d)
    own = np.asarray([len(t) for t in alloc.tables])
    context = jnp.asarray(own * blk + np.asarray([2, 5, 1]) + 1, jnp.int32)
    n_select = jnp.asarray([16, 12, 16], jnp.int32)
    args = (context, n_select, K, w, page)
    space = token_space(tables, blk, 8)  # a bound above the longest request's 7 blocks
    assert space.blocks.shape == (B, 8)
    keys = [jnp.asarray(k) for k in keys]
    got, nv = map(np.asarray, _selection(scoring, q, keys, tables, space, *args))
    pool, pool_nv = map(np.asarray, _selection(scoring, q, keys, tables, None, *args))
    np.testing.assert_array_equal(nv, pool_nv)
    kept = np.arange(K) < nv[..., None]  # past num_valid: ignored (and not the same with pages)
    np.testing.assert_array_equal(np.where(kept, got, -1), np.where(kept, pool, -1))
    assert (nv == np.minimum(np.asarray(n_select), own * blk)[:, None]).all()
    pos = np.asarray(token_positions(tables, blk))
    flat = np.concatenate([np.asarray(k) for k in keys])
    for b, ids in enumerate(alloc.tables):  # alone: its blocks in two extents of 4 and 5 slots, free slots after
        n1 = len(ids) // 2
        parts = (ids[:n1], ids[n1:])
        alone_keys = [jnp.asarray(np.concatenate([flat[p], rng.normal(size=(size - len(p), n_kv, blk, d))]), jnp.float32)
                      for p, size in zip(parts, (4, 5))]
        alone = BlockTables(table=tuple(jnp.arange(size, dtype=jnp.int32)[None] for size in (4, 5)),
                            count=tuple(jnp.asarray([len(p)], jnp.int32) for p in parts),
                            first_pos=tuple(jnp.asarray(np.where(np.arange(size) < len(p), np.arange(size) + start, 0) * blk,
                                                        jnp.int32) for p, size, start in zip(parts, (4, 5), (0, n1))))
        one, one_nv = map(np.asarray, _selection(scoring, q[b:b + 1], alone_keys, alone, None, context[b:b + 1],
                                                 n_select[b:b + 1], *args[2:]))
        np.testing.assert_array_equal(one_nv[0], nv[b])
        alone_pos = np.asarray(token_positions(alone, blk))
        for h in range(n_kv):
            np.testing.assert_array_equal(alone_pos[one[0, h, :nv[b, h]]], pos[got[b, h, :nv[b, h]]], err_msg=f"{b} {h}")


# ------------------------------------------------------------------------------------------------
# a small top-k, plan, options
# ------------------------------------------------------------------------------------------------


def test_buffers_sized_per_request_and_counted_by_the_plan():
    """Per-(request, head) buffers hold one request's tokens, not the batch's pool: the most one request owns is
    its prompt's full blocks plus one block per flush (`PoolLayout.request_blocks`). Layer 0 (whole context) and
    a ratio top-k are sized by it, the memory plan counts the same bytes, and generating up to the capacity
    (every flush) with every head of every layer persistent (device layers) still attends every token: `full`'s
    logits."""
    model = tiny_random_model("llama", seed=1)
    cfg = model.config
    capacity, steps = 128, 128 - max(map(len, PROMPTS))  # the longest prompt reaches the capacity
    bound = BLOCK * (max(map(len, PROMPTS)) // BLOCK + (capacity - max(map(len, PROMPTS))) // BLOCK)
    # one persistent head in layer 0 (not all: a device layer keeps no buffers)
    pol, _, state = _decode(model, "clo", 0, topk_ratio=0.5, topk_min=0, layer0_full=False,
                            persistent_heads=[(0, 0)])
    gr = state.groups[0]
    assert gr.layout.request_blocks * BLOCK == bound == 112
    assert gr.layout.num_blocks * BLOCK > 2 * bound  # the batch's pool: what the buffers were sized by
    k0, k1 = (s.selection.indices.shape[-1] for s in gr.slots)
    assert k0 == bound and k1 == math.ceil(0.5 * (bound + 2 * BLOCK))  # layer 0's head whole; the ratio of one request
    row = len(PROMPTS) * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K or V row of every (request, head)
    plan = pol.pipeline.memory_plan
    # exact without speculation: K and V rows buffered (a hit reads only the buffers)
    assert all(s.k_rows is not None and s.k_rows.shape == s.v_rows.shape for s in gr.slots)
    assert plan.gpu["row buffers (selected K/V rows)"] == 2 * row * (k0 + k1) == sum(
        s.v_rows.nbytes + s.k_rows.nbytes for s in gr.slots)
    pol_s, _, state_s = _decode(model, "clo", 0, topk_ratio=0.5, topk_min=0, speculative_prefetch=True,
                                layer0_full=False, persistent_heads=[(0, 0)])
    assert all(s.k_rows is None for s in state_s.groups[0].slots)  # speculating: K rows read from the K extents
    assert pol_s.pipeline.memory_plan.gpu["row buffers (selected K/V rows)"] == row * (k0 + k1)
    _, want, _ = _decode(model, "full", steps)
    every = [(l, h) for l in range(cfg.num_layers) for h in range(cfg.num_kv_heads)]
    _, got, state = _decode(model, "clo", steps, topk=8, num_recent=4, persistent_heads=every)
    assert state.groups[0].layout.request_blocks == max(len(t) for t in state.groups[0].alloc.tables)  # all used
    np.testing.assert_array_equal(got, want)


def test_small_topk_runs_and_selects_only_top_k():
    model = tiny_random_model("llama", seed=1)
    _, want, _ = _decode(model, "full", 6)
    pol, got, state = _decode(model, "clo", 6, topk=12, num_recent=4, eta=0.5)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], want[0])  # the prefill is the same
    assert np.abs(got[1:] - want[1:]).max() > 1e-3  # attending 12 pool tokens changes the logits
    c = pol.describe(state)["clo"]
    assert c["persistent_heads"] == [[0, 0], [0, 1]]  # layer 0 full by default
    rates = np.asarray(c["hit_rate_per_layer_head"])
    assert ((rates >= 0) & (rates <= 1)).all() and (rates[0] == 0).all()
    assert 0 <= c["hit_rate_cached_heads"] <= 1 and c["v_bytes_fetched_cached_heads"] > 0
    gr = state.groups[0]
    pool = np.asarray([len(t) for t in gr.alloc.tables]) * BLOCK
    l0, l1 = gr.slots
    assert l0.dense and c["device_layers"] == [0]  # layer 0 whole: its blocks on the GPU, attended as `full` does
    np.testing.assert_array_equal(np.asarray(l1.selection.num_valid), np.minimum(pool, 12)[:, None].repeat(2, 1))


def test_plan_uses_plan_persistent_heads_with_the_profile(tmp_path, monkeypatch):
    """persistent_heads='plan' takes the shipped profile's s_hat and the shipped scores (here stand-ins for
    the tiny model) through `plan_persistent_heads`; a model they do not describe is refused."""
    model = tiny_random_model("llama", seed=1)
    cfg = model.config
    with pytest.raises(CloOptionError, match="SmolLM2"):
        _decode(model, "clo", 0, persistent_heads="plan")
    alpha = np.asarray([[1.0, 0.9], [1.0, 0.2]])
    s_hat = np.asarray([[0.5, 0.5], [0.1, 0.99]])
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"model_type": "llama", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                  "alpha": alpha.tolist()}))
    prof = tmp_path / "profile.json"
    save_clo_profile(str(prof), CloProfile(model="tiny", date="now", s_hat_q=np.repeat(s_hat, 2, -1), s_hat=s_hat,
                                           aggregation="mean", num_sequences=1, num_pairs=10, skip=0))
    from kvoffload.policies.clo import hooks as clo_hooks  # where the shipped files are looked up

    monkeypatch.setattr(clo_hooks, "SHIPPED_SCORES", str(scores))
    monkeypatch.setattr(clo_hooks, "SHIPPED_PROFILE", str(prof))
    pol, _, state = _decode(model, "clo", 1, persistent_heads="plan", topk=8, num_recent=4)
    gr = state.groups[0]
    pipe = pol.pipeline
    want, _ = plan_persistent_heads(cfg, pipe.cost, pipe.shape(model), s_hat, alpha, batch=len(PROMPTS),
                                    context=pipe.hooks.chosen["bound"], k_tokens=8, sink=4, recent=4, dtype_bytes=4)
    got = np.asarray([np.asarray(s.persistent) for s in gr.slots])
    np.testing.assert_array_equal(got, want)
    assert pol.describe(state)["clo"]["importance"] == str(scores)


def test_options_are_checked():
    with pytest.raises(CloOptionError, match="retrieval must be one of"):
        make_policy("clo", retrieval="faiss")
    with pytest.raises(CloOptionError, match="gqa_aggregation"):
        make_policy("clo", gqa_aggregation="mean")
    with pytest.raises(CloOptionError, match="not both"):
        make_policy("clo", topk=100, topk_ratio=0.1)
    with pytest.raises(CloOptionError, match="persistent_heads"):
        make_policy("clo", persistent_heads="all")
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("clo", top_k=64)
    model = tiny_random_model("llama", seed=1)
    with pytest.raises(CloOptionError, match="out of range"):
        _decode(model, "clo", 0, persistent_heads=[(5, 0)])


REPLAY_OPTS = dict(topk=12, num_recent=4)


@pytest.mark.slow  # 7 s of its own compilation; the default suite checks the replayed decisions below
def test_replay_zero_equals_a_threshold_never_cleared():
    """replay_hit_rate 0: the logits and rows fetched of a threshold no similarity clears, no hits."""
    model = tiny_random_model("llama", seed=1)
    pol0, want, want_state = _decode(model, "clo", NEW, fixed_threshold=1.5, **REPLAY_OPTS)
    pol, got, state = _decode(model, "clo", NEW, replay_hit_rate=0.0, **REPLAY_OPTS)
    np.testing.assert_array_equal(got, want)
    c, c0 = pol.describe(state)["clo"], pol0.describe(want_state)["clo"]
    assert c["hit_rate"] == 0.0 and c["v_bytes_fetched"] == c0["v_bytes_fetched"]
    assert c0["cache_decision"] == "similarity rule" and "replayed_hit_rate_per_layer" not in c0


def test_replayed_hit_rate_decides_reuse_of_cached_heads():
    """replay_hit_rate (shared with tokenselect): 0 never reuses, 1 reuses every cached head wherever its
    selection is valid; layer 0 (every head persistent: a device layer) selects nothing and counts no hits."""
    model = tiny_random_model("llama", seed=1)
    pol, _, state = _decode(model, "clo", NEW, replay_hit_rate=0.0, **REPLAY_OPTS)
    c = pol.describe(state)["clo"]
    assert c["hit_rate"] == 0.0 and all(int(s.scored) == NEW for s in state.groups[0].slots[1:])
    assert c["cache_decision"].startswith("REPLAYED") and c["replayed_hit_rate_per_layer"] == [0.0, 0.0]

    pol, _, state = _decode(model, "clo", NEW, replay_hit_rate=1.0, **REPLAY_OPTS)
    c = pol.describe(state)["clo"]
    layer0, layer1 = state.groups[0].slots
    assert (np.asarray(layer0.hits) == 0).all()  # persistent (layer0_full)
    np.testing.assert_array_equal(np.asarray(layer1.hits), NEW - 2)  # selects at step 1 and after the flush
    assert c["hit_rate_per_layer"] == [0.0, pytest.approx((NEW - 2) / NEW, abs=1e-4)]
    assert int(layer0.scored) == 0 and int(layer1.scored) == 2  # layer 0: a device layer, nothing to select
    assert np.asarray(layer0.rule_hits).sum() == 0  # the rule's count leaves persistent heads out too
    with pytest.raises(CloOptionError, match="replay_hit_rate"):
        make_policy("clo", replay_hit_rate=-0.1)


@pytest.mark.gpu
def test_gpu_host_values_gather_under_cond():
    """On the GPU: V extents in pinned_host memory, gathered inside the layer program under a lax.cond
    (skipped when every head of the layer hits). Must compile and give `full`'s tokens when everything is
    selected, and run with hits (fixed_threshold=-1: reuse until each flush) at a small top-k."""
    from kvoffload.device import memory as M

    model = tiny_random_model("llama", seed=1)
    _, want, _ = _decode(model, "full", NEW)
    _, got, state = _decode(model, "clo", NEW, topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False)
    assert {M.memory_kind_of(a) for layer in state.groups[0].pool_v for a in layer} == {"pinned_host"}
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    pol, got, state = _decode(model, "clo", NEW, topk=12, num_recent=4, fixed_threshold=-1.0)
    c = pol.describe(state)["clo"]
    assert np.isfinite(got).all() and c["hit_rate_cached_heads"] > 0.5


# ------------------------------------------------------------------------------------------------
# retrieval = quest | hata: metadata on the GPU, K and V on the host
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("retrieval, quest_dtype", [("quest", "keys"), ("quest", "int8"), ("hata", "keys")])
def test_quest_hata_everything_selected_never_reused_equals_full(ref, retrieval, quest_dtype):
    """Everything selected: the retrieval ranks but cannot change what is attended. K lives on the host
    (as V), the plan counts no pool bytes on the GPU, the metadata was written at prefill and the flush."""
    from kvoffload.device import memory as M

    arch, model, want = ref
    pol, got, state = _decode(model, "clo", NEW, retrieval=retrieval, topk_ratio=1.0, fixed_threshold=2.0,
                              layer0_full=False, quest_page_tokens=4, quest_dtype=quest_dtype)
    assert (got.argmax(-1) == want.argmax(-1)).all(), (arch, retrieval)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    gr = state.groups[0]
    assert gr.since_flush == NEW - BLOCK and gr.used_extents > 1
    kinds_k = {M.memory_kind_of(a) for layer in gr.pool_k for a in layer}
    assert kinds_k == {M.memory_kind_of(a) for layer in gr.pool_v for a in layer} == {pol.pipeline.host_kind}
    plan = pol.pipeline.memory_plan
    exact_plan = _decode(model, "clo", 0, topk_ratio=1.0)[0].pipeline.memory_plan  # exact: K on the GPU
    gpu_kv = "K/V blocks (GPU-resident)"
    assert plan.gpu.get(gpu_kv, 0) == 0 and exact_plan.gpu[gpu_kv] > 0
    assert plan.host["K/V blocks"] == exact_plan.host["K/V blocks"] + exact_plan.gpu[gpu_kv]
    c = pol.describe(state)["clo"]
    assert c["retrieval"] == retrieval and c["k_bytes_fetched"] == c["v_bytes_fetched"] > 0
    # the metadata equals the keys' metadata, block by block (prefill's blocks and the flushed ones)
    for layer, s in enumerate(gr.slots):
        for e, ke in enumerate(gr.pool_k[layer]):
            want_meta = clo_mod.key_metadata(jnp.asarray(np.asarray(ke)), s.hata_w, retrieval, 4, quest_dtype)
            assert len(s.meta[e]) == len(want_meta) == {"quest": 2, "hata": 1}[retrieval] + (quest_dtype == "int8")
            for got_m, want_m in zip(s.meta[e], want_meta):
                np.testing.assert_array_equal(np.asarray(got_m), np.asarray(want_m))
    n_meta = sum(x.size * x.dtype.itemsize for s in gr.slots for x in jax.tree.leaves(s.meta))
    assert c["metadata_gpu_bytes"] == n_meta > 0
    # the memory plan: no transfer buffers (nothing fetched), the slots counted part by part, held throughout
    assert plan.gpu["transfer buffers"] == 0 and exact_plan.gpu["transfer buffers"] == 0
    parts = {"selection cache (query labels, indices, per-head rule)": [], "row buffers (selected K/V rows)": [],
             "retrieval metadata": []}
    for s in gr.slots:
        meta = jax.tree.leaves((s.meta, s.hata_w))
        rows = jax.tree.leaves((s.v_rows, s.k_rows))
        parts["retrieval metadata"] += meta
        parts["row buffers (selected K/V rows)"] += rows
        parts["selection cache (query labels, indices, per-head rule)"] += [
            x for x in jax.tree.leaves(s) if not any(x is y for y in meta + rows)]
    for name, arrays in parts.items():
        assert plan.gpu[name] == sum(x.nbytes for x in arrays) > 0 and name not in plan.gpu_phase, name
    if retrieval == "hata":
        cfg = model.config
        assert c["hata_w_gpu_bytes"] == cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 128 * 4


# behind the slow marker, both ways: "native" (12 s): its K plumbing is the offload test's in test_int4_pool.py;
# "int8": slow only
@pytest.mark.slow
@pytest.mark.parametrize("k_quant", ["native", "int8"])
def test_quest_int4_v_rows_with_native_or_int8_keys(k_quant):
    """host_dtype="int4" with int4_k_quant="native" (K extents in the model's dtype) or "int8" (int8 K codes):
    quest's V is int4; with groups of 2 (exact codes) the logits are the native-host run's, and the K bytes
    gathered are the V rows' count times a K row as stored (d x 4 here, or d int8 codes + scales), the V bytes
    times an int4 row (codes + scales)."""
    from kvoffload.device import memory as M

    model = tiny_random_model("llama", seed=1)
    d = model.config.head_dim
    opts = dict(retrieval="quest", quest_page_tokens=4, topk=12, num_recent=4, eta=0.5)
    _, want, _ = _decode(model, "clo", NEW, **opts)
    pol, got, state = _decode(model, "clo", NEW, host_dtype="int4", int4_k_quant=k_quant, int4_group_size=2,
                              **opts)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    gr = state.groups[0]
    for layer in range(1, len(gr.pool_k)):  # layer 0 stays whole on the GPU
        for k, v in zip(gr.pool_k[layer], gr.pool_v[layer]):
            if k_quant == "native":
                assert not isinstance(k, ops.QuantizedInt) and k.dtype == jnp.float32
            else:
                assert isinstance(k, ops.QuantizedInt) and k.bits == 8 and k.codes.shape[-1] == d
            assert isinstance(v, ops.QuantizedInt) and v.bits == 4
            assert M.memory_kind_of(jax.tree.leaves(k)[0]) == M.memory_kind_of(v.codes)
    c = pol.describe(state)["clo"]
    v_row = d // 2 + 8 * (d // 2)  # codes, a float32 step and min per group of 2
    k_row = d * 4 if k_quant == "native" else d + 8 * (d // 2)
    rows = c["v_bytes_fetched"] // v_row
    assert rows > 0 and c["v_bytes_fetched"] == rows * v_row and c["k_bytes_fetched"] == rows * k_row


@pytest.mark.slow  # ~20 s, and it clears JAX's caches (the kernel itself: test_gather, in the default suite)
def test_int_rows_refilled_by_the_dequantizing_kernel_give_the_same_logits(monkeypatch):
    """clo quest with int8 K and int4 V rows, its buffers refilled by ``refill_rows_int_kernel`` (interpret mode:
    what runs on a GPU by default) instead of the gathers + dequantize + where: the same
    logits (up to the kernel's fused multiply-add), and the kernel really ran."""
    from kvoffload.pallas import gather as pallas_gather

    model = tiny_random_model("llama", seed=1)
    opts = dict(retrieval="quest", quest_page_tokens=4, topk=12, num_recent=4, eta=0.5, host_dtype="int4",
                int4_k_quant="int8", int4_group_size=8)
    _, want, _ = _decode(model, "clo", NEW, **opts)
    real, calls = ops.refill_block_rows, []

    def through_the_kernel(buf, extents, tokens, blk, **kw):
        if any(isinstance(x, ops.QuantizedInt) for x in extents):
            calls.append(len(extents))
            kw = {**kw, "impl": "kernel", "interpret": True}
        return real(buf, extents, tokens, blk, **kw)

    monkeypatch.setattr(ops, "refill_block_rows", through_the_kernel)
    monkeypatch.setattr(pallas_gather, "refill_rows_int_kernel",
                        _counted(pallas_gather.refill_rows_int_kernel, calls))
    jax.clear_caches()  # the layer programs were traced with the reference path: trace them again
    try:
        _, got, _ = _decode(model, "clo", NEW, **opts)
    finally:
        jax.clear_caches()  # and let no later test reuse the kernel's traces
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert "kernel" in calls and len(calls) > 1


def _counted(fn, calls):
    def run(*a, **kw):
        calls.append("kernel")
        return fn(*a, **kw)
    return run


def test_quest_bounds_equal_numpy_upper_bound():
    rng = np.random.default_rng(3)
    B, H, n_kv, d, E, blk, page = 2, 6, 2, 8, 5, 16, 4
    q = rng.normal(size=(B, H, d)).astype(np.float32)
    k = rng.normal(size=(E, n_kv, blk, d)).astype(np.float32)
    kmin, kmax = clo_mod.key_metadata(jnp.asarray(k), None, "quest", page)
    # each block against one request's query (its owner's, in the layer), for every request
    got = np.stack([np.asarray(clo_mod.quest_bounds(jnp.broadcast_to(jnp.asarray(q[b]), (E, H, d)), kmin, kmax))
                    .transpose(1, 0, 2) for b in range(B)])  # [B, n_kv, E, P]
    pages = k.reshape(E, n_kv, blk // page, page, d).astype(np.float64)
    lo, hi = pages.min(3), pages.max(3)
    qg = q.reshape(B, n_kv, H // n_kv, 1, 1, d).astype(np.float64)
    want = np.maximum(qg * lo.transpose(1, 0, 2, 3)[None, :, None], qg * hi.transpose(1, 0, 2, 3)[None, :, None])
    want = want.sum(-1).max(2)  # [B, n_kv, E, P]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # an upper bound of every page's q.k, and the library's per-request op agrees
    exact = np.einsum("bhgd,ehpsd->bhgeps", qg[:, :, :, 0, 0], pages).max(2).max(-1)
    assert (got >= exact - 1e-5).all()
    flat = lambda a: jnp.broadcast_to(jnp.swapaxes(a, 0, 1).reshape(1, n_kv, -1, d), (B, n_kv, E * blk // page, d))  # noqa: E731
    op = ops.quest_page_scores(jnp.asarray(q), flat(kmin), flat(kmax), group_reduce="max", impl="reference")
    np.testing.assert_allclose(np.asarray(op).reshape(B, n_kv, E, -1), got, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a recall measurement (10 s); hata equals full is checked by default
def test_hata_selection_overlaps_exact_topk():
    """Random keys and queries, 1024-bit seeded projections: the codes' top 10% holds at least 60% of the
    exact top 10% (chance: 10%); 64 bits hold less (the bound depends on the code length)."""
    from kvoffload.plan.deploy import encode_keys

    rng = np.random.default_rng(4)
    owners = [0] * 16 + [1] * 16
    layout, alloc, tables, keys, _ = _pool(rng, n_kv=2, d=32, blk=16, sizes=(8, 8, 16), owners=owners)
    B, H, n_kv, d = 2, 4, 2, 32
    q = rng.normal(size=(B, H, d)).astype(np.float32)
    exact = np.asarray(exact_scores(jnp.asarray(q), [jnp.asarray(k) for k in keys], tables))
    top = int(0.1 * 256)

    def recall(bits):
        w = jax.random.normal(jax.random.key(0), (n_kv, d, bits)) / np.sqrt(d)
        meta = [(encode_keys(w, jnp.asarray(k)),) for k in keys]
        s = np.asarray(clo_mod.hata_token_scores(jnp.asarray(q), meta, w, tables))
        assert (np.isneginf(s) == np.isneginf(exact)).all()
        out = []
        for b in range(B):
            for h in range(n_kv):
                want = set(np.argsort(-exact[b, h], kind="stable")[:top])
                got = set(np.argsort(-(s[b, h] + rng.uniform(0, 0.5, s.shape[-1])), kind="stable")[:top])  # ties at random
                out.append(len(want & got) / top)
        return float(np.mean(out))

    r_long, r_short = recall(1024), recall(64)
    assert r_long >= 0.6, r_long
    assert r_short < r_long


@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 37.0])
def test_quest_int8_is_the_tightest_bound_in_float32(magnitude):
    """For every channel of many random pages: qmin * scale <= kmin < (qmin + 1) * scale and
    (qmax - 1) * scale < kmax <= qmax * scale, products in float32 as the scoring uses them. A float32
    division alone misses both at the page's largest |key| (the product rounds past the key by an ulp on
    the CPU; on an H200 the division gave -126.00001 for -126, one step too loose)."""
    k = (np.random.default_rng(0).normal(size=(20000, 16, 8)) * magnitude).astype(np.float32)
    kmin, kmax = k.min(1), k.max(1)
    qmin, qmax, scale = (np.asarray(a) for a in clo_mod.quest_int8(jnp.asarray(kmin), jnp.asarray(kmax)))
    s = scale[:, None]
    lo, hi = qmin.astype(np.float32), qmax.astype(np.float32)
    assert (lo * s <= kmin).all() and (hi * s >= kmax).all()
    assert ((lo + 1) * s > kmin).all() and ((hi - 1) * s < kmax).all()
    assert -127 <= qmin.min() and qmax.max() <= 127


def test_quest_int8_pages_bound_every_key_and_stay_close():
    """int8 Quest pages (one scale per page and head, min rounded down, max up): still an upper bound of every
    key's q.k in the page, within one quantization step per channel of the exact pages' bound, and a
    quarter of fp32 pages' bytes (half of bf16's) plus one scale per page."""
    rng = np.random.default_rng(5)
    B, H, n_kv, d, E, blk, page = 2, 6, 2, 16, 4, 16, 4
    q = rng.normal(size=(B, H, d)).astype(np.float32)
    k = rng.normal(size=(E, n_kv, blk, d)).astype(np.float32)
    k[0, 0, :page] = 0.0  # an all-zero page
    k[1, 1, page:2 * page, 3] = 40.0  # a page with one outlier channel: a coarse scale for the rest
    kmin, kmax = clo_mod.key_metadata(jnp.asarray(k), None, "quest", page)
    qmin, qmax, scale = clo_mod.key_metadata(jnp.asarray(k), None, "quest", page, "int8")
    assert qmin.dtype == qmax.dtype == jnp.int8 and scale.shape == (E, n_kv, blk // page)
    lo, hi = (np.asarray(a, np.float32) * np.asarray(scale)[..., None] for a in (qmin, qmax))  # what they stand for
    assert (np.asarray(lo) <= np.asarray(kmin)).all() and (np.asarray(hi) >= np.asarray(kmax)).all()
    step = np.asarray(scale)[..., None]
    assert (np.asarray(kmin) - np.asarray(lo) <= step * (1 + 1e-6)).all()
    assert (np.asarray(hi) - np.asarray(kmax) <= step * (1 + 1e-6)).all()
    assert (np.asarray(lo)[0, 0, 0] == 0).all() and (np.asarray(hi)[0, 0, 0] == 0).all()
    pages = k.reshape(E, n_kv, blk // page, page, d)
    for b in range(B):
        qb = jnp.broadcast_to(jnp.asarray(q[b]), (E, H, d))
        got = np.asarray(clo_mod.quest_bounds(qb, qmin, qmax, scale))  # [E, n_kv, P], the scale after the dots
        np.testing.assert_allclose(got, np.asarray(clo_mod.quest_bounds(qb, lo, hi)), rtol=1e-5, atol=1e-5)
        exact_bound = np.asarray(clo_mod.quest_bounds(qb, kmin, kmax))
        qg = q[b].reshape(n_kv, H // n_kv, d)
        qk = np.einsum("hgd,ehpsd->ehgps", qg, pages).max(-1).max(2)  # [E, n_kv, P]: the best key's q.k
        assert (got >= qk - 1e-4).all() and (got >= exact_bound - 1e-4).all()
        slack = np.abs(qg).sum(-1).max(-1)[None, :, None] * np.asarray(scale)  # one step per channel
        assert (got - exact_bound <= slack + 1e-4).all()
        # a bf16 model scores in bf16 with f32 sums: the f32 bound of its bf16 query, to the sums' rounding
        q16 = qb.astype(jnp.bfloat16)
        got16 = np.asarray(clo_mod.quest_bounds(q16, qmin, qmax, scale))
        assert got16.dtype == np.float32
        np.testing.assert_allclose(got16, np.asarray(clo_mod.quest_bounds(q16.astype(jnp.float32), qmin, qmax, scale)),
                                   rtol=1e-5, atol=1e-4)
    assert qmin.nbytes * 4 == kmin.nbytes


def test_quest_hata_options():
    with pytest.raises(CloOptionError, match="quest_page_tokens"):
        make_policy("clo", retrieval="quest", quest_page_tokens=5, block_tokens=16)
    with pytest.raises(CloOptionError, match="quest_dtype must be one of"):
        make_policy("clo", retrieval="quest", quest_dtype="fp8")
    with pytest.raises(CloOptionError, match="needs retrieval=quest"):
        make_policy("clo", retrieval="exact", quest_dtype="int8")
    with pytest.raises(CloOptionError, match="hata_bits"):
        make_policy("clo", retrieval="hata", hata_bits=100)
    model = tiny_random_model("llama", seed=1)
    with pytest.raises(CloOptionError, match="hata_weights not found"):
        _decode(model, "clo", 0, retrieval="hata", hata_weights="/nonexistent/hata")


# ------------------------------------------------------------------------------------------------
# speculative prefetch
# ------------------------------------------------------------------------------------------------


def test_speculative_prefetch_changes_nothing_attended_and_reports_its_hit_rate():
    """A small top-k with reuse: the speculative run attends the plain run's rows (the true selection's,
    wherever they came from, ascending in both), its layer programs fetch fewer V rows (rows already held are never gathered again),
    and every step record carries the guess's hit rate (device values)."""
    model = tiny_random_model("llama", seed=1)
    opts = dict(topk=12, num_recent=4, eta=0.5)
    plain_pol, plain, plain_state = _decode(model, "clo", NEW, speculative_prefetch=False, **opts)
    pol, got, state = _decode(model, "clo", NEW, speculative_prefetch=True, **opts)
    np.testing.assert_allclose(got, plain, atol=1e-5, rtol=0)
    for s, s0 in zip(state.groups[0].slots, plain_state.groups[0].slots):  # the last step's selections: one set
        nv = np.asarray(s.selection.num_valid)
        np.testing.assert_array_equal(nv, np.asarray(s0.selection.num_valid))
        a, a0 = np.asarray(s.selection.indices), np.asarray(s0.selection.indices)
        for b, h in np.ndindex(nv.shape):
            np.testing.assert_array_equal(a[b, h, :nv[b, h]], a0[b, h, :nv[b, h]])
    c, c0 = pol.describe(state)["clo"], plain_pol.describe(plain_state)["clo"]
    s = c["speculative_prefetch"]
    assert "speculative_prefetch" not in c0 and "guess_hit_rate" not in plain_state.records[-1]
    assert 0 < s["guess_hit_rate"] < 1 and s["guess_hit_rate_per_layer"][0] is None  # layer 0: nothing before it
    assert s["v_bytes_fetched_by_guesses"] > 0
    assert c["v_bytes_fetched"] == s["v_bytes_fetched_by_guesses"] + s["v_bytes_fetched_after_guesses"]
    # the layer programs gather only what the guesses missed (a wrong guess's rows cost extra, counted above)
    assert s["v_bytes_fetched_after_guesses"] < c0["v_bytes_fetched"]
    rates = [float(r["guess_hit_rate"]) for r in state.records]
    assert len(rates) == NEW and all(0 <= x <= 1 for x in rates)
    per = np.stack([np.asarray(r["guess_hit_rate_per_layer"]) for r in state.records])
    assert np.isnan(per[:, 0]).all() and np.allclose(per[:, 1], rates)  # two layers: layer 1's is the step's


# slow (7 s of its own speculative compilations): the default suite checks the speculative path end to end in
# test_speculative_prefetch_changes_nothing_attended_and_reports_its_hit_rate (speculation attends the plain run's
# rows; the plain run equals full in test_everything_selected_never_reused_equals_full)
@pytest.mark.slow
def test_everything_selected_with_speculation_equals_full_and_guesses_everything(ref):
    arch, model, want = ref
    pol, got, state = _decode(model, "clo", NEW, topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False,
                              speculative_prefetch=True)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    s = pol.describe(state)["clo"]["speculative_prefetch"]
    assert s["guess_hit_rate"] == 1.0  # everything selected: the guess is the true selection
    # the layers after the first gather everything through their guesses, nothing after them
    assert s["v_bytes_fetched_after_guesses"] == pol.describe(state)["clo"]["v_bytes_fetched_per_layer"][0]


def _rms_norm_np(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


@pytest.mark.slow  # 23 s (its own compilations); the default suite checks the speculative path end to end above
def test_guess_of_a_layer_equals_numpy_reference(monkeypatch):
    """Layer 1's guess at a decode step: the approximate query from layer 0's input hidden state (the h
    layer 0's program got), through layer 1's RMSNorm, W_Q and RoPE at the new token's position, scores max
    over the group of q.k / sqrt(d) over the request's pool tokens, the top 8 (float64 NumPy)."""
    from kvoffload.runtime import layer as P
    from kvoffload.policies.clo import CloHooks

    model = tiny_random_model("llama", seed=1)
    cfg = model.config
    seen, guesses = [], []
    real_step, real_spec = P.layer_step, CloHooks.speculate

    def spy_step(cfg_, lp, h, *a, **k):
        seen.append(np.asarray(h))
        return real_step(cfg_, lp, h, *a, **k)

    def spy_spec(self, pipe, model_, group, layer, h, positions, slot):
        out = real_spec(self, pipe, model_, group, layer, h, positions, slot)
        # the guess as made: the layer program donates the slots it is given
        guesses.append((layer, np.asarray(h), np.asarray(positions), group, (np.asarray(out.held),
                                                                             np.asarray(out.held_valid))))
        return out

    monkeypatch.setattr(P, "layer_step", spy_step)
    monkeypatch.setattr(CloHooks, "speculate", spy_spec)
    K = 8
    _decode(model, "clo", 2, topk=K, num_sink=0, num_recent=0, fixed_threshold=2.0, layer0_full=False,
            speculative_prefetch=True)
    assert [g[0] for g in guesses] == [1, 1]  # once per step, for the layer after the first
    layer, h, pos, group, slot = guesses[-1]
    np.testing.assert_array_equal(h, seen[-2])  # the input of layer 0 in the same step
    lp = model.params.layers[1]
    x = _rms_norm_np(h[:, 0].astype(np.float64), np.asarray(lp.attn_norm, np.float64), cfg.norm_eps)
    d, H, n_kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = (x @ np.asarray(lp.wq, np.float64)).reshape(-1, H, d)
    ang = pos.astype(np.float64)[:, 0, None] * cfg.rope_theta ** (-np.arange(0, d, 2) / d)  # [B, d/2]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    q = np.concatenate([q[..., :d // 2] * c - q[..., d // 2:] * s, q[..., d // 2:] * c + q[..., :d // 2] * s], -1)
    keys = np.concatenate([np.asarray(k, np.float64) for k in group.pool_k[1]])  # [blocks, n_kv, blk, d]
    blk = keys.shape[2]
    flat = keys.transpose(1, 0, 2, 3).reshape(n_kv, -1, d)
    held, nv = slot
    for b, ids in enumerate(group.alloc.tables):
        own = np.zeros(flat.shape[1], bool)
        for i in ids:
            own[i * blk:(i + 1) * blk] = True
        for kv in range(n_kv):
            score = np.max(q[b, kv * H // n_kv:(kv + 1) * H // n_kv] @ flat[kv].T, axis=0) / np.sqrt(d)
            want = np.sort(np.argsort(-np.where(own, score, -np.inf), kind="stable")[:min(K, own.sum())])
            assert nv[b, kv] == len(want), (b, kv)
            np.testing.assert_array_equal(held[b, kv, :nv[b, kv]], want, err_msg=f"request {b}, KV head {kv}")


def test_miss_fetch_is_exactly_the_true_selection_minus_the_guess():
    """refill_rows: rows of the wanted tokens held in the buffer come from it, only the others are gathered
    from the host extents, and the gathered set is exactly want minus held (per request and KV head)."""
    from kvoffload.device import memory as M

    rng = np.random.default_rng(5)
    B, n_kv, K, d, blk = 2, 2, 12, 8, 4
    ext = [rng.normal(size=(s, n_kv, blk, d)).astype(np.float32) for s in (3, 5)]
    N = 8 * blk
    flat = np.concatenate(ext)

    def sets(n):
        idx = np.zeros((B, n_kv, K), np.int32)
        nv = rng.integers(0, K + 1, size=(B, n_kv)).astype(np.int32)
        nv[0, 0] = nv[1, 1] = n  # heads with every entry
        for b in range(B):
            for h in range(n_kv):
                idx[b, h, :nv[b, h]] = np.sort(rng.choice(N, nv[b, h], replace=False))
        return idx, nv

    held, held_nv = sets(K)
    want, want_nv = sets(K - 2)
    want[1, 1, :6], want_nv[1, 1] = held[1, 1, :6], 6  # one head wholly held: nothing to gather
    marker = np.full((B, n_kv, K, d), 7.0, np.float32)  # the buffer: a value no gather gives
    host = [M.to_host(jnp.asarray(e)) for e in ext]
    _, _, missing, count = jax.jit(clo_rows.missing_rows)(*map(jnp.asarray, (held, held_nv, want, want_nv)))
    (rows,), fetched, _ = jax.jit(clo_mod.refill_rows, static_argnums=6)(
        jnp.asarray(held), jnp.asarray(held_nv), (jnp.asarray(marker),), jnp.asarray(want), jnp.asarray(want_nv),
        (host,), blk)
    missing, count, rows, fetched = map(np.asarray, (missing, count, rows, fetched))
    np.testing.assert_array_equal(fetched, count)
    for b in range(B):
        for h in range(n_kv):
            w, hd = want[b, h, :want_nv[b, h]], set(held[b, h, :held_nv[b, h]])
            miss = [t for t in w if t not in hd]
            assert count[b, h] == len(miss) and list(missing[b, h, :count[b, h]]) == miss, (b, h)
            for j, t in enumerate(w):
                want_row = 7.0 if t in hd else flat[t // blk, h, t % blk]
                np.testing.assert_array_equal(rows[b, h, j], np.broadcast_to(want_row, (d,)))
    assert count[1, 1] == 0


@pytest.mark.gpu
def test_gpu_speculative_prefetch_and_int4_rows():
    """On the GPU: the speculative program (a guess gathered from pinned_host V before the previous layer's
    program) and the int4 row gathers compile and run; speculation attends what the plain run attends, and
    int4 with groups of 2 (exact codes) gives the native run's logits."""
    from kvoffload.device import memory as M

    model = tiny_random_model("llama", seed=1)
    opts = dict(topk=12, num_recent=4, eta=0.5)
    _, plain, _ = _decode(model, "clo", NEW, speculative_prefetch=False, **opts)
    pol, got, state = _decode(model, "clo", NEW, speculative_prefetch=True, **opts)
    np.testing.assert_allclose(got, plain, atol=1e-5, rtol=0)
    rate = float(state.records[-1]["guess_hit_rate"])
    assert np.isnan(rate) or 0 <= rate <= 1
    assert pol.describe(state)["clo"]["speculative_prefetch"]["v_bytes_fetched_by_guesses"] > 0
    for retrieval in ("exact", "quest"):
        _, native, _ = _decode(model, "clo", NEW, retrieval=retrieval, quest_page_tokens=4, **opts)
        _, q, st = _decode(model, "clo", NEW, retrieval=retrieval, quest_page_tokens=4, host_dtype="int4",
                           int4_group_size=2, **opts)
        assert {M.memory_kind_of(a.codes) for layer in st.groups[0].pool_v for a in layer} == {"pinned_host"}
        np.testing.assert_allclose(q, native, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------
# store=act: activations X in the host pool, the selected tokens' K/V recomputed
# ------------------------------------------------------------------------------------------------


def _profile(tmp_path, intercepts=True):
    """A cost profile with the GPU defaults' rates (the CPU's make recomputation look slow), optionally
    without per-call intercepts (which decide for the tiny models' few rows)."""
    from kvoffload.plan.cost import CostModel

    fits = CostModel.default("gpu").to_json()
    if not intercepts:
        fits = {k: ([0.0, v[1]] if isinstance(v, list) else v) for k, v in fits.items()}
    path = str(tmp_path / "gpu_profile.json")
    with open(path, "w") as f:
        json.dump({"fits": fits, "device": "test"}, f)
    return path


def test_store_act_everything_selected_equals_full(ref):
    """Everything selected, never reused, exact keys on the GPU: V recomputed from the X rows of the host pool
    (LLaMA: RoPE at each token's own position for K where K is recomputed; OPT's X carries its positions)."""
    from kvoffload.device import memory as M

    arch, model, want = ref
    pol, got, state = _decode(model, "clo", NEW, topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False, store="act",
                              speculative_prefetch=False)
    assert (got.argmax(-1) == want.argmax(-1)).all(), arch
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    gr = state.groups[0]
    assert gr.since_flush == NEW - BLOCK and gr.used_extents > 1  # the flushed blocks' X too
    assert all(v is None for layer in gr.pool_v for v in layer)  # no V stored: X in its place
    assert {M.memory_kind_of(a) for layer in gr.pool_x for a in layer} == {pol.pipeline.host_kind}
    assert {M.memory_kind_of(a) for layer in gr.pool_k for a in layer} == {"device"}
    c = pol.describe(state)["clo"]
    assert c["store_per_layer"] == ["act"] * model.config.num_layers and c["v_bytes_fetched"] == 0
    assert c["x_bytes_fetched"] > 0
    plan = pol.pipeline.memory_plan
    assert plan.host["K/V blocks"] == 0 and plan.host["activation blocks"] > 0
    assert plan.gpu["activation-row recompute workspace"] > 0


def test_store_act_opt_quest_reads_half_the_bytes_of_kv():
    """MHA (OPT), K and V on the host (quest), everything selected, never reused: each step reads the X rows
    of the heads' union (every pool token of the request), half the bytes of the same (token, head) K and V
    rows; the host pool holds X only, half of store=kv's K/V. (Its logits against `full`:
    test_store_act_everything_selected_equals_full's OPT case and test_store_act_small_topk_equals_store_kv,
    both slow.)"""
    model = tiny_random_model("opt", seed=1)
    cfg = model.config
    assert 2 * cfg.hidden_size == cfg.kv_bytes_per_token  # MHA: an activation is half its K/V
    pol, got, state = _decode(model, "clo", NEW, store="act", retrieval="quest", quest_page_tokens=4, topk_ratio=1.0,
                              fixed_threshold=2.0, layer0_full=False, speculative_prefetch=False)
    assert np.isfinite(got).all()
    gr = state.groups[0]
    assert all(k is None and v is None for e in range(gr.layout.num_extents) for k, v in
               zip((layer[e] for layer in gr.pool_k), (layer[e] for layer in gr.pool_v)))  # X only on the host
    act = pol.describe(state)["clo"]
    assert act["k_bytes_fetched"] == act["v_bytes_fetched"] == 0
    head_rows = sum(int(np.asarray(s.v_rows_fetched).sum()) for s in gr.slots)  # (token, head) rows wanted
    assert act["x_rows_fetched"] * cfg.num_kv_heads == head_rows > 0  # the union: every head wants every token
    kv_bytes = head_rows * 2 * cfg.head_dim * 4  # their K and V rows (fp32)
    assert act["x_bytes_fetched"] == act["x_rows_fetched"] * cfg.hidden_size * 4 == kv_bytes // 2
    plan = pol.pipeline.memory_plan
    assert plan.host["K/V blocks"] == 0 and plan.host["activation blocks"] > 0
    # every block's X, in every layer: half of what its K and V would take
    x_bytes = cfg.num_layers * gr.layout.num_blocks * BLOCK * cfg.hidden_size * 4
    assert plan.host["activation blocks"] == x_bytes == cfg.num_layers * gr.layout.num_blocks * BLOCK * \
        cfg.kv_bytes_per_token * 4 // 2


def test_store_auto_picks_per_layer_from_the_cost_model(tmp_path):
    """auto: act where the X rows of the union plus their recomputation beat the K/V rows (MHA, K on the host,
    everything selected); kv for GQA (an activation is as large as its K/V) and where K stays on the GPU (exact:
    only V crosses, the size of X for MHA); and per layer: OPT-6.7B-shaped at a 10% top-k, the persistent
    layer 0 (the whole context: union = every head's rows) takes act, the others' 32 independent selections
    make a union near the whole context, so they keep K/V rows."""
    from kvoffload.config import ModelConfig
    from kvoffload.plan.cost import CostModel, LayerShape, Linear
    from kvoffload.plan.split import choose_row_store, expected_union

    opt, llama = tiny_random_model("opt", seed=1), tiny_random_model("llama", seed=1)
    flat = _profile(tmp_path, intercepts=False)
    pol, _, state = _decode(opt, "clo", 0, retrieval="hata", topk_ratio=1.0, store="auto", profile=flat)
    c = pol.describe(state)["clo"]
    # layer 0 (layer0_full: a device layer) keeps its K/V on the GPU whatever the cost model says
    assert c["store_per_layer"] == ["kv", "act"] and c["store_reasons"][1].startswith("act: X rows of")
    assert "every head persistent" in c["store_reasons"][0]
    assert all(v is None for v in state.groups[0].pool_v[1]) and all(v is not None for v in state.groups[0].pool_v[0])
    assert all(x is None for x in state.groups[0].pool_x[0])
    pol, _, state = _decode(opt, "clo", 0, topk_ratio=1.0, store="auto", profile=flat)  # exact
    c = pol.describe(state)["clo"]
    assert c["store_per_layer"] == ["kv", "kv"] and "only V crosses" in c["store_reasons"][1]
    assert all(x is None for layer in state.groups[0].pool_x for x in layer)
    pol, _, state = _decode(llama, "clo", 0, retrieval="quest", topk_ratio=1.0, store="auto", profile=flat)
    c = pol.describe(state)["clo"]
    assert c["store_per_layer"] == ["kv", "kv"] and "GQA" in c["store_reasons"][1]

    # the decision itself at OPT-6.7B's shape (H 4096, 32 heads of 128, bf16), 32K tokens, b=1
    cfg = ModelConfig(family="opt", model_type="opt", vocab_size=50272, hidden_size=4096, intermediate_size=16384,
                      num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=32768)
    shape, cost = LayerShape.of(cfg, 2), CostModel.default("gpu")
    N, K = 32768, 3277
    # bf16 at 400 TFLOP/s and 50 GB/s: recomputing a token's K/V (4 H^2 flops) costs what its other 8 KB take
    # to cross, so the whole context is a wash; at a faster recompute (or a slower link) act wins
    whole = choose_row_store(cost, shape, k_on_device=False, kv_tokens=N, x_tokens=N)
    assert abs(whole.act_s - whole.kv_s) < 0.05 * whole.kv_s
    fast = dataclasses.replace(cost, recompute=Linear(cost.recompute.intercept, 1 / 800e12))
    whole = choose_row_store(fast, shape, k_on_device=False, kv_tokens=N, x_tokens=N)
    assert whole.store == "act" and whole.act_s < 0.8 * whole.kv_s
    sparse = choose_row_store(cost, shape, k_on_device=False, kv_tokens=K, x_tokens=expected_union(K, N, 32, 68))
    assert sparse.store == "kv" and expected_union(K, N, 32, 68) > 0.9 * N
    assert choose_row_store(cost, shape, k_on_device=True, kv_tokens=N, x_tokens=N).store == "kv"
    assert expected_union(K, N, 1) == pytest.approx(K) and expected_union(N, N, 32) == pytest.approx(N)


def test_store_options_are_checked():
    with pytest.raises(CloOptionError, match="store must be one of"):
        make_policy("clo", store="x")
    from kvoffload.policies.tokenselect import TokenSelectOptionError

    with pytest.raises(TokenSelectOptionError, match="store must be one of"):
        make_policy("tokenselect", kv="split", store="both")
    with pytest.raises(TokenSelectOptionError, match="applies to kv=split"):
        make_policy("tokenselect", store="act")


@pytest.mark.slow  # the speculative path's own compilations (~20 s)
def test_store_act_with_speculation_equals_full(ref):
    arch, model, want = ref
    pol, got, state = _decode(model, "clo", NEW, topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False, store="act",
                              retrieval="hata")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert pol.describe(state)["clo"]["x_bytes_fetched"] > 0


@pytest.mark.slow
def test_store_act_small_topk_equals_store_kv():
    """A real top-k (per-head selections that differ, reuse on): store=act attends the same rows as store=kv,
    recomputed from the union of the heads' X rows; int4 X (groups of 2: exact codes) too."""
    model = tiny_random_model("opt", seed=1)
    for retrieval in ("exact", "quest"):
        opts = dict(retrieval=retrieval, quest_page_tokens=4, topk=12, num_recent=4, eta=0.5)
        _, want, _ = _decode(model, "clo", NEW, **opts)
        pol, got, state = _decode(model, "clo", NEW, store="act", **opts)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        _, got4, _ = _decode(model, "clo", NEW, store="act", host_dtype="int4", int4_group_size=2, **opts)
        np.testing.assert_allclose(got4, want, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_store_act_matches_store_kv():
    """On the GPU: X extents in pinned_host memory, their selected rows read by the headless zero-copy gather
    kernel inside the layer program (and the speculative program), K/V recomputed; store=act attends what
    store=kv attends (whole context and a small top-k with reuse, MHA, quest and exact)."""
    from kvoffload.device import memory as M

    model = tiny_random_model("opt", seed=1)
    for opts in (dict(topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False), dict(topk=12, num_recent=4, eta=0.5)):
        for retrieval in ("exact", "quest"):
            o = dict(retrieval=retrieval, quest_page_tokens=4, **opts)
            _, want, _ = _decode(model, "clo", NEW, **o)
            pol, got, state = _decode(model, "clo", NEW, store="act", **o)
            assert {M.memory_kind_of(a) for layer in state.groups[0].pool_x for a in layer} == {"pinned_host"}
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
            # the X extents' rows are read in place by the headless kernel (hidden 64: one 64-column tile). Asked
            # of an X extent directly: gather_block_rows_path() names the last gather traced, and the layer
            # programs also gather K rows from the GPU's K extents (exact: XLA's gather, "reference")
            x = state.groups[0].pool_x[1][0]
            block = jnp.asarray([[0, 1, 0, 1]], jnp.int32) % x.shape[0]
            offset = jnp.asarray([[0, 3, 5, 1]], jnp.int32)
            rows = ops.gather_block_rows(x, block, offset)
            assert ops.gather_block_rows_path() == "kernel_zero_copy", (retrieval, x.shape)
            dev = jax.device_put(x, jax.memory.Space.Device)
            np.testing.assert_array_equal(np.asarray(rows), np.asarray(dev)[np.asarray(block), np.asarray(offset)])


# ------------------------------------------------------------------------------------------------
# conditionals (the GPU's default: no lax.cond, every layer scores and gathers with per-head counts)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy,method,opts", [
    ("clo", "radix", dict(topk=12, num_recent=4, eta=0.5)),
    pytest.param("clo", "kernel", dict(retrieval="quest", quest_page_tokens=4, topk=12, num_recent=4, eta=0.5,
                                       host_dtype="int4", int4_group_size=16), marks=pytest.mark.slow),  # 12 s
    # slow (6 s): conditionals=False is checked by default on clo-radix, the Pallas top-k kernel against NumPy by
    # test_kernels.py::test_top_count_ascending_methods_against_numpy
    pytest.param("tokenselect", "kernel", dict(token_budget=12, num_recent=4, cache_threshold=0.5, kv="split"),
                 marks=pytest.mark.slow),
])
def test_without_conditionals_and_by_radix_the_same_logits_and_reuse(policy, method, opts):
    """A small top-k with some reuse: with conditionals=False (no lax.cond: the selection and the gathers
    always run, a reusing head's count 0) and the radix top-k (in XLA, or the Pallas kernel in interpret
    mode), the logits and the hit counts equal the branching, sorting run's: the kernels skip exactly what
    the conditionals skipped, and the radix select picks the sort's indices."""
    model = tiny_random_model("llama", seed=1)
    pol0, want, state0 = _decode(model, policy, NEW, conditionals=True, **opts)
    pol, got, state = _decode(model, policy, NEW, conditionals=False, topk_method=method, **opts)
    np.testing.assert_array_equal(got, want)
    section = "clo" if policy == "clo" else "selection"
    d, d0 = pol.describe(state)[section], pol0.describe(state0)[section]
    assert d["conditionals"] is False and d0["conditionals"] is True
    assert d["topk_method"] == method and d0["topk_method"] == "auto"
    assert 0 < d["hit_rate"] < 1 and d["hit_rate"] == d0["hit_rate"]
    if policy == "clo":
        assert d["v_bytes_fetched"] == d0["v_bytes_fetched"]


def test_conditionals_and_topk_method_options_are_checked():
    with pytest.raises(CloOptionError, match="conditionals must be"):
        make_policy("clo", conditionals="sometimes")
    with pytest.raises(CloOptionError, match="topk_method must be one of"):
        make_policy("clo", topk_method="heap")


def test_topk_method_auto_resolves_by_row_length_and_backend():
    """"auto" resolves by the static row length and the backend: off the GPU radix from RADIX_MIN_CANDIDATES,
    sort below; on the GPU the Pallas kernels from KERNEL_MIN_CANDIDATES and up to KERNEL_MAX_SHORT, sort between."""
    from kvoffload.pallas import topk as tk

    n = tk.RADIX_MIN_CANDIDATES
    assert tk.resolve_topk_method("auto", n - 1, gpu=False) == "sort"
    assert tk.resolve_topk_method("auto", n, gpu=False) == "radix"
    m = tk.KERNEL_MIN_CANDIDATES
    assert tk.resolve_topk_method("auto", m - 1, gpu=True) == "sort"
    assert tk.resolve_topk_method("auto", m, gpu=True) == "kernel"
    short = tk.KERNEL_MAX_SHORT  # page-level votes: the kernel's short launches beat the sort there
    assert tk.resolve_topk_method("auto", short, gpu=True) == "kernel"
    assert tk.resolve_topk_method("auto", short + 1, gpu=True) == "sort"
    assert tk.resolve_topk_method("kernel", 8) == "kernel" and tk.resolve_topk_method("radix", 8, gpu=True) == "radix"
    with pytest.raises(ValueError, match="top-k method must be one of"):
        tk.resolve_topk_method("heap", 8)
    # that every method gives the sort's indices: test_kernels.py (test_top_count_ascending_methods_against_numpy
    # for radix, test_kernel_interpret's select_rows cases for the Pallas kernels)


def test_rule_array_packs_tau_weights_and_persistent():
    """CloSlots.rule: one [n_kv, G + 2] array; the slots' tau, weights and persistent read it back."""
    tau, weights, persistent = [0.25, -1.5], [[0.5, 2.0], [1.0, 0.0]], [False, True]
    slots = CloSlots(selection=None, v_rows=None, rule=clo_mod.rule_array(tau, weights, persistent))
    assert slots.rule.shape == (2, 4) and slots.rule.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(slots.tau), tau)
    np.testing.assert_array_equal(np.asarray(slots.weights), weights)
    np.testing.assert_array_equal(np.asarray(slots.persistent), persistent)


@pytest.mark.parametrize("replay", [False, True])
def test_split_slots_takes_out_the_read_only_fields_and_join_restores_them(replay):
    """The layer program's undonated part (`CloAttend.split_slots`): the reuse rule, the retrieval metadata
    and, in a replayed run, the draw's rate and key; joined back, the slots are leaf for leaf the same
    objects, and the input slots are untouched."""
    from kvoffload.policies.selection.cache import ReplayDraw

    a = lambda *s: jnp.asarray(np.random.default_rng(len(s)).normal(size=s), jnp.float32)  # noqa: E731
    draw = ReplayDraw(rate=a(), key=jnp.zeros((2,), jnp.uint32)) if replay else None
    sel = SelectionCache(query=a(1, 4, 8), indices=a(1, 2, 5), counts=a(1, 2, len(COUNTS)), replay=draw)
    meta = tuple((a(3, 2, 2, 8), a(3, 2, 2, 8), a(3, 2, 2)) for _ in range(2))
    slots = CloSlots(selection=sel, v_rows=a(1, 2, 5, 8), rule=a(2, 4), meta=meta, k_rows=a(1, 2, 5, 8))
    attend = CloAttend(None, 0.5, 1, 1, "harmonic")
    before = jax.tree.leaves(slots)
    moving, fixed = attend.split_slots(slots)
    fixed_ids = {id(x) for x in jax.tree.leaves(fixed)}
    assert moving.rule is None and moving.meta is None
    assert fixed_ids == {id(x) for x in [slots.rule, *jax.tree.leaves(meta)]
                         + ([draw.rate, draw.key] if replay else [])}
    assert not fixed_ids & {id(x) for x in jax.tree.leaves(moving)}
    assert len(jax.tree.leaves(moving)) + len(jax.tree.leaves(fixed)) == len(before)
    joined = attend.join_slots(moving, fixed)
    assert jax.tree.structure(joined) == jax.tree.structure(slots)
    assert all(x is y for x, y in zip(jax.tree.leaves(joined), before))
    assert all(x is y for x, y in zip(jax.tree.leaves(slots), before))  # the input slots unchanged
    assert (joined.selection.replay is None) == (not replay)
