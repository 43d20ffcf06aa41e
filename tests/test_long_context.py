"""Token-chunked prefill (``prefill_chunk_tokens``): a layer's prompt in chunks of
tokens, attention over the keys so far in key blocks with an online softmax, so the workspace is a
chunk's. CPU, fp32, tiny LLaMA (GQA, RoPE) and OPT (MHA, learned positions): the same K/V/X, logits and
greedy tokens as the whole-prompt prefill; the planner's numbers for a 1M-token Llama-3-8B prompt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload.engine import pad_prompts
from kvoffload.models import Model, tiny_random_model
from kvoffload.models.transformer import family, init_params, layer_prefill, layer_prefill_chunked
from kvoffload.plan.memory import MemoryPlanError, check_memory
from kvoffload.plan.profiler import model_shape
from kvoffload.policies import make_policy

# fp32: chunked and whole differ only in the order of sums (attention's online softmax, matmul tiling)
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.slow), "opt"])  # llama: 9 s
def model(request):
    return tiny_random_model(request.param, seed=2)


@pytest.mark.parametrize("attention_impl", ["reference", "kernel"])
def test_layer_prefill_chunked_equals_whole(model, attention_impl):
    """One layer, ragged lengths (44, 30, 5): chunks of 16 (2 full + a remainder of 12) with key
    blocks of 8 (several blocks; the last one, [40, 44), read as [36, 44) with [36, 40) masked); and
    the same chunks through the Pallas flash-attention kernel (interpret mode here)."""
    cfg = model.config
    b, t = 3, 44
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size - 1, (b, t)), jnp.int32)
    lengths = jnp.asarray([44, 30, 5], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = family(cfg).embed(cfg, model.params, tokens, pos)
    lp = model.params.layers[0]
    want = layer_prefill(cfg, lp, h, pos, lengths)
    valid = (jnp.arange(t)[None] < lengths[:, None])[..., None]  # rows past a prompt's length are padding
    run = jax.jit(layer_prefill_chunked, static_argnames=("cfg", "chunk_tokens", "keep_x", "key_block",
                                                          "attention_impl"))
    got = run(cfg, lp, h, pos, lengths, chunk_tokens=16, key_block=8, attention_impl=attention_impl)
    np.testing.assert_allclose(np.where(valid, got[0], 0), np.where(valid, want[0], 0), **TOL)
    for a, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(a, w, **TOL)
    assert run(cfg, lp, h, pos, lengths, chunk_tokens=16, keep_x=False)[3] is None


def _generate(model, chunk, steps=10, **opts):
    pol = make_policy("kvpr", block_tokens=8, extent_mb=2 * 8 * 2 * 16 * 4 / 2**20, prefill_chunk_tokens=chunk,
                      **opts)
    tokens, lengths = pad_prompts([list(range(3, 47)), list(range(5, 35)), [7, 8, 9, 10, 11]])
    logits, state = pol.prefill(model, tokens, lengths, 96)
    first, greedy = np.asarray(logits), []
    # copied through the device: a NumPy view of a pinned-host extent would be an external reference to a
    # buffer the next flush donates (refused on the GPU)
    pools = jax.tree.map(lambda a: np.asarray(jax.device_put(a, a.sharding.with_memory_kind("device"))),
                         (state.groups[0].pool_k, state.groups[0].pool_v, state.groups[0].pool_x))
    for _ in range(steps):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        greedy.append(np.asarray(tok))
        logits, state = pol.decode_step(model, state, tok)
    return first, pools, np.asarray(greedy), pol


@pytest.mark.parametrize("family_name", ["opt", pytest.param("llama", marks=pytest.mark.slow)])  # 11 s each
def test_chunked_prefill_gives_the_same_pool_and_tokens(family_name):
    """The whole pipeline (kvpr: the OPT pool stores X too; GQA LLaMA stores none), prompts of 44, 30
    and 5 tokens in chunks of 16: every layer's prompt extents (K, V, X), the first logits and 10 greedy
    tokens (two flushes) equal the whole-prompt prefill's; the plan counts the chunk's workspace."""
    model = tiny_random_model(family_name, seed=2)
    w_logits, w_pools, w_greedy, w_pol = _generate(model, None)
    logits, pools, greedy, pol = _generate(model, 16)
    np.testing.assert_allclose(logits, w_logits, **TOL)
    for a, w in zip(jax.tree.leaves(pools), jax.tree.leaves(w_pools), strict=True):
        np.testing.assert_allclose(a, w, **TOL)
    np.testing.assert_array_equal(greedy, w_greedy)
    assert pol.pipeline.memory_plan.gpu["prefill workspace"] != w_pol.pipeline.memory_plan.gpu["prefill workspace"]


def test_planner_bounds_a_million_token_prefill():
    """Llama-3-8B shape, B = 1, 1M tokens, offload with int4 host K/V (abstract weights; nothing is
    allocated). Whole-prompt prefill would need ~200 GB of GPU workspace (MLP intermediate 1M x 14336
    x 2 B = 28 GB, one 512-query score chunk over 1M keys 68 GB, ...): refused on an 80 GB GPU with the
    planner's message. In chunks of 8192 tokens the prefill holds one layer's hidden states (in and
    out), K/V and extents plus a chunk's workspace: under 30 GB, and the run fits an 80 GB GPU and a
    128 GB host (int4 K/V of all layers: 43 GB, 0.3125x of bf16's 137 GB)."""
    cfg = model_shape("llama-3-8b")
    big = Model(cfg, jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16)))
    t = 1 << 20
    plans = {}
    for chunk in (None, 8192):
        pipe = make_policy("offload", host_dtype="int4", prefill_chunk_tokens=chunk, check_memory=False).pipeline
        pipe.plan(big, np.array([t]), t, t + 64)
        plans[chunk] = pipe.memory_plan
    whole, chunked = plans[None], plans[8192]
    assert whole.gpu["prefill workspace"] > 150e9
    assert chunked.gpu["prefill workspace"] < 30e9
    assert chunked.host["K/V blocks"] == pytest.approx(0.3125 * t * cfg.kv_bytes_per_token * 2 * cfg.num_layers, rel=1e-3)
    with pytest.raises(MemoryPlanError, match="GPU side needs"):
        check_memory(whole, host_available=128e9, gpu_available=80e9)
    check_memory(chunked, host_available=128e9, gpu_available=80e9)


