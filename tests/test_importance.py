"""Head-importance training: gating forward, train loop, checkpoints, deployment helpers (tiny models, CPU)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload.importance import data as kdata
from kvoffload.importance import gating
from kvoffload.importance import train as ktrain
from kvoffload.models import tiny_random_model
from kvoffload.models.common import prefill_attention
from kvoffload.plan import deploy


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", 0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def pdata(model):
    from kvoffload.eval.ruler import essays_text

    return kdata.PasskeyData(model.tokenizer, essays_text()[:200_000], num_passkeys=2, words_per_key=2)


def _tcfg(tmp=None, **kw):
    base = dict(steps=4, min_length=520, max_length=640, pad_multiple=128, sink=8, recent=32,
                checkpoint_every=2, out_dir=tmp)
    base.update(kw)
    return ktrain.TrainConfig(**base)


# ----------------------------------------------------------------------------------- data
def test_passkey_sample_layout(pdata, model):
    s = pdata.sample(3, 600)
    assert s.length == 600 and s.tokens.dtype == np.int32
    assert len(s.answer_spans) == 2 and len(s.passkeys) == 2
    toks = s.tokens.tolist()
    for (a, e), key in zip(s.answer_spans, s.passkeys):
        assert model.tokenizer.decode(toks[a:e]).strip() == key
        # the answer tokens appear earlier as the needle (exact copy)
        ans = toks[a:e]
        assert any(toks[i:i + len(ans)] == ans for i in range(0, s.answer_spans[0][0] - len(ans)))
        assert s.answer_mask[a - 1:e - 1].all()
    assert s.answer_mask.sum() == sum(e - a for a, e in s.answer_spans)
    assert all(0 <= d <= 1 for d in s.depths) and s.depths == sorted(s.depths)
    again = pdata.sample(3, 600)
    np.testing.assert_array_equal(again.tokens, s.tokens)
    other = pdata.sample(3, 600, "eval")
    assert not np.array_equal(other.tokens, s.tokens)


# ------------------------------------------------------------------------------- forward
def _naive_window_attention(q, k, v, sink, recent):
    b, nh, t, d = q.shape
    g = nh // k.shape[1]
    kk = np.repeat(np.asarray(k), g, axis=1)
    vv = np.repeat(np.asarray(v), g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", np.asarray(q), kk) / math.sqrt(d)
    qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
    ok = (ki <= qi) & ((ki < sink) | (qi - ki < recent))
    s = np.where(ok, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, vv)


def test_gated_attention_endpoints():
    ks = jax.random.split(jax.random.key(1), 3)
    t = 300  # more than one query chunk
    q = jax.random.normal(ks[0], (1, 4, t, 16))
    k = jax.random.normal(ks[1], (1, 2, t, 16))
    v = jax.random.normal(ks[2], (1, 2, t, 16))
    lengths = jnp.array([t])
    ga = jax.jit(lambda q, k, v, l, a: gating.gated_attention(q, k, v, l, a, sink=4, recent=20, chunk=128))
    full = ga(q, k, v, lengths, jnp.ones(4))
    np.testing.assert_allclose(full, prefill_attention(q, k, v, lengths), atol=1e-5)
    stream = ga(q, k, v, lengths, jnp.zeros(4))
    np.testing.assert_allclose(stream, _naive_window_attention(q, k, v, 4, 20), atol=1e-5)
    a = jnp.array([0.0, 0.3, 0.7, 1.0])
    mix = ga(q, k, v, lengths, a)
    want = a[None, :, None, None] * full + (1 - a[None, :, None, None]) * stream
    np.testing.assert_allclose(mix, want, atol=1e-5)


def test_student_at_alpha_one_is_teacher(model, pdata):
    cfg = model.config
    b = pdata.batch([0], [600], pad_to=640)
    st = gating.stack_layers(model.params)
    tok, ln = jnp.asarray(b.tokens), jnp.asarray(b.lengths)
    t = gating.teacher_hidden(cfg, model.params, st, tok, ln)
    s = gating.student_hidden(cfg, model.params, st, jnp.ones((2, 2)), tok, ln, sink=8, recent=32)
    np.testing.assert_allclose(s[:, :600], t[:, :600], atol=1e-4)
    s0 = gating.student_hidden(cfg, model.params, st, jnp.zeros((2, 4)), tok, ln, sink=8, recent=32)
    assert float(jnp.max(jnp.abs(s0[:, :600] - t[:, :600]))) > 1e-3
    # final_hidden is what logits() normalises: same logits
    from kvoffload.models.transformer import prefill

    lg, *_ = prefill(cfg, model.params, tok, ln, all_logits=True)
    mine = jnp.einsum("bth,hv->btv", t, model.params.lm_head)
    np.testing.assert_allclose(mine[:, :600], lg[:, :600], atol=1e-3, rtol=1e-4)


# ---------------------------------------------------------------------------------- train
@pytest.mark.slow  # 16 s of training steps; the default suite stays under ~10 min
def test_gradients_flow_only_into_alpha(model, pdata):
    """The step differentiates the distillation loss w.r.t. alpha alone (the model is an input,
    not a parameter): its first update is AdamW's on exactly that gradient, then the [0, 1] clip."""
    cfg = model.config
    tcfg = _tcfg()
    state = ktrain.create_state(cfg, tcfg)
    assert set(state.params) == {"alpha"} and state.params["alpha"].shape == (2, 2)
    np.testing.assert_array_equal(state.params["alpha"], 1.0)
    st = gating.stack_layers(model.params)
    step = ktrain.make_train_step(cfg, tcfg.sink, tcfg.recent, tcfg.l1)
    b = ktrain.step_batch(pdata, tcfg, 0, 640)
    batch = (jnp.asarray(b.tokens), jnp.asarray(b.lengths), jnp.asarray(b.answer_mask))
    target = gating.teacher_hidden(cfg, model.params, st, *batch[:2])
    g = jax.grad(lambda a: gating.distillation_loss(
        cfg, model.params, st, a, *batch, target, sink=tcfg.sink, recent=tcfg.recent,
        l1=tcfg.l1)[0])(state.params["alpha"])
    state1, m = step(state, model.params, st, *batch)
    np.testing.assert_allclose(float(m["grad_norm"]), float(jnp.linalg.norm(g)), rtol=1e-4)
    # AdamW's first step moves each entry by lr(0) * g / (|g| + eps) (bias-corrected moments)
    lr0 = float(ktrain.lr_schedule(tcfg.lr, tcfg.steps)(0))
    want = np.clip(1.0 - lr0 * np.asarray(g) / (np.abs(np.asarray(g)) + 1e-8), 0.0, 1.0)
    np.testing.assert_allclose(np.asarray(state1.params["alpha"]), want, rtol=1e-5, atol=1e-6)
    state2, m = step(state1, model.params, st, *batch)
    assert np.all(np.asarray(state2.params["alpha"]) < 1.0)
    # the loss depends on alpha: the gradient (L1 term + distillation) is non-zero
    assert m["grad_norm"] > 0 and m["mse"] > 0


