"""The cost model, KVPR's split scheduler over pool extents (properties; hypothesis), and the profiler."""

import json

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.runtime.cost import extent_work
from kvoffload.runtime.pool import PoolLayout
from kvoffload.plan.cost import CostModel, LayerShape, Linear, predict_layers
from kvoffload.plan.memory import weight_bytes
from kvoffload.plan.profiler import model_shape
from kvoffload.plan.split import choose_split, no_recompute_reason


def _shape(cfg_name, p=2):
    cfg = model_shape(cfg_name)
    wb = weight_bytes(cfg, jnp.bfloat16)
    return LayerShape.of(cfg, p, wb.per_layer, wb.kv_per_layer)


H100 = CostModel(h2d=Linear(2e-5, 1 / 53e9), d2h=Linear(2e-5, 1 / 53e9), recompute=Linear(2e-5, 1 / 600e12),
                 attention=Linear(1e-5, 1 / 2.5e12), dense=Linear(3e-5, 1 / 500e12), hbm_bw=3e12)

# OPT-6.7B b64 P512 in 64-token blocks: 512 blocks, 4 extents of 128
OPT_LAYOUT = PoolLayout(block_tokens=64, extent_blocks=128, num_extents=4)


def _work(shape, layout, batch, used, tokens, g=1):
    return lambda r: [extent_work(shape, layout, batch, used, r, tokens)] * g


def test_opt_mha_recomputes_everything_at_half_the_bytes():
    """PCIe-bound MHA: recomputing all 4 extents moves X only (half the bytes of K/V) and the
    recompute (3.7 ms) hides under that transfer, so the scheduler takes r = 4 and the layer halves."""
    sh = _shape("opt-6.7b")
    work = _work(sh, OPT_LAYOUT, 64, 4, 64 * 513)
    plan = choose_split(H100, sh, work, range(5))
    assert plan.r == 4 and "recompute 4 extents" in plan.reason
    off = predict_layers(H100, sh, work(0))["step_s"]
    assert plan.predicted_s / off == pytest.approx(0.5, abs=0.03)
    assert no_recompute_reason(sh) is None


def test_gqa_llama3_says_no_recompute():
    reason = no_recompute_reason(_shape("llama-3-8b"))
    assert "GQA" in reason and "no recompute" in reason


def test_streamed_weights_are_counted():
    sh = _shape("opt-13b")
    lay = PoolLayout(block_tokens=64, extent_blocks=64, num_extents=4)
    plan = choose_split(H100, sh, _work(sh, lay, 32, 4, 32 * 512, g=4), range(5), offload_weights=True)
    assert plan.predicted_s >= H100.h2d.slope * sh.w_layer  # every layer's weights cross PCIe


cost_numbers = st.builds(
    lambda bw, lat, rate, rlat, attn, dense: CostModel(
        h2d=Linear(lat, 1 / bw), d2h=Linear(lat, 1 / bw), recompute=Linear(rlat, 1 / rate),
        attention=Linear(1e-5, 1 / attn), dense=Linear(1e-5, 1 / dense), hbm_bw=attn),
    st.floats(1e9, 200e9), st.floats(0, 1e-3), st.floats(1e11, 2e15), st.floats(0, 1e-3), st.floats(1e10, 5e12),
    st.floats(1e11, 1e15))


@settings(max_examples=200, deadline=None)
@given(cost=cost_numbers, h=st.sampled_from([512, 4096, 8192]), kv_ratio=st.sampled_from([1, 2, 8]),
       b=st.integers(1, 128), e=st.integers(1, 64), used=st.integers(0, 12), g=st.integers(1, 4),
       offload_w=st.booleans())
def test_scheduler_picks_the_fastest_candidate(cost, h, kv_ratio, b, e, used, g, offload_w):
    sh = LayerShape(x_tok=h * 2, kv_tok=2 * (h // kv_ratio) * 2, recompute_flops_tok=2 * h * 2 * h / kv_ratio,
                    dense_flops_tok=24 * h * h, w_layer=12 * h * h * 2, w_kv=4 * h * h * 2 / kv_ratio)
    lay = PoolLayout(block_tokens=64, extent_blocks=e, num_extents=max(used, 1))
    work = _work(sh, lay, b, used, b * 64 * e * used + b, g)
    cands = list(range(used + 1))
    plan = choose_split(cost, sh, work, cands, offload_weights=offload_w)
    times = [predict_layers(cost, sh, work(r), offload_weights=offload_w)["step_s"] for r in cands]
    assert plan.predicted_s == min(times)
    assert plan.r == times.index(min(times))  # the smallest r among equally fast ones
    assert (no_recompute_reason(sh) is not None) == (sh.x_tok >= sh.kv_tok)


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


@pytest.mark.slow  # 10 s; the profiler itself is tested by default
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


def test_named_shapes_of_the_speed_benchmarks():
    """The random-weight shapes the GPU benchmarks name: heads, GQA groups, biases and weight bytes as the
    published configs give them (Qwen2.5-7B: 28 query heads on 4 KV heads, q/k/v biases, ~7.6e9 params)."""
    q = model_shape("qwen2.5-7b")
    assert (q.model_type, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim, q.qkv_bias) == \
        ("qwen2", 28, 28, 4, 128, True)
    l2 = model_shape("llama-2-7b")
    assert (l2.num_heads, l2.num_kv_heads, l2.intermediate_size, l2.qkv_bias) == (32, 32, 11008, False)
    for name, params in (("qwen2.5-7b", 7.6e9), ("llama-2-7b", 6.7e9), ("llama-3-8b", 8.0e9)):
        wb = weight_bytes(model_shape(name), jnp.bfloat16)
        assert abs((wb.other + wb.per_layer * model_shape(name).num_layers) / 2 / params - 1) < 0.03, name