def test_prefill_chunk_tokens_is_validated():
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be an integer >= 1"):
        make_policy("offload", prefill_chunk_tokens=0)


def test_chunked_prefill_through_the_kernel_gives_the_same_pool_and_tokens():
    """prefill_attention_impl="kernel" (the Pallas flash attention, interpret mode on the CPU) in the whole
    pipeline: the pool and the greedy tokens of the XLA chunked prefill; an unknown impl is refused."""
    model = tiny_random_model("opt", seed=2)
    w_logits, w_pools, w_greedy, _ = _generate(model, 16, steps=4, prefill_attention_impl="reference")
    logits, pools, greedy, _ = _generate(model, 16, steps=4, prefill_attention_impl="kernel")
    np.testing.assert_allclose(logits, w_logits, **TOL)
    for a, w in zip(jax.tree.leaves(pools), jax.tree.leaves(w_pools), strict=True):
        np.testing.assert_allclose(a, w, **TOL)
    np.testing.assert_array_equal(greedy, w_greedy)
    with pytest.raises(ValueError, match="prefill_attention_impl must be"):
        make_policy("kvpr", prefill_attention_impl="flash")


def test_cudnn_prefill_attention_is_refused_where_it_cannot_run_and_auto_falls_back():
    """impl="cudnn" needs a GPU and 16-bit inputs: elsewhere one clear error, before any work; "auto"
    takes the XLA path there (the same numbers as "reference")."""
    from kvoffload.models.common import prefill_attention_chunk

    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (1, 4, 8, 16), jnp.float32)
    k = jax.random.normal(ks[1], (1, 2, 24, 16), jnp.float32)
    v = jax.random.normal(ks[2], (1, 2, 24, 16), jnp.float32)
    args = (q, k, v, jnp.int32(8), jnp.asarray([20], jnp.int32))
    with pytest.raises(ValueError, match="prefill_attention_impl='cudnn' needs a GPU, bf16 or fp16"):
        prefill_attention_chunk(*args, impl="cudnn")
    np.testing.assert_array_equal(prefill_attention_chunk(*args, impl="auto"),
                                  prefill_attention_chunk(*args, impl="reference"))
    with pytest.raises(ValueError, match="impl must be one of"):
        prefill_attention_chunk(*args, impl="flash")
    assert make_policy("kvpr", prefill_attention_impl="cudnn").pipeline.opts.prefill_attention_impl == "cudnn"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's flash attention runs on a GPU")