def test_alpha_stays_in_unit_interval(model, pdata):
    # per-query-head gates, a learning rate and L1 weight large enough to hit the bounds
    res = ktrain.train_importance(model, _tcfg(steps=6, lr=2.0, l1=50.0, granularity="query"), data=pdata,
                                  quiet=True)
    a = res.alpha
    assert a.shape == (2, 4)
    assert a.min() >= 0.0 and a.max() <= 1.0
    assert (a == 0.0).any()  # the projection engaged


def test_schedule_shape():
    f = ktrain.lr_schedule(0.02, 100)
    assert math.isclose(float(f(0)), 0.002, rel_tol=1e-5)
    assert math.isclose(float(f(20)), 0.02, rel_tol=1e-5)
    assert math.isclose(float(f(50)), 0.02, rel_tol=1e-5)
    assert math.isclose(float(f(100)), 0.002, rel_tol=1e-4)
    assert float(f(10)) < 0.02 and float(f(90)) < 0.02


@pytest.mark.slow  # 10 s
def test_checkpoint_resume_reproduces_state(model, pdata, tmp_path):
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    full = ktrain.train_importance(model, _tcfg(a_dir), data=pdata, quiet=True)
    part = ktrain.train_importance(model, _tcfg(b_dir), data=pdata, quiet=True, stop_after=2)
    assert int(part.state.step) == 2 and not os.path.exists(os.path.join(b_dir, ktrain.SCORES_JSON))
    resumed = ktrain.train_importance(model, _tcfg(b_dir), data=pdata, quiet=True)
    assert int(resumed.state.step) == 4
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7),
                 full.state.params, resumed.state.params)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7),
                 full.state.opt_state, resumed.state.opt_state)
    # scores files: readable JSON and orbax agree
    js = deploy.load_scores(os.path.join(b_dir, ktrain.SCORES_JSON))
    ob = deploy.load_scores(os.path.join(b_dir, "scores"))
    np.testing.assert_allclose(js, ob, atol=1e-6)
    doc = json.load(open(os.path.join(b_dir, ktrain.SCORES_JSON)))
    assert doc["num_layers"] == 2 and len(doc["alpha"][0]) == 2
    with pytest.raises(ValueError):
        ktrain.train_importance(model, _tcfg(b_dir, sink=4), data=pdata, quiet=True)


