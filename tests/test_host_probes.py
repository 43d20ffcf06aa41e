"""The host-cost probes on the CPU: scripts/host_time.py (slow: the whole decode path on a tiny shape, ~10-20 s
of compilation), probe_launch_cost.py, probe_layer_call.py (slow), probe_scan_layers.py (slow) and
probe_stacked_linear.py, probe_decode_linear.py, probe_scan_clo.py (slow): the records they write."""

import json

import pytest

from script_loader import script_module


@pytest.mark.slow
def test_host_time_splits_a_step_and_restores_what_it_timed(tmp_path):
    """offload on the tiny OPT shape: per step one layer program per layer, transfers issued for each (a host
    pool), host milliseconds per part below the step's; the timed functions are the originals afterwards."""
    import jax

    from kvoffload.runtime import layer as PL
    from kvoffload.runtime.pipeline import LayerPipeline

    before = (PL.layer_step, LayerPipeline.to_device, jax.block_until_ready)
    with script_module("host_time") as ht:
        rec = ht.main(["--shape", "tiny-opt", "--batch", "3", "--prompt", "40", "--policy", "offload", "--option",
                       "block_tokens=8", "--warmup", "1", "--steps", "2", "--out", str(tmp_path / "h.json")])
    assert (PL.layer_step, LayerPipeline.to_device, jax.block_until_ready) == before
    assert rec["calls_per_step"]["dispatch layer programs"] == 2  # tiny-opt: 2 layers, one GPU batch
    assert rec["calls_per_step"]["issue transfers"] >= 2
    parts = rec["host_ms_per_step"]
    assert 0 < parts["dispatch layer programs"] < rec["step_ms"] and 0 < parts["issue transfers"] < rec["step_ms"]
    assert rec["options"] == {"block_tokens": 8} and rec["used_extents"] >= 1
    # per step: the host's share (every program dispatched) within the step, the layer dispatch within that
    each = list(zip(rec["step_ms_each"], rec["issued_ms_each"], rec["dispatch_ms_each"]))
    assert len(each) == 2 and all(0 < d <= i <= s for s, i, d in each)
    assert [sorted(g) for g in rec["host_gauge"]] == [["dispatch_us", "python_loop_ns"]] * 2
    assert json.loads((tmp_path / "h.json").read_text())["step_ms"] == rec["step_ms"]


def test_probe_launch_cost_reports_per_call_kernel_and_argument_costs(tmp_path):
    with script_module("probe_launch_cost") as pc:
        rec = pc.main(["--kernels", "4", "--calls", "3", "--out", str(tmp_path / "p.json")])
    chain = rec["kernel_chain"]
    assert set(chain) == {"same buffers", "weights cycling", "weights cycling, output chained"}
    for r in chain.values():
        assert r["us_per_call"] > 0 and abs(r["us_per_kernel"] * 4 - r["us_per_call"]) < 1e-6
    assert list(rec["arguments_us_per_call"]["1 devices"]) == [1, 16, 64]
    assert json.loads((tmp_path / "p.json").read_text())["kernels"] == 4


