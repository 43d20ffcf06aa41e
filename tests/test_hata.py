"""HATA hash-code training on a tiny random model (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload import ops
from kvoffload.importance import hata
from kvoffload.models import tiny_random_model
from kvoffload.plan import deploy


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
    w = deploy.load_projections(b_dir)
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
    kc = deploy.encode_keys(w, k)
    qc = deploy.encode_queries(w, q, cfg.group_size)
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


# ------------------------------------------------------------------ data sources, boost, wider codes
def test_ruler_prompt_tokens_end_with_the_answer():
    from test_eval_ruler import WordTokenizer
    from kvoffload.eval import ruler

    tok = WordTokenizer()
    tasks = ("niah_single_1", "niah_multikey_1", "qa_2")  # qa_2's gold documents alone exceed 600 tokens
    with pytest.warns(UserWarning, match="qa_2"):
        toks, ends = hata.ruler_prompt_tokens(tok, "train", 3, 600, 0, tasks)
    assert toks.shape == (3, 600) and toks.dtype == np.int32 and ends.shape == (3,)
    want = {t: ruler.generate_samples(tok, t, 600, 2, seed=1000) for t in tasks[:2]}
    for i, smp in enumerate([want["niah_single_1"][0], want["niah_multikey_1"][0], want["niah_single_1"][1]]):
        ans = tok.encode(" " + ", ".join(smp.outputs), add_special_tokens=False)
        row = toks[i, :ends[i]].tolist()
        assert row == smp.prompt_ids + ans  # prompt i of task i % 2, then its gold answer
        assert (toks[i, ends[i]:] == 0).all()
    other, _ = hata.ruler_prompt_tokens(tok, "eval", 3, 600, 0, tasks[:2])
    assert not np.array_equal(other, toks)  # the held-out split has other needles
    with pytest.raises(ValueError, match="split"):
        hata.ruler_prompt_tokens(tok, "test", 1, 600, 0, tasks[:1])
    with pytest.raises(ValueError, match="no RULER task"):
        hata.ruler_prompt_tokens(tok, "train", 1, 600, 0, ("qa_2",))


def test_end_positions_and_explicit_query_positions(model, qk):
    np.testing.assert_array_equal(hata.end_positions(np.array([10, 7]), 3), [[7, 8, 9], [4, 5, 6]])
    with pytest.raises(ValueError, match="fewer than"):
        hata.end_positions(np.array([2]), 3)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, size=(3, 192)).astype(np.int32)
    pos = hata.random_positions(3, 192, 12, 0)
    again = hata.collect_qk(model, toks[:1], 12, positions=pos[:1])  # the default positions, passed in
    np.testing.assert_array_equal(again.qpos, qk.qpos[:1])
    np.testing.assert_allclose(again.q, qk.q[:1], atol=1e-6)
    ends = hata.collect_qk(model, toks[:1], 4, positions=hata.end_positions(np.array([150]), 4))
    G = model.config.group_size
    np.testing.assert_array_equal(ends.qpos[0], np.tile([146, 147, 148, 149], G))
    assert ends.q.shape[3] == 4 * G


def test_pair_weights_top_boost_hand_case():
    # query 0 of the hand case: 11 causal keys, top ceil(0.2 * 11) = 3 (keys 0, 1, 2 graded 2, 5/3, 4/3),
    # boost_frac 0.1: the top ceil(1.1) = 2 keys' grades times 3, then rescaled to the 8 negatives' mass
    q = jnp.array([[1.0, 0.0]])
    k = jnp.array([[3.0, 0.0], [2.0, 1.0], [1.0, 2.0], [0.0, 3.0], [-1.0, 0.0],
                   [0.5, 0.5], [0.1, 0.0], [0.0, 0.2], [0.3, 0.0], [0.0, 0.1], [0.2, 0.2]])
    w = np.asarray(hata.pair_weights(q, k, jnp.array([10]), 0.2, top_boost=3.0, boost_frac=0.1))
    raw = np.array([6.0, 5.0, 4 / 3])
    np.testing.assert_allclose(w[0, :3], raw * 8 / raw.sum(), rtol=1e-6)
    np.testing.assert_allclose(w[0, 3:], -1.0)
    plain = np.asarray(hata.pair_weights(q, k, jnp.array([10]), 0.2))
    np.testing.assert_allclose(np.asarray(hata.pair_weights(q, k, jnp.array([10]), 0.2, 1.0, 0.1)), plain)


def test_config_checks():
    with pytest.raises(ValueError, match="data must be one of"):
        hata.HataConfig(data="books")
    with pytest.raises(ValueError, match="multiple of 32"):
        hata.HataConfig(bits=100)
    with pytest.raises(ValueError, match="unknown RULER tasks"):
        hata.HataConfig(ruler_tasks=("niah_single_9",))
    with pytest.raises(ValueError, match="top_boost"):
        hata.HataConfig(top_boost=0.5)
    assert hata.HataConfig(ruler_tasks=["vt"]).ruler_tasks == ("vt",)


def test_recall_of_several_true_fractions(model, qk):
    w = hata.init_projection(model.config, 64, 0)
    ev = _split(qk, [2])
    both = hata.recall_per_layer(w, ev, 0.1, true_frac=(0.1, 0.02))
    assert both.shape == (model.config.num_layers, 2)
    np.testing.assert_allclose(both[:, 0], hata.recall_per_layer(w, ev, 0.1))
    np.testing.assert_allclose(both[:, 1], hata.recall_per_layer(w, ev, 0.1, true_frac=0.02))
    # codes of the exact scores' sign pattern are not exact; the trivial selection (every key) is
    assert np.all(hata.recall_per_layer(w, ev, 1.0, true_frac=(1.0, 0.02)) == 1.0)
    s = jnp.array([[3.0, 1.0, 2.0, 0.5], [0.1, 0.4, 0.3, 0.2]])
    np.testing.assert_array_equal(hata._top_mask(s, jnp.array([[2], [1]])),
                                  [[True, False, True, False], [False, True, False, False]])


def test_named_heldout_sets_and_resume_settings(model, qk, tmp_path):
    import json, os

    tr, ev = _split(qk, [0, 1]), _split(qk, [2])
    d = str(tmp_path / "h")
    res = hata.train_hata(model, _cfg(d, steps=2, data="essays"), train_qk=tr,
                          eval_qk={"a": ev, "b": _split(qk, [1])}, quiet=True)
    assert set(res.recalls) == {"a", "b"} and set(res.recalls["a"]) == {"trained", "random", "trained_top", "random_top"}
    np.testing.assert_array_equal(res.recall_trained, res.recalls["a"]["trained"])
    doc = json.load(open(os.path.join(d, hata.HATA_JSON)))
    assert doc["recall"]["b"]["trained_top"]["mean"] == round(float(res.recalls["b"]["trained_top"].mean()), 4)
    assert doc["settings"]["data"] == "essays"
    with pytest.raises(ValueError, match="different settings.*data"):
        hata.train_hata(model, _cfg(d, steps=2, data="ruler"), train_qk=tr, evaluate=False, quiet=True)
    # a run written before the data option existed resumes (its missing settings read as the defaults)
    cpath = os.path.join(d, "hata_config.json")
    old = json.load(open(cpath))
    for k in ("data", "ruler_tasks", "top_boost", "boost_frac"):
        old.pop(k)
    json.dump(old, open(cpath, "w"))
    again = hata.train_hata(model, _cfg(d, steps=2, data=hata.HataConfig().data), train_qk=tr, evaluate=False, quiet=True)
    np.testing.assert_allclose(again.w, res.w)


def test_cli_options():
    from kvoffload.importance.cli import hata_parser

    a = hata_parser().parse_args(["--out", "x", "--data", "ruler", "--top-boost", "4", "--ruler-tasks", "vt,qa_1",
                                  "--bits", "512"])
    assert (a.data, a.top_boost, a.ruler_tasks, a.bits) == ("ruler", 4.0, "vt,qa_1", 512)
    with pytest.raises(SystemExit):
        hata_parser().parse_args(["--out", "x", "--data", "books"])


# 512 behind the slow marker: the same kernel and packing as 256 (16 words of codes instead of 8)
@pytest.mark.parametrize("bits", [256, pytest.param(512, marks=pytest.mark.slow)])
def test_wide_codes_through_the_hamming_kernel(model, qk, bits):
    """256 / 512-bit codes: packed in bits/32 words, the Pallas Hamming kernel (interpret mode) equals the
    reference."""
    cfg = model.config
    w = jnp.asarray(hata.init_projection(cfg, bits, 1)[0])
    kc = deploy.encode_keys(w, jnp.asarray(qk.k[0, 0])[None])
    q = jnp.asarray(qk.q[0, 0, :, :1]).reshape(1, cfg.num_kv_heads, -1).repeat(cfg.group_size, 1)
    qc = deploy.encode_queries(w, q, cfg.group_size)
    assert kc.shape[-1] == qc.shape[-1] == bits // 32
    lengths = jnp.array([150])
    want = ops.hata_scores(qc, kc, lengths, group_reduce="max", impl="reference")
    got = ops.hata_scores(qc, kc, lengths, group_reduce="max", impl="kernel", interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.max(want)) <= bits


@pytest.mark.slow  # 45 s: a clo decode compiles the whole pipeline
def test_clo_decodes_with_trained_512_bit_projections(model, tmp_path):
    from kvoffload.policies.clo import CloOptionError
    from test_tokenselect import _decode

    cfg = model.config
    w = np.asarray(hata.init_projection(cfg, 512, 1))
    d = str(tmp_path / "w")
    hata.save_projections(d, w, cfg, _cfg(bits=512))
    pol, logits, state = _decode(model, "clo", 4, retrieval="hata", hata_weights=d, topk_ratio=0.5)  # width: W's
    assert np.isfinite(np.asarray(logits)).all()
    assert pol.describe(state)["clo"]["hata_bits"] == 512
    _, same, _ = _decode(model, "clo", 4, retrieval="hata", hata_weights=d, hata_bits=512, topk_ratio=0.5)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(logits))
    with pytest.raises(CloOptionError, match="bits"):
        _decode(model, "clo", 0, retrieval="hata", hata_weights=d, hata_bits=128)


@pytest.mark.slow  # about 3 minutes: SmolLM2 forwards over RULER prompts on the CPU
def test_ruler_data_beats_random_on_heldout_needle_queries():
    from kvoffload.models import load_model

    model = load_model(None, quiet=True)
    hc = hata.HataConfig(data="ruler", steps=40, num_prompts=4, eval_prompts=1, prompt_length=1024,
                         queries_per_prompt=16, ruler_tasks=("niah_single_2", "niah_multiquery"))
    ev = {"ruler_needles": hata.collect_data(model, hc, "eval", 2, "ruler")}
    qpos = ev["ruler_needles"].qpos  # the last 16 positions of each prompt + answer (its question / answer end)
    assert qpos.min() > 512 and np.all(qpos.max(1) - qpos.min(1) == 15)
    res = hata.train_hata(model, hc, eval_qk=ev, quiet=True)
    r = res.recalls["ruler_needles"]
    assert r["trained"].mean() > r["random"].mean() + 0.05
    assert r["trained_top"].mean() > r["random_top"].mean()