# ----------------------------------------------------------------------------- deployment
def test_clo_thresholds_hand_values():
    eta = 0.9
    t = np.asarray(deploy.clo_thresholds(jnp.array([1.0, 0.0, 0.5]), eta, p=1.0))
    th = math.acos(0.9)
    np.testing.assert_allclose(t, [0.9, -1.0, math.cos(0.5 * th + 0.5 * math.pi)], atol=1e-6)
    assert abs(t[2] - (-0.22361)) < 1e-4
    t2 = np.asarray(deploy.clo_thresholds(jnp.array([0.5]), eta, p=2.0))  # lambda = 0.25
    np.testing.assert_allclose(t2, [math.cos(0.25 * th + 0.75 * math.pi)], atol=1e-6)
    assert abs(t2[0] - (-0.78218)) < 1e-4
    # monotone: more important -> higher threshold (harder to reuse)
    s = jnp.linspace(0, 1, 11)
    assert np.all(np.diff(np.asarray(deploy.clo_thresholds(s, 0.95))) > 0)


def test_group_similarity_hand_values():
    # sum w / sum(w / c): (1 + 3) / (1/0.9 + 3/0.5) = 4 / 7.1111 = 0.5625
    got = float(deploy.group_similarity(jnp.array([0.9, 0.5]), jnp.array([1.0, 3.0])))
    assert abs(got - 0.5625) < 1e-6
    assert abs(float(deploy.group_similarity(jnp.array([0.8, 0.8]), jnp.array([0.2, 5.0]))) - 0.8) < 1e-6
    # zero-weight head is ignored; all-zero weights -> plain harmonic mean
    assert abs(float(deploy.group_similarity(jnp.array([0.9, 0.1]), jnp.array([1.0, 0.0]))) - 0.9) < 1e-6
    hm = 2 / (1 / 0.9 + 1 / 0.6)
    assert abs(float(deploy.group_similarity(jnp.array([0.9, 0.6]), jnp.array([0.0, 0.0]))) - hm) < 1e-6
    batch = deploy.group_similarity(jnp.array([[0.9, 0.5], [0.8, 0.8]]), jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(batch, [0.5625, 0.8], atol=1e-6)


def test_binarize_and_masks():
    s = np.array([[0.9, 0.1, 0.5], [0.3, 0.8, 0.2]])
    m = deploy.binarize(s, 0.5)
    np.testing.assert_array_equal(m, [[True, False, True], [False, True, False]])
    lo = deploy.lowest_mask(s, 0.5)
    np.testing.assert_array_equal(lo, ~m)
    assert deploy.binarize(s, 0.0).sum() == 0 and deploy.binarize(s, 1.0).all()
    assert deploy.binarize(s, 0.34).sum() == 3  # ceil(0.34 * 6)
    np.testing.assert_allclose(deploy.group_scores(jnp.array([[0.2, 0.4, 1.0, 0.0]]), 2), [[0.3, 0.5]])
    np.testing.assert_allclose(deploy.query_scores(jnp.array([[0.3, 0.5]]), 2), [[0.3, 0.3, 0.5, 0.5]])


def test_passkey_accuracy_matches_model_logits(model, pdata):
    """With every head on full attention, passkey_accuracy's counts and answer log-probability are
    those of the model's own prefill logits at the answer positions."""
    from kvoffload.importance.evaluate import passkey_accuracy
    from kvoffload.models.transformer import prefill

    r = passkey_accuracy(model, pdata, None, num_samples=2, length=600, sink=8, recent=32)
    hits = n = correct = 0
    logp = 0.0
    for i in range(2):
        s = pdata.sample(i, 600, "eval")
        lg, *_ = prefill(model.config, model.params, jnp.asarray(s.tokens[None]),
                         jnp.array([s.length]), all_logits=True)
        pos = np.flatnonzero(s.answer_mask)
        lg = np.asarray(lg[0, pos], np.float64)
        nxt = s.tokens[pos + 1]
        pred = lg.argmax(-1)
        hits += int(np.sum(pred == nxt))
        n += len(pos)
        lse = lg.max(-1) + np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1))
        logp += float(np.sum(lg[np.arange(len(pos)), nxt] - lse))
        got = dict(zip(pos.tolist(), pred.tolist()))
        correct += sum(all(got[t - 1] == s.tokens[t] for t in range(a, e)) for a, e in s.answer_spans)
    assert r["questions"] == 4 and r["correct"] == correct
    assert r["accuracy"] == correct / 4 and r["token_accuracy"] == pytest.approx(hits / n)
    assert r["answer_logprob"] == pytest.approx(logp / n, rel=1e-4)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path, model):
    """train-importance --evaluate and train-hata through the CLI on a converted tiny model."""
    from kvoffload.eval.ruler import essays_text
    from kvoffload.importance import cli
    from kvoffload.models import save_converted

    p = cli.importance_parser()
    a = p.parse_args(["--out", "x", "--steps", "3"])
    assert (a.sink, a.recent, a.lr, a.l1, a.granularity) == (128, 256, 0.02, 0.05, "kv")
    assert cli.train_importance_main(["--out", str(tmp_path), "--steps", "0"]) == 2
    mdir, text = str(tmp_path / "model"), str(tmp_path / "text.txt")
    save_converted(mdir, model.config, model.params, model.tokenizer)
    open(text, "w").write(essays_text()[:60_000])
    out = str(tmp_path / "imp")
    rc = cli.train_importance_main([
        "--model", mdir, "--text", text, "--steps", "2", "--min-length", "520", "--max-length", "640",
        "--pad-multiple", "128", "--sink", "8", "--recent", "32", "--num-passkeys", "2", "--words-per-key", "2",
        "--evaluate", "--eval-samples", "1", "--eval-length", "600", "--out", out, "--quiet"])
    assert rc == 0
    doc = json.load(open(os.path.join(out, ktrain.SCORES_JSON)))
    assert set(doc["check"]) >= {"full", "lowest_streaming", "highest_streaming"}
    rc = cli.train_hata_main(["--model", mdir, "--text", text, "--steps", "2", "--bits", "32", "--prompts", "1", "--data", "essays",
                              "--eval-prompts", "1", "--prompt-length", "192", "--queries", "8",
                              "--out", str(tmp_path / "hata"), "--quiet"])
    assert rc == 0 and os.path.exists(str(tmp_path / "hata" / "hata.json"))
