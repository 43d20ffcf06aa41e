"""CLO persistent-head planning (plan/clo.py): hand-worked values of the paper's formulas, and the
profiling pre-run's s_hat against direct NumPy cosines of the model's queries."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload.models import family, tiny_random_model
from kvoffload.models.transformer import layer_prefill
from kvoffload.plan.clo import (
    CloPlanError,
    full_head_bytes,
    kv_thresholds,
    layer_compute_s,
    load_clo_profile,
    persistent_heads,
    plan_persistent_heads,
    prefetchable_heads,
    profile_query_similarity,
    reuse_difficulty,
    save_clo_profile,
    topk_head_bytes,
)
from kvoffload.plan.cost import CostModel, LayerShape, Linear

# 3 layers x 4 KV heads, values exact in binary so D = 0 is exactly 0 (not > 0)
TAU = np.array([[0.75, 0.5, -1.0, 0.875],
                [0.75, 0.625, 0.875, -1.0],
                [0.75, 0.875, 0.5, 0.875]])
S_HAT = np.array([[0.875, 0.5, 0.25, 0.75],
                  [0.75, 0.75, 0.5, 0.25],
                  [0.5, 0.75, 0.5, 0.875]])
EPS = 0.125
# D = tau - (s_hat - eps):
# L0: .75-.875+.125 = 0 | .5-.5+.125 = .125 | -1-.25+.125 = -1.125 | .875-.75+.125 = .25
# L1: .75-.75+.125 = .125 | .625-.75+.125 = 0 | .875-.5+.125 = .5 | -1-.25+.125 = -1.125
# L2: .75-.5+.125 = .375 | .875-.75+.125 = .25 | .5-.5+.125 = .125 | .875-.875+.125 = .125
D_EXPECTED = np.array([[0.0, 0.125, -1.125, 0.25],
                       [0.125, 0.0, 0.5, -1.125],
                       [0.375, 0.25, 0.125, 0.125]])


def test_reuse_difficulty_hand_worked():
    D = reuse_difficulty(TAU, S_HAT, EPS)
    np.testing.assert_array_equal(D, D_EXPECTED)
    with pytest.raises(CloPlanError):
        reuse_difficulty(TAU, S_HAT[:, :3], EPS)


def test_kv_thresholds_from_kv_and_query_head_scores():
    # s = 1 -> tau = eta; s = 0 -> tau = cos(pi) = -1; s = 0.5, p = 1 -> theta = (arccos .8 + pi) / 2,
    # cos(theta) = -sin(arccos(.8) / 2) = -sqrt((1 - .8) / 2) = -sqrt(.1)
    tau = kv_thresholds([[1.0, 0.0, 0.5]], 3, eta=0.8, p=1.0)
    np.testing.assert_allclose(tau, [[0.8, -1.0, -math.sqrt(0.1)]], atol=1e-6)
    # per query head (6 heads, groups of 2): group means .75, .5, .25; p = 3 -> lambda = s^3
    # tau = cos(lambda a + (1 - lambda) pi), a = arccos(.8) = 0.6435011
    q_scores = [[1.0, 0.5, 0.5, 0.5, 0.25, 0.25]]
    a = math.acos(0.8)
    want = [math.cos(s**3 * a + (1 - s**3) * math.pi) for s in (0.75, 0.5, 0.25)]
    # e.g. s = .5: lambda = .125, tau = -cos(.125 (pi - a)) = -cos(.3122614) = -0.951641
    assert want[1] == pytest.approx(-0.951641, abs=1e-6)
    np.testing.assert_allclose(kv_thresholds(q_scores, 3, eta=0.8, p=3.0), [want], atol=1e-6)
    with pytest.raises(CloPlanError):
        kv_thresholds([[1.0, 0.5, 0.5, 0.5]], 3)


def test_prefetchable_heads_units_and_floor():
    # mem_head = 2 * B * k * d * p = 2 * 1 * 256 * 64 * 2 = 65536 bytes
    mem_head = topk_head_bytes(head_dim=64, k_tokens=256, batch=1, dtype_bytes=2)
    assert mem_head == 65536
    # B_pcie = 65.536e9 B/s: one head's fetch takes 65536 / 65.536e9 = 1 us
    # N_p = floor(T_comp / 1 us): 3.5 us -> 3, 1.0 us -> 1 (exact quotient kept), 2.5 us -> 2, 0.5 us -> 0
    n_p = prefetchable_heads([3.5e-6, 1.0e-6, 2.5e-6, 0.5e-6], 65.536e9, mem_head)
    np.testing.assert_array_equal(n_p, [3, 1, 2, 0])
    # twice the bandwidth hides twice the heads (the paper's literal T / (B * mem) would halve them)
    np.testing.assert_array_equal(prefetchable_heads([3.5e-6], 2 * 65.536e9, mem_head), [7])
    assert prefetchable_heads(1.0e-6, 65.536e9, mem_head) == 1
    with pytest.raises(CloPlanError):
        prefetchable_heads(1e-6, 0.0, mem_head)


def test_layer_compute_s_from_cost_model():
    cost = CostModel(h2d=Linear(1e-5, 1e-10), d2h=Linear(1e-5, 1e-10), recompute=Linear(1e-6, 1e-12),
                     attention=Linear(2e-6, 1e-12), dense=Linear(3e-6, 1e-15), hbm_bw=1e12)
    shape = LayerShape(x_tok=128, kv_tok=256, recompute_flops_tok=1e3, dense_flops_tok=1e6, w_layer=1e6, w_kv=0)
    # batch 2, 500 tokens each, one layer program: attention 1e-12 * (2 * 500 * 256) = 0.256e-6, dense
    # max(1e-15 * 2 * 1e6, 1e6 / 1e12) = 1e-6 (the weights' read), and one launch, the larger intercept
    # (dense 3e-6, not attention's 2e-6 too); no recompute, no transfer
    assert layer_compute_s(cost, shape, batch=2, tokens=500) == pytest.approx(0.256e-6 + 1e-6 + 3e-6, rel=1e-12)


def test_persistent_heads_hand_worked():
    D = reuse_difficulty(TAU, S_HAT, EPS)
    n_p = [3, 1, 2]
    mask, rep = persistent_heads(D, n_p, None, 100.0)
    # N_d = #{D > 0}: L0 {.125, .25} = 2, L1 {.125, .5} = 2, L2 all 4
    assert rep["n_d"] == [2, 2, 4]
    # N_persist = max(N_d - N_p, 0): L0 forced to all 4; L1 2 - 1 = 1; L2 4 - 2 = 2
    assert rep["n_persist"] == [4, 1, 2]
    # L1: the highest D (.5, head 2); L2: heads 0 (.375) and 1 (.25)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [0, 0, 1, 0], [1, 1, 0, 0]])
    assert rep["n_kept"] == [4, 1, 2] and rep["bytes"] == [400.0, 100.0, 200.0] and rep["total_bytes"] == 700.0
    assert rep["dropped"] == []
    with pytest.raises(CloPlanError):
        persistent_heads(D, [1, 2], None, 100.0)
    # N_p >= N_d -> nothing persistent beyond layer 0; a tie (L2 heads 2, 3 at .125) goes to head 2
    mask, rep = persistent_heads(D, [0, 5, 1], None, 100.0)
    assert rep["n_persist"] == [4, 0, 3]
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]])


def test_persistent_heads_budget_drops_lowest_d_globally_layer0_last():
    D = reuse_difficulty(TAU, S_HAT, EPS)
    # wanted: L0 all (400 B), L1h2 (D .5), L2h0 (.375), L2h1 (.25): 700 B
    # budget 550: drop L2h1 (.25) -> 600, still > 550; drop L2h0 (.375) -> 500 <= 550, stop
    mask, rep = persistent_heads(D, [3, 1, 2], 550.0, 100.0)
    assert rep["dropped"] == [(2, 1, 0.25), (2, 0, 0.375)]
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]])
    assert rep["n_persist"] == [4, 1, 2] and rep["n_kept"] == [4, 1, 0] and rep["total_bytes"] == 500.0
    # budget 250: then L1h2 (.5) -> 400; only layer 0 left: its lowest D first, h2 (-1.125) -> 300,
    # h0 (0) -> 200 <= 250
    mask, rep = persistent_heads(D, [3, 1, 2], 250.0, 100.0)
    assert [d[:2] for d in rep["dropped"]] == [(2, 1), (2, 0), (1, 2), (0, 2), (0, 0)]
    np.testing.assert_array_equal(mask, [[0, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert rep["total_bytes"] == 200.0
    # per-head sizes: 2 * B * S * d * p
    assert full_head_bytes(head_dim=64, context=1024, batch=2, dtype_bytes=2) == 2 * 2 * 1024 * 64 * 2


@functools.partial(jax.jit, static_argnames=("cfg",))
def _queries(cfg, params, tok):
    """Every layer's RoPE'd queries [nh, T, d] from family(cfg).qkv, hidden states carried by layer_prefill."""
    fam = family(cfg)
    t = tok.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    h = fam.embed(cfg, params, tok, pos)
    qs = []
    for lp in params.layers:
        qs.append(fam.qkv(cfg, lp, fam.attn_input(cfg, lp, h), pos)[0][0])
        h = layer_prefill(cfg, lp, h, pos, jnp.asarray([t], jnp.int32))[0]
    return qs


def _direct_query_cosines(model, tokens):
    """[L, n_heads, T-1]: cos(q_t, q_t+1) of the model's queries, in NumPy (float64)."""
    out = []
    for q in _queries(model.config, model.params, jnp.asarray([tokens], jnp.int32)):
        q = np.asarray(q, np.float64)
        a, b = q[:, :-1], q[:, 1:]
        out.append((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)))
    return np.stack(out)


