"""The cost model, the KVPR split-point scheduler (vs brute force; hypothesis), and the profiler."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.plan.cost import CostModel, LayerShape, Linear, predict_step
from kvoffload.plan.split import OBJECTIVES, SplitProblem, brute_force, bucket_candidates, choose_split, objective_value
from kvoffload.plan.profiler import model_shape


def _problem(cfg_name, batch, s, bucket=64, offload_weights=False, g=1, p=2):
    cfg = model_shape(cfg_name)
    from kvoffload.plan.memory import weight_bytes
    import jax.numpy as jnp

    wb = weight_bytes(cfg, jnp.bfloat16)
    shape = LayerShape.of(cfg, p, wb.per_layer, wb.kv_per_layer)
    return cfg, SplitProblem(shape=shape, batch=batch, s=s, candidates=bucket_candidates(s, bucket),
                             offload_weights=offload_weights, gpu_batches=g)


H100 = CostModel(h2d=Linear(2e-5, 1 / 53e9), d2h=Linear(2e-5, 1 / 53e9), recompute=Linear(2e-5, 1 / 600e12),
                 attention=Linear(1e-5, 1 / 2.5e12), dense=Linear(3e-5, 1 / 500e12), hbm_bw=3e12)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_opt_mha_recomputes_about_half_the_bytes(objective):
    cfg, prob = _problem("opt-6.7b", 64, 512)
    plan = choose_split(prob, H100, objective)
    assert plan.l > 0 and "recompute" in plan.reason
    assert (plan.l, pytest.approx(plan.predicted_s)) == (brute_force(prob, H100, objective)[0],
                                                         brute_force(prob, H100, objective)[1])
    off = predict_step(H100, cfg, prob.shape, 64, 512, 0, policy="offload")["step_s"]
    kv = predict_step(H100, cfg, prob.shape, 64, 512, plan.l, policy="kvpr")["step_s"]
    if objective == "pipelined":  # PCIe-bound: l = s moves X only, half the bytes
        assert kv / off == pytest.approx(0.5, abs=0.03)


def test_gqa_llama3_chooses_no_recompute():
    _, prob = _problem("llama-3-8b", 32, 1024)
    for objective in OBJECTIVES:
        plan = choose_split(prob, H100, objective)
        assert plan.l == 0
        assert "GQA" in plan.reason and "no recompute" in plan.reason


def test_column_form_counts_weights():
    _, prob = _problem("opt-13b", 32, 512, offload_weights=True, g=4)
    v0 = objective_value(prob, H100, 0, "column")
    w = H100.h2d(prob.shape.w_kv) + H100.h2d(prob.shape.w_layer - prob.shape.w_kv)
    assert v0 >= w
    plan = choose_split(prob, H100, "column")
    assert plan.predicted_s == pytest.approx(brute_force(prob, H100, "column")[1])


cost_numbers = st.builds(
    lambda bw, lat, rate, rlat, attn, dense: CostModel(
        h2d=Linear(lat, 1 / bw), d2h=Linear(lat, 1 / bw), recompute=Linear(rlat, 1 / rate),
        attention=Linear(1e-5, 1 / attn), dense=Linear(1e-5, 1 / dense), hbm_bw=attn),
    st.floats(1e9, 200e9), st.floats(0, 1e-3), st.floats(1e11, 2e15), st.floats(0, 1e-3), st.floats(1e10, 5e12),
    st.floats(1e11, 1e15))
shapes = st.builds(
    lambda h, kvr, b, s, bucket, wl: (h, kvr, b, s, bucket, wl),
    st.sampled_from([512, 1024, 4096, 5120, 8192]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 256),
    st.integers(1, 4096), st.sampled_from([1, 16, 64, 128]), st.booleans())


@settings(max_examples=300, deadline=None)
@given(cost=cost_numbers, shp=shapes, objective=st.sampled_from(OBJECTIVES), g=st.integers(1, 4))
def test_scheduler_matches_brute_force(cost, shp, objective, g):
    h, kv_ratio, b, s, bucket, offload_w = shp
    kv_tok = 2 * (h // kv_ratio) * 2
    shape = LayerShape(x_tok=h * 2, kv_tok=kv_tok, recompute_flops_tok=2 * h * 2 * h / kv_ratio,
                       dense_flops_tok=24 * h * h, w_layer=12 * h * h * 2, w_kv=4 * h * h * 2 / kv_ratio)
    prob = SplitProblem(shape=shape, batch=b, s=s, candidates=bucket_candidates(s, bucket),
                        offload_weights=offload_w, gpu_batches=g)
    plan = choose_split(prob, cost, objective)
    l_bf, v_bf = brute_force(prob, cost, objective)
    assert plan.l in prob.candidates
    if shape.x_tok >= shape.kv_tok:
        # an activation no smaller than its K/V: l = 0 is optimal under every objective, and said so
        assert plan.l == 0 and "GQA" in plan.reason
        assert plan.predicted_s == pytest.approx(v_bf, rel=1e-9)
    else:
        assert plan.predicted_s == pytest.approx(v_bf, rel=1e-9)


def test_linear_fit_and_cost_roundtrip(tmp_path):
    f = Linear.fit([1e6, 4e6, 16e6], [1e-4 + 1e6 / 50e9, 1e-4 + 4e6 / 50e9, 1e-4 + 16e6 / 50e9])
    assert f.intercept == pytest.approx(1e-4, rel=1e-6) and 1 / f.slope == pytest.approx(50e9, rel=1e-6)
    assert f(0) == 0.0
    prof = {"device": "x", "fits": H100.to_json()}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    cm = CostModel.load(str(p))
    assert cm.pcie_bw == pytest.approx(53e9)
    with pytest.raises(FileNotFoundError, match="kvoffload profile"):
        CostModel.load(str(tmp_path / "missing.json"))


def test_profiler_cli_writes_a_profile(tmp_path, capsys):
    from kvoffload.offload.cli import profile_main

    out = tmp_path / "prof.json"
    assert profile_main(["--quick", "--model-shape", "tiny-opt", "--batch", "1", "--dtype", "float32",
                         "--sizes-mb", "0.05,0.1,0.2", "--tokens", "8,16", "--contexts", "16,32",
                         "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    for k in ("h2d", "d2h", "recompute", "attention", "dense", "hbm_bw"):
        assert k in prof["fits"]
    assert len(prof["raw"]["h2d"]) >= 3
    assert "[profile]" in capsys.readouterr().err
    cm = CostModel.load(str(out))
    assert cm.pcie_bw > 0