TINY_LLAMA = dict(model_type="llama", vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@pytest.mark.slow
def test_probe_layer_call_times_the_real_layer_program_with_and_without_the_slot_split(tmp_path):
    """clo Quest int8 on a 3-layer tiny Llama: both variants timed in interleaved blocks; splitting off the
    slots' read-only part (the reuse rule, the Quest pages) leaves the arguments as they were and takes those
    leaves out of the outputs."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    with script_module("probe_layer_call") as pl:
        rec = pl.main(["--shape", str(cfg), "--prompt", "200", "--option", "retrieval=quest", "--option", "topk=80",
                       "--option", "block_tokens=16", "--option", "quest_dtype=int8", "--calls", "4", "--rounds",
                       "2", "--versus", "extent_mb=0.002", "--per-program", "2", "--out", str(tmp_path / "c.json")])
    split, whole, one = (rec["variants"][k] for k in ("as run", "whole slots", "one layer"))
    # a second state with extents of 2 KB of K (several where the default holds the prompt in one), as run:
    # each extent brings its pool arrays, block table, counts and Quest pages
    ext = rec["variants"]["as run, extent_mb=0.002"]
    assert rec["versus"] == {"extent_mb": 0.002} and len(ext["host_us_each"]) == 2
    assert ext["arguments"] > split["arguments"] and ext["outputs"] == split["outputs"]
    assert len(split["host_us_each"]) == len(whole["host_us_each"]) == len(one["host_us_each"]) == 2
    assert all(0 < v[k] for v in (split, whole, one) for k in ("host_us_min", "block_us_median"))
    assert split["arguments"] == whole["arguments"] == one["arguments"] and one["outputs"] == split["outputs"]
    # the reuse rule (tau, weights, persistent: `CloSlots.rule`) and, per extent, the int8 pages (min, max,
    # scale) are no longer returned
    assert whole["outputs"] - split["outputs"] >= 1 + 3
    assert json.loads((tmp_path / "c.json").read_text())["variants"]["as run"]["outputs"] == split["outputs"]
    # layers 1 and 2 in one layers_step call: both layers' leaves, one hidden state, positions, tail length and
    # block tables; timed per layer
    two = rec["variants"]["2 layers a program"]
    assert rec["per_program"] == [2] and len(two["host_us_each"]) == 2 and two["host_us_min"] > 0
    assert two["outputs"] == 2 * split["outputs"] - 1
    assert split["arguments"] < two["arguments"] < 2 * split["arguments"]


@pytest.mark.slow  # ~12 s: a tiny model's set-up and ~60 small compilations
def test_probe_scan_layers_runs_the_step_as_calls_and_as_one_loop_with_the_same_result(tmp_path):
    """A tiny Llama's 2 layers as 2 calls and as one fori_loop over stacked weights and caches, each layer also
    refilling rows from a host extent (the loop's from one extent of every layer's blocks): the same hidden
    state bit for bit (same layer code, same order), both variants timed, the loop's large writes listed."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    with script_module("probe_scan_layers") as ps:
        rec = ps.main(["--shape", str(cfg), "--layers", "2", "--context", "40", "--glue", "1", "--steps", "2",
                       "--rounds", "1", "--host-rows", "8", "--out", str(tmp_path / "s.json")])
    assert rec["layers"] == 2 and rec["host_rows"] == 8 and rec["max_abs_diff"] == 0.0
    for v in ("calls", "loop"):
        d = rec["variants"][v]
        assert len(d["step_ms"]) == len(d["issued_ms"]) == 2
        assert all(0 < i <= s for i, s in zip(d["issued_ms"], d["step_ms"]))
    assert isinstance(rec["loop_big_writes"], list)
    assert json.loads((tmp_path / "s.json").read_text())["context"] == 40


def test_probe_stacked_linear_times_each_form_separate_and_looped(tmp_path):
    """Every linear form over separate per-layer weights and over a stacked weight in a loop; the reference
    (einsum, fp32 accumulation, separate) differs from itself by nothing and the others by bf16 rounding."""
    with script_module("probe_stacked_linear") as pl:
        rec = pl.main(["--layers", "2", "--din", "64", "--dout", "48", "--reps", "2", "--out", str(tmp_path / "l.json")])
    forms = rec["forms"]
    assert set(forms) == {f"{f} {h}" for f in pl.FORMS for h in ("separate", "loop")}
    assert forms["einsum_f32 separate"]["max_abs_diff"] == 0.0
    # 2 layers summed, each output ~N(0, 1): a bf16 ulp or two of a different summation order, never more
    assert all(0 <= r["max_abs_diff"] < 0.1 and r["us_per_layer"] > 0 for r in forms.values())
    assert json.loads((tmp_path / "l.json").read_text())["din"] == 64


def test_probe_decode_linear_times_every_projection_form(tmp_path):
    """Projections of the tiny OPT shape as XLA's einsum (fp32 result: the reference, and bf16 result) and as the
    kernel over a two-point tile sweep (interpreted here): each timed, each within bf16 rounding of the reference,
    the fastest per projection and rows one of them."""
    with script_module("probe_decode_linear") as pd:
        rec = pd.main(["--shape", "tiny-opt", "--rows", "1,3", "--only", "kv,gate_up", "--sweep", "32/64/4,8/3",
                       "--reps", "1", "--out", str(tmp_path / "d.json")])
    forms = rec["forms"]
    kinds = ("einsum_f32", "einsum_bf16", "pallas n32 k64 w4 s3 t512", "pallas n32 k64 w8 s3 t512")
    assert set(forms) == {f"{p} M{m} {k}" for p in ("kv", "gate_up") for m in (1, 3) for k in kinds}
    assert forms["kv M3 einsum_f32"]["N"] == 128 and forms["gate_up M1 einsum_f32"]["N"] == 256
    assert all(r["us"] > 0 and 0 <= r["max_abs_diff"] < 0.1 for r in forms.values())
    assert all(r["max_abs_diff"] == 0.0 for k, r in forms.items() if k.endswith("einsum_f32"))
    assert set(rec["fastest"]) == {f"{p} M{m}" for p in ("kv", "gate_up") for m in (1, 3)}
    assert json.loads((tmp_path / "d.json").read_text())["shape"] == "tiny-opt"


def test_decode_linear_weight_copies_exceed_the_l2_and_stay_compilable():
    """The GPU run of the test above compiled 24K launches for the tiny shape (minutes): copies are capped."""
    with script_module("probe_decode_linear") as pd:
        assert pd.weight_copies(4096 * 1024 * 2, False) == 48  # Llama-3-8B's k: 8.4 MB, 400 MB over it
        assert pd.weight_copies(4096 * 14336 * 2, False) == 4
        assert pd.weight_copies(64 * 128 * 2, False) == 128
        assert pd.weight_copies(64 * 128 * 2, True) == 2


# ~15-25 s each: a tiny clo model prefilled and decoded, then its layers compiled twice over; slow, as the runtime's
# own loop (loop_layers: test_offload.py) is in the default run
@pytest.mark.parametrize("linear,buffers", [pytest.param("einsum", "in-place", marks=pytest.mark.slow),
                                            pytest.param("pallas", "in-place", marks=pytest.mark.slow),
                                            pytest.param("einsum", "sliced", marks=pytest.mark.slow)])
def test_probe_scan_clo_loops_the_real_clo_layers_with_the_calls_bits(tmp_path, linear, buffers):
    """clo Quest int8 pages with int8 K / int4 V rows on the host, a replayed hit rate of 0.5 (rows refilled
    from the host every step): layers 1..L-1 as one loop over stacked layers, reading one host extent of all
    their blocks at offset token ids, give the calls' hidden state, tails and slots bit for bit -- with the
    row buffers refilled and read in place (LayerRows) or sliced, the weights sliced or read by index."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 4}))
    with script_module("probe_scan_clo") as ps:
        rec = ps.main(["--shape", str(cfg), "--prompt", "200", "--option", "retrieval=quest", "--option", "topk=80",
                       "--option", "block_tokens=16", "--option", "quest_dtype=int8", "--option",
                       "replay_hit_rate=0.5", "--option", "host_dtype=int4", "--option", "int4_k_quant=int8",
                       "--option", "int4_group_size=16", "--steps", "2", "--rounds", "1", "--linear", linear,
                       "--buffers", buffers, "--list-min-kib", "4", "--out", str(tmp_path / "c.json")])
    assert rec["layers_looped"] == 3 and rec["max_abs_diff"] == {"hidden": 0.0, "tails": 0.0, "slots": 0.0}
    assert rec["buffers"] == buffers and isinstance(rec["loop_large_writes"], list)
    assert set(rec["variants"]) == {"calls", "loop"} | ({"calls_einsum"} if linear == "pallas" else set())
    for v in ("calls", "loop"):
        d = rec["variants"][v]
        assert len(d["step_ms"]) == 2 and all(0 < i <= s for i, s in zip(d["issued_ms"], d["step_ms"]))
    assert json.loads((tmp_path / "c.json").read_text())["extent_blocks"] == rec["extent_blocks"] > 0
    with pytest.raises(SystemExit, match="Quest or HATA"):
        ps.main(["--shape", str(cfg), "--prompt", "200", "--option", "retrieval=exact"])


@pytest.mark.slow  # ~13 s
@pytest.mark.parametrize("linear", ["einsum", "pallas"])
def test_probe_scan_clo_loops_full_with_the_calls_bits(tmp_path, linear):
    """`full` on the same loop (its layers' device extents concatenated, the block tables shifted by layer x E in
    the loop): the calls' hidden state and tails bit for bit, so the selection policies can compare with it."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 4}))
    with script_module("probe_scan_clo") as ps:
        rec = ps.main(["--shape", str(cfg), "--policy", "full", "--prompt", "200", "--option", "block_tokens=16",
                       "--steps", "1", "--rounds", "1", "--linear", linear])
    assert rec["layers_looped"] == 3 and rec["max_abs_diff"] == {"hidden": 0.0, "tails": 0.0, "slots": 0.0}
    with pytest.raises(SystemExit, match="clo policy"):
        ps.main(["--shape", str(cfg), "--policy", "tokenselect"])


def test_mulsum_linear_is_the_same_product_and_is_undone():
    """The probes' --linear mulsum: every family's linear becomes an fp32 multiply and sum of the same product
    (close to the einsum's, bf16 rounding apart), and the returned function puts the einsum back."""
    import jax.numpy as jnp
    import numpy as np

    from kvoffload.models import common, llama, opt
    from kvoffload.offload.bench import use_mulsum_linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 20)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((20,)), jnp.float32)
    einsum = common.linear
    want = np.asarray(einsum(x, w, b))
    restore = use_mulsum_linear()
    try:
        assert llama.linear is opt.linear is common.linear is not einsum
        np.testing.assert_allclose(np.asarray(llama.linear(x, w, b)), want, rtol=1e-5, atol=1e-5)
    finally:
        restore()
    assert llama.linear is opt.linear is common.linear is einsum