def test_profile_matches_direct_cosines_and_aggregations():
    model = tiny_random_model("llama", seed=3)  # 2 layers, 4 query heads, 2 KV heads
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 250, 23).tolist(), rng.integers(1, 250, 17).tolist()]
    skip = 3
    prof = profile_query_similarity(model, seqs, skip=skip, model_name="tiny")
    c0, c1 = (_direct_query_cosines(model, s)[:, :, skip:] for s in seqs)
    # pairs (t, t+1) with t >= 3: 23 - 1 - 3 = 19 and 17 - 1 - 3 = 13, pooled
    assert prof.num_pairs == 32
    want_q = (c0.sum(-1) + c1.sum(-1)) / 32
    np.testing.assert_allclose(prof.s_hat_q, want_q, atol=2e-5)
    np.testing.assert_allclose(prof.s_hat, want_q.reshape(2, 2, 2).mean(-1), atol=2e-5)
    assert prof.aggregation == "mean" and prof.model == "tiny"
    # random weights: queries at adjacent positions are far from identical, and not all alike
    assert np.all(np.abs(prof.s_hat_q) < 0.999) and np.ptp(prof.s_hat_q) > 1e-3
    # importance-weighted harmonic mean, w per query head: sum w / sum (w / s)
    w = np.array([[0.9, 0.3, 0.6, 0.7], [0.2, 0.8, 0.5, 0.4]])
    prof_w = profile_query_similarity(model, seqs, skip=skip, weights=w)
    sq = np.clip(want_q, 1e-6, None).reshape(2, 2, 2)
    wg = w.reshape(2, 2, 2)
    np.testing.assert_allclose(prof_w.s_hat, wg.sum(-1) / (wg / sq).sum(-1), rtol=1e-4)
    assert prof_w.aggregation == "importance-harmonic"