@pytest.mark.parametrize("q_start, tc, lengths", [(0, 64, [64, 40]), (96, 64, [160, 100]), (128, 40, [168, 100])])
def test_cudnn_prefill_attention_matches_the_xla_path_in_bf16(q_start, tc, lengths):
    """GPU: the two cuDNN calls merged by log-sum-exp (prefix + the chunk's own causal keys) against the XLA
    path, bf16, GQA 8/2, d 64: the first chunk (no prefix), a chunk whose rows pass one prompt's end, a
    chunk past a prompt's end (no own keys: the prefix alone) and a ragged chunk length."""
    from kvoffload.models.common import prefill_attention_chunk

    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (2, 8, tc, 64), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 2, 256, 64), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 2, 256, 64), jnp.bfloat16)
    L = jnp.asarray(lengths, jnp.int32)
    got = prefill_attention_chunk(q, k, v, jnp.int32(q_start), L, impl="cudnn")
    assert got.dtype == q.dtype and got.shape == q.shape
    with jax.default_matmul_precision("highest"):
        want = prefill_attention_chunk(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                       jnp.int32(q_start), L, impl="reference")
    rows = ((q_start + np.arange(tc))[None, :] < np.asarray(lengths)[:, None])[:, None, :, None]
    err = np.abs(np.where(rows, np.asarray(got, np.float32) - np.asarray(want), 0)).max()
    assert err < 2e-2, err


# slow; by default test_random_kv_prefill_takes_the_pipelines_layer_prefill_arguments checks the random prefill
@pytest.mark.slow
def test_bench_long_context_with_random_prefill_decodes_and_says_so(tmp_path):
    """benchmarks/bench_long_context.py --random-prefill on the tiny OPT shape, clo with int4 host K/V: random K/V in
    place of the prefill's layer programs (`_common.random_kv_prefill`, which the JSON names), then the
    decode steps and the plan; the stand-in is removed after the run."""
    import json

    from script_loader import script_module

    from kvoffload.runtime import prefill as pipeline

    path = tmp_path / "random.json"
    with script_module("bench_long_context") as blc:
        rc = blc.main(["--shape", "tiny-opt", "--tokens", "96", "--policy", "clo", "--option", "block_tokens=16",
                       "--option", "prefill_chunk_tokens=32", "--option", "int4_group_size=16", "--steps", "2",
                       "--out", str(path), "--random-prefill"])
    assert rc == 0 and pipeline._layer_prefill.__name__ == "_layer_prefill"
    r = json.loads(path.read_text())
    assert r["prefill"].startswith("random K/V") and r["options"]["host_dtype"] == "int4"
    assert r["decode_step_s"] > 0 and len(r["decode_step_times_s"]) == 2 and r["memory_plan"]["host"]["K/V blocks"] > 0
