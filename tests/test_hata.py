"""HATA hash-code training on a tiny random model (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload import ops
from kvoffload.importance import hata
from kvoffload.models import tiny_random_model


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", 0)


@pytest.fixture(scope="module")
def qk(model):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, size=(3, 192)).astype(np.int32)
    return hata.collect_qk(model, toks, queries_per_prompt=12, seed=0)


def _cfg(tmp=None, **kw):
    base = dict(bits=32, steps=6, num_prompts=2, eval_prompts=1, prompt_length=192, queries_per_prompt=12,
                out_dir=tmp, checkpoint_every=3, log_every=100)
    base.update(kw)
    return hata.HataConfig(**base)


def _split(qk, idx):
    return hata.QKSet(qk.q[idx], qk.k[idx], qk.qpos[idx])


def test_collect_shapes(model, qk):
    cfg = model.config
    assert qk.q.shape == (3, cfg.num_layers, cfg.num_kv_heads, cfg.group_size * 12, cfg.head_dim)
    assert qk.k.shape == (3, cfg.num_layers, cfg.num_kv_heads, 192, cfg.head_dim)
    assert qk.qpos.min() >= 96 and qk.qpos.max() < 192
    # keys are the model's post-RoPE keys (transformer.prefill's cache)
    from kvoffload.models.transformer import prefill

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, size=(3, 192)).astype(np.int32)
    _, ks, _ = prefill(cfg, model.params, jnp.asarray(toks[:1]), jnp.array([192]))
    np.testing.assert_allclose(qk.k[0, 1], np.asarray(ks[1][0]), atol=1e-5)


def test_relaxed_code_signs_match_packed_codes():
    x = jax.random.normal(jax.random.key(0), (50, 16))
    w = jax.random.normal(jax.random.key(1), (16, 64))
    relaxed = hata.relaxed_code(x, w, 3.0)
    packed = ops.hata_encode(x, w)  # [50, 2] uint32
    bits = (np.asarray(packed)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(bits.reshape(50, 64).astype(bool), np.asarray(relaxed) > 0)
    # hamming of the sign codes = count of disagreeing relaxed signs
    ham = ops.hamming_distance(packed[:, None], packed[None])
    want = np.sum((np.asarray(relaxed)[:, None] > 0) != (np.asarray(relaxed)[None] > 0), -1)
    np.testing.assert_array_equal(ham, want)


def test_pair_weights_hand_case():
    q = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    k = jnp.array([[3.0, 0.0], [2.0, 1.0], [1.0, 2.0], [0.0, 3.0], [-1.0, 0.0],
                   [0.5, 0.5], [0.1, 0.0], [0.0, 0.2], [0.3, 0.0], [0.0, 0.1], [0.2, 0.2]])
    qpos = jnp.array([10, 3])
    w = np.asarray(hata.pair_weights(q, k, qpos, 0.2))
    # query 0: 11 causal keys, top ceil(2.2) = 3: keys 0, 1, 2 (scores 3, 2, 1) graded 2, 5/3, 4/3
    pos = np.array([2.0, 5 / 3, 4 / 3]) * (8 / 5)
    np.testing.assert_allclose(w[0, :3], pos, rtol=1e-6)
    np.testing.assert_allclose(w[0, 3:], -1.0)
    assert abs(w[0][w[0] > 0].sum() - 8.0) < 1e-5
    # query 1: keys 0..3 causal, top ceil(0.8) = 1: key 3 (score 3)
    np.testing.assert_allclose(w[1, :4], [-1.0, -1.0, -1.0, 3.0 * 1.0], rtol=1e-6)
    np.testing.assert_allclose(w[1, 4:], 0.0)


@pytest.mark.slow  # 11 s of training steps; the default suite stays under ~10 min
def test_gradients_flow_only_into_w(model, qk):
    cfg = model.config
    hc = _cfg()
    st = hata.create_state(cfg, hc)
    assert set(st.params) == {"w"} and st.params["w"].shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32)
    q, k = jnp.asarray(qk.q[0]), jnp.asarray(qk.k[0])
    wts = hata.prompt_weights(q, k, jnp.asarray(qk.qpos[0]), 0.1)
    assert wts.shape == q.shape[:3] + (k.shape[2],)
    loss = lambda w: jnp.sum(jax.vmap(jax.vmap(lambda *a: hata.head_loss(
        *a, scale=3.0, balance=0.1, ortho=0.1)[0]))(w, q, k, wts))
    gw = jax.grad(loss)(st.params["w"])
    assert float(jnp.abs(gw).max()) > 0
    # one training step is one SGD step on w along that gradient (momentum starts at zero) and
    # reports the summed loss per (layer, KV head)
    step = hata.make_hata_step(hc)
    st2, m = step(st, q, k, wts)
    assert set(st2.params) == {"w"} and int(st2.step) == 1
    np.testing.assert_allclose(np.asarray(st2.params["w"]),
                               np.asarray(st.params["w"] - hc.lr * gw), rtol=1e-5, atol=1e-6)
    n = cfg.num_layers * cfg.num_kv_heads
    np.testing.assert_allclose(float(m["loss"]), float(loss(st.params["w"])) / n, rtol=1e-5)


def test_resume_and_outputs(model, qk, tmp_path):
    tr, ev = _split(qk, [0, 1]), _split(qk, [2])
    a = hata.train_hata(model, _cfg(str(tmp_path / "a")), train_qk=tr, eval_qk=ev, quiet=True)
    b_dir = str(tmp_path / "b")
    part = hata.train_hata(model, _cfg(b_dir), train_qk=tr, eval_qk=ev, quiet=True, stop_after=3)
    assert int(part.state.step) == 3
    b = hata.train_hata(model, _cfg(b_dir), train_qk=tr, eval_qk=ev, quiet=True)
    np.testing.assert_allclose(a.w, b.w, rtol=1e-6, atol=1e-7)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7),
                 a.state.opt_state, b.state.opt_state)
    w = hata.load_projections(b_dir)
    np.testing.assert_allclose(w, b.w)
    import json, os

    doc = json.load(open(os.path.join(b_dir, hata.HATA_JSON)))
    assert doc["bits"] == 32 and len(doc["recall_trained"]) == model.config.num_layers


def test_codes_feed_hata_scores(model, qk):
    cfg = model.config
    w = hata.init_projection(cfg, 64, 0)[0]  # layer 0: [n_kv, d, r]
    k = jnp.asarray(qk.k[0, 0])[None]  # [1, n_kv, T, d]
    q = jnp.asarray(qk.q[0, 0, :, :1]).reshape(1, cfg.num_kv_heads, cfg.head_dim)
    q = jnp.repeat(q, cfg.group_size, axis=1)  # [1, n_heads, d]
    kc = hata.encode_keys(w, k)
    qc = hata.encode_queries(w, q, cfg.group_size)
    assert kc.shape == (1, cfg.num_kv_heads, 192, 2) and kc.dtype == jnp.uint32
    assert qc.shape == (1, cfg.num_heads, 2)
    s = ops.hata_scores(qc, kc, jnp.array([192]), group_reduce="sum")
    assert s.shape == (1, cfg.num_kv_heads, 192)
    want = (64 - ops.hamming_distance(qc[0, 0][None], kc[0, 0])) * cfg.group_size
    np.testing.assert_allclose(s[0, 0], want)


def test_training_beats_random_projections(model, qk):
    tr, ev = _split(qk, [0, 1]), _split(qk, [2])
    res = hata.train_hata(model, _cfg(steps=60), train_qk=tr, eval_qk=ev, quiet=True)
    assert res.losses[-1] < res.losses[0]
    assert res.recall_trained.mean() > res.recall_random.mean() + 0.03