def test_profile_repeated_token_is_the_rope_rotation_cosine():
    # One token repeated: every position sees the same embedding and attends over identical values,
    # so the pre-RoPE query q is the same at every position and layer-wise; RoPE rotates each pair
    # (j, j + d/2) by t w_j, so cos(q_t, q_t+1) = sum_j (q_j^2 + q_{j+d/2}^2) cos(w_j) / |q|^2,
    # w_j = theta^(-2j/d), for every t.
    model = tiny_random_model("llama", seed=5)
    cfg, p = model.config, model.params
    d = cfg.head_dim
    w_rot = cfg.rope_theta ** (-np.arange(0, d, 2) / d)
    # layer 0's pre-RoPE query in NumPy: rms_norm(embed[tok]) * attn_norm @ wq
    e = np.asarray(p.embed[42], np.float64)
    x = e / np.sqrt(np.mean(e * e) + cfg.norm_eps) * np.asarray(p.layers[0].attn_norm, np.float64)
    q = (x @ np.asarray(p.layers[0].wq, np.float64)).reshape(cfg.num_heads, d)
    pair_energy = q[:, : d // 2] ** 2 + q[:, d // 2:] ** 2
    want0 = (pair_energy * np.cos(w_rot)).sum(-1) / (q * q).sum(-1)
    prof = profile_query_similarity(model, [[42] * 12])
    np.testing.assert_allclose(prof.s_hat_q[0], want0, atol=2e-5)
    assert np.all(prof.s_hat_q < 1.0 - 1e-4)  # RoPE alone moves the query


def test_profile_json_round_trip(tmp_path):
    model = tiny_random_model("llama", seed=1)
    prof = profile_query_similarity(model, ["a test prompt for the profile"], model_name="tiny-llama")
    path = str(tmp_path / "sub" / "clo_profile.json")
    save_clo_profile(path, prof)
    back = load_clo_profile(path)
    assert back.model == "tiny-llama" and back.date == prof.date and back.aggregation == prof.aggregation
    assert back.num_pairs == prof.num_pairs and back.num_sequences == 1 and back.skip == 0
    np.testing.assert_array_equal(back.s_hat, prof.s_hat)
    np.testing.assert_array_equal(back.s_hat_q, prof.s_hat_q)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(CloPlanError, match="not a CLO profile"):
        load_clo_profile(str(bad))
    with pytest.raises(CloPlanError, match="not found"):
        load_clo_profile(str(tmp_path / "missing.json"))


def test_plan_persistent_heads_composes_the_formulas():
    model = tiny_random_model("llama")  # 2 layers, 2 KV heads, head_dim 16
    cfg = model.config
    cost = CostModel(h2d=Linear(1e-5, 1 / 1.6e9), d2h=Linear(1e-5, 1 / 1.6e9), recompute=Linear(0, 1e-12),
                     attention=Linear(0, 1e-12), dense=Linear(4e-6, 1e-15), hbm_bw=1e15)
    shape = LayerShape(x_tok=128, kv_tok=128, recompute_flops_tok=1e3, dense_flops_tok=1e6, w_layer=1e3, w_kv=0)
    scores = [[0.9, 0.2], [1.0, 0.1]]
    s_hat = [[0.3, 0.6], [0.25, 0.5]]
    mask, rep = plan_persistent_heads(cfg, cost, shape, s_hat, scores, batch=4, context=1000, k_tokens=100,
                                      sink=4, recent=16, dtype_bytes=2, eta=0.8, p=3.0, epsilon=0.05)
    # T_comp = dense 4e-6 + 1e-15 * 4 * 1e6 + attention 1e-12 * 4 * 120 * 128 = 4.004e-6 + 6.144e-8
    t_comp = 4.004e-6 + 1e-12 * 4 * 120 * 128
    assert rep["t_comp_s"] == pytest.approx(t_comp, rel=1e-12)
    # mem_head = 2 * 4 * 100 * 16 * 2 = 25600 B; one fetch 25600 / 1.6e9 = 16 us > T_comp: N_p = 0
    assert rep["mem_head_bytes"] == 25600 and rep["n_p"] == [0, 0]
    # layer 1: tau(1.0) = .8, D = .8 - .25 + .05 = .6 > 0; tau(.1) = cos(.001 a + .999 pi) ~ -1, D < 0
    np.testing.assert_allclose(rep["D"][1], [0.6, np.cos(1e-3 * math.acos(0.8) + 0.999 * math.pi) - 0.45], atol=1e-6)
    np.testing.assert_array_equal(mask, [[1, 1], [1, 0]])
    assert rep["total_bytes"] == 3 * 2 * 4 * 1000 * 16 * 2
    with pytest.raises(CloPlanError):
        plan_persistent_heads(cfg, cost, shape, [[0.3, 0.6]], scores, batch=4, context=1000, k_tokens=100)


def test_shipped_profile_of_the_embedded_model():
    """The pre-run shipped for the embedded model (benchmarks/profile_clo.py, 6 essay prompts of 4096
    tokens): one s_hat per layer and KV head, the importance-weighted harmonic mean of its query heads."""
    import os

    import kvoffload.importance as imp
    from kvoffload.plan.deploy import group_similarity, load_scores
    from kvoffload.plan.clo import load_clo_profile

    here = os.path.join(os.path.dirname(imp.__file__), "pretrained")
    prof = load_clo_profile(os.path.join(here, "smollm2_135m_instruct_clo_profile.json"))
    alpha = load_scores(os.path.join(here, "smollm2_135m_instruct_head_scores.json"))  # [30, 3] per KV head
    assert prof.s_hat.shape == (30, 3) and prof.s_hat_q.shape == (30, 9)
    assert prof.aggregation == "importance-harmonic" and prof.num_pairs > 20000
    assert np.all((prof.s_hat > 0) & (prof.s_hat <= 1))
    # per-KV-head weights are one weight per group: the harmonic mean with equal weights
    want = np.asarray(group_similarity(prof.s_hat_q.reshape(30, 3, 3), np.repeat(alpha[:, :, None], 3, -1)))
    np.testing.assert_allclose(prof.s_hat, want, rtol=1e-5)


def test_plan_persistent_heads_per_device_under_tensor_parallelism():
    """devices=2: each device's KV heads planned on their own (its N_p against its D), the masks joined; with
    N_p = 1 per device, a device whose two heads both have D > 0 keeps one, the other (one D > 0) none."""
    import dataclasses

    cfg = dataclasses.replace(tiny_random_model("llama").config, num_layers=3, num_heads=4, num_kv_heads=4)
    cost = CostModel(h2d=Linear(0, 1 / 1e9), d2h=Linear(0, 1 / 1e9), recompute=Linear(0, 0), attention=Linear(0, 0),
                     dense=Linear(1.5e-6, 0), hbm_bw=1e15)
    shape = LayerShape(x_tok=128, kv_tok=128, recompute_flops_tok=0, dense_flops_tok=1, w_layer=0, w_kv=0)
    # mem_head = 2 * 1 * 15 * 16 * 2 = 960 B: 0.96 us a fetch, T_comp 1.5 us: N_p = 1
    kw = dict(batch=1, context=100, k_tokens=15, sink=0, recent=1, dtype_bytes=2, epsilon=EPS)
    scores = np.ones((3, 4))
    one, rep1 = plan_persistent_heads(cfg, cost, shape, S_HAT, scores, **kw)
    two, rep2 = plan_persistent_heads(cfg, cost, shape, S_HAT, scores, devices=2, **kw)
    assert rep1["n_p"] == rep2["n_p"] == [1, 1, 1]
    D = np.asarray(rep2["D"])
    for i in range(2):  # each device: its own single-device plan of its heads
        mine, _ = persistent_heads(D[:, 2 * i:2 * i + 2], 1, None, 2 * 100 * 16 * 2)
        np.testing.assert_array_equal(two[:, 2 * i:2 * i + 2], mine)
    # one device hides 1 of 4 heads' fetches a layer; two devices 1 each of their 2
    np.testing.assert_array_equal(one, [[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0]])
    np.testing.assert_array_equal(two, [[1, 1, 1, 1], [1, 0, 0, 1], [1, 0, 1, 0]])
    assert rep2["devices"] == 2 and rep2["n_kept"] == two.sum(1).tolist()
    assert rep2["n_kept_per_device"] == [two[:, :2].sum(1).tolist(), two[:, 2:].sum(1).tolist()]
    with pytest.raises(CloPlanError, match="do not split over 3"):
        plan_persistent_heads(cfg, cost, shape, S_HAT, scores, devices=3, **kw)
