"""The decode loop: same tokens as a per-step loop that reads every token back, few host reads,
refusals of bad sampling / token input, non-finite logits stopped and diagnosed, streaming, and
no compilation once decoding runs."""

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload.cli import main
from kvoffload.compile_count import count_compilations
from kvoffload.engine import (
    CAPACITY_BUCKET,
    GenerationInputError,
    NonFiniteLogitsError,
    TextStreamer,
    bucket,
    generate,
    pad_prompts,
    teacher_forced_logprobs,
)
from kvoffload.errors import KVOffloadError
from kvoffload.models import Model, save_converted, tiny_random_model
from kvoffload.models.sampling import SamplingParameterError, sample
from kvoffload.policies import make_policy
from kvoffload.policies.base import Policy

PROMPTS = [[1, 2, 3], [4, 5], [9, 8, 7, 6, 5]]


def reference_generate(model, prompts, n, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_on_eos=True):
    """The loop as it was: sample eagerly, read each step's tokens back, stop when all rows are done."""
    pol = make_policy("full")
    tokens, lengths = pad_prompts(prompts)
    logits, state = pol.prefill(model, tokens, lengths, bucket(max(map(len, prompts)) + n, CAPACITY_BUCKET))
    eos = set(model.config.eos_token_ids) | set(model.tokenizer.eos_token_ids)
    key = jax.random.key(seed)
    out, done, all_logits = [[] for _ in prompts], np.zeros(len(prompts), bool), []
    for step in range(n):
        key, sub = jax.random.split(key)
        nxt = np.asarray(sample(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p))
        all_logits.append(np.asarray(logits))
        for i in range(len(prompts)):
            if not done[i]:
                out[i].append(int(nxt[i]))
                done[i] = stop_on_eos and int(nxt[i]) in eos
        if done.all() or step == n - 1:
            break
        logits, state = pol.decode_step(model, state, jnp.asarray(nxt))
    return out, np.stack(all_logits)


class Counting(Policy):
    """Delegates to another policy, counting decode steps and running a hook after each."""

    def __init__(self, inner, after_step=None):
        self.inner, self.after_step, self.steps = inner, after_step, 0

    def prefill(self, model, tokens, lengths, capacity):
        return self.inner.prefill(model, tokens, lengths, capacity)

    def decode_step(self, model, state, tokens):
        self.steps += 1
        out = self.inner.decode_step(model, state, tokens)
        if self.after_step is not None:
            self.after_step(self.steps, out)
        return out


@pytest.fixture(scope="module")
def llama():
    return tiny_random_model("llama", seed=1)


@pytest.fixture(scope="module")
def llama4():
    """Four layers, so that layer 2 is one in the middle."""
    return tiny_random_model("llama", seed=2, num_hidden_layers=4)


@pytest.fixture(scope="module")
def eos_model():
    """A tiny llama whose eos ids are tokens its greedy continuations produce early: every row
    finishes, at different steps (by steps 1, 3 and 5)."""
    base = tiny_random_model("llama", seed=1)
    greedy = reference_generate(base, PROMPTS, 12, stop_on_eos=False)[0]
    return tiny_random_model("llama", seed=1, eos_token_id=[greedy[0][1], greedy[1][3], greedy[2][5]])


SAMPLINGS = [dict(), dict(temperature=1.0, seed=5), dict(temperature=0.8, top_k=20, top_p=0.9, seed=11)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "temperature", "topk_topp"])
@pytest.mark.parametrize("sync_every", [1, 4, 16])
def test_tokens_and_logits_equal_per_step_loop(eos_model, sampling, sync_every):
    want, want_logits = reference_generate(eos_model, PROMPTS, 12, **sampling)
    got, got_logits = generate(eos_model, PROMPTS, 12, return_logits=True, sync_every=sync_every, **sampling)
    assert got == want
    if not sampling:  # greedy: every row ends, at different steps
        assert len({len(o) for o in want}) == 3 and max(map(len, want)) < 12
    np.testing.assert_array_equal(got_logits, want_logits)


def test_without_eos_every_step_runs(eos_model):
    want, want_logits = reference_generate(eos_model, PROMPTS, 10, temperature=1.0, seed=2, stop_on_eos=False)
    got, got_logits = generate(eos_model, PROMPTS, 10, temperature=1.0, seed=2, stop_on_eos=False,
                               return_logits=True)
    assert got == want and all(len(o) == 10 for o in got)
    np.testing.assert_array_equal(got_logits, want_logits)


def test_steps_past_eos_are_bounded_and_dropped(eos_model):
    want, _ = reference_generate(eos_model, PROMPTS, 40)
    ref_steps = max(map(len, want))
    assert ref_steps < 8  # every row ends early, so a late sync runs extra steps
    for sync_every in (1, 3, 8, 64):
        pol = Counting(make_policy("full"))
        assert generate(eos_model, PROMPTS, 40, policy=pol, sync_every=sync_every) == want
        # the host sees every row done at the first sync (after a multiple of sync_every steps)
        # at or after the reference's last step; the prefill's logits choose the first token
        assert pol.steps + 1 == min(40, math.ceil(ref_steps / sync_every) * sync_every)


def test_host_reads_only_at_syncs(llama, monkeypatch):
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(1) or real(x))
    # any implicit device->host transfer (np.asarray, int() of a device value) in the loop raises
    with jax.transfer_guard_device_to_host("disallow"):
        out = generate(llama, PROMPTS, 13, sync_every=4, stop_on_eos=False)
    assert len(reads) == 3 + 1  # after steps 4, 8, 12 and once at the end
    assert out == reference_generate(llama, PROMPTS, 13, stop_on_eos=False)[0]


def test_decode_loops_run_with_the_collector_frozen_and_restore_it(llama):
    """generate and teacher_forced_logprobs decode with every object alive before the loop frozen (a full
    collection then scans only the loop's objects), unfreeze after, and leave a caller's own freeze alone."""
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    pol = make_policy("full")
    seen = []
    real = pol.decode_step
    pol.decode_step = lambda *a: seen.append(gc.get_freeze_count()) or real(*a)
    out = generate(llama, PROMPTS, 5, policy=pol, stop_on_eos=False)
    assert len(seen) == 4 and min(seen) > 0 and gc.get_freeze_count() == 0
    assert out == reference_generate(llama, PROMPTS, 5, stop_on_eos=False)[0]
    seen.clear()
    teacher_forced_logprobs(llama, [3, 1, 4, 1, 5, 9], 3, policy=pol)
    assert len(seen) == 2 and min(seen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # the caller's: generate must not unfreeze it
    try:
        frozen = gc.get_freeze_count()
        seen.clear()
        generate(llama, PROMPTS, 3, policy=pol, stop_on_eos=False)
        # not frozen again (that would add the objects made since) nor unfrozen (0); frozen objects may be freed
        assert len(seen) == 2 and 0 < min(seen) and max(seen) <= frozen and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_teacher_forced_logprobs_match_per_step_loop(llama4):
    llama = llama4
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    pol = make_policy("full")
    tokens, lengths = pad_prompts([seq[:4]])
    logits, state = pol.prefill(llama, tokens, lengths, bucket(len(seq), CAPACITY_BUCKET))
    want = []
    for t in range(4, len(seq)):
        row = np.asarray(logits[0], np.float64)
        want.append(row[seq[t]] - row.max() - np.log(np.exp(row - row.max()).sum()))
        if t + 1 < len(seq):
            logits, state = pol.decode_step(llama, state, jnp.asarray([seq[t]], jnp.int32))
    np.testing.assert_allclose(teacher_forced_logprobs(llama, seq, 4), want, rtol=1e-5, atol=1e-5)


# --- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(temperature=math.nan), "temperature must be 0"),
    (dict(temperature=-0.5), "temperature must be 0"),
    (dict(temperature=math.inf), "temperature must be 0"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(top_p=1.5), r"top_p must be in \[0, 1\]"),
    (dict(top_p=-0.1), r"top_p must be in \[0, 1\]"),
    (dict(top_p=math.nan), r"top_p must be in \[0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
])
def test_bad_sampling_parameters_refused(llama, kw, match):
    with pytest.raises(SamplingParameterError, match=match) as e:
        generate(llama, PROMPTS, 3, **kw)
    assert isinstance(e.value, KVOffloadError) and isinstance(e.value, ValueError)


def test_top_p_zero_is_greedy():
    logits = jax.random.normal(jax.random.key(0), (6, 50)) * 3
    best = np.argmax(np.asarray(logits), -1)
    for seed in range(3):
        np.testing.assert_array_equal(sample(logits, jax.random.key(seed), temperature=1.0, top_p=0.0), best)


@pytest.mark.parametrize("prompts, n, match", [
    ([[1, 1.7, 3]], 3, r"prompt 0 has token ids that are not integers: \[1.7\]"),
    ([[1, 2], [True, 3]], 3, r"prompt 1 has token ids that are not integers: \[True\]"),
    ([np.array([1.0, 2.0])], 3, r"prompt 0 must be a 1-D array of integer token ids, got dtype float64"),
    (["abc"], 3, r"prompt 0 must be a sequence of integer token ids, got str"),
    ([1, 2, 3], 3, r"prompts must be a list of token-id lists"),
    ([[1, -4]], 3, r"outside the vocabulary \(size 258\): \[-4\]"),
    ([[1, 2]], 2.5, r"max_new_tokens must be an integer >= 0, got 2.5"),
    ([[1, 2]], -1, r"max_new_tokens must be an integer >= 0, got -1"),
    ([[1, 2]], True, r"max_new_tokens must be an integer >= 0, got True"),
])
def test_bad_token_input_refused(llama, prompts, n, match):
    with pytest.raises(GenerationInputError, match=match):
        generate(llama, prompts, n)


def test_numpy_integer_prompts_accepted(llama):
    want = generate(llama, PROMPTS, 4)
    assert generate(llama, [np.asarray(p, np.int64) for p in PROMPTS], np.int32(4)) == want
    assert generate(llama, [[np.int32(t) for t in p] for p in PROMPTS], 4) == want


# --- non-finite logits ------------------------------------------------------------------------

def test_nan_weight_stops_at_prefill_naming_layer_and_tensor(llama4):
    # one prompt of the teacher-forced test's shapes, so the programs compiled there are reused
    prompt, params = [3, 1, 4, 1], llama4.params
    layers = list(params.layers)
    layers[2] = layers[2].__class__(**{**vars(layers[2]), "wq": jnp.full_like(layers[2].wq, jnp.nan)})
    model = Model(llama4.config, params.__class__(**{**vars(params), "layers": tuple(layers)}), llama4.tokenizer)
    seen = []
    with pytest.raises(NonFiniteLogitsError) as e:
        generate(model, [prompt], 6, on_token=lambda *a: seen.append(a))
    msg = str(e.value)
    assert "at step 0 (the prefill) for prompt 0" in msg
    assert "first turns non-finite at layer 2." in msg
    assert f"Non-finite weights: layers[2].wq ({layers[2].wq.size} of {layers[2].wq.size} values)." in msg
    assert seen == []  # no token was ever handed out
    with pytest.raises(NonFiniteLogitsError, match="at step 0"):
        generate(model, [prompt], 6, sync_every=64)
    with pytest.raises(NonFiniteLogitsError, match=r"at step 0 .*layer 2\."):
        teacher_forced_logprobs(model, prompt + [5, 9, 2, 6, 5, 3], 4)


class PoisonedAt(Counting):
    """Decode step `step` returns NaN logits for batch row `row`."""

    def __init__(self, step, row):
        super().__init__(make_policy("full"))
        self.poison_step, self.row = step, row

    def decode_step(self, model, state, tokens):
        logits, state = Counting.decode_step(self, model, state, tokens)
        return (logits.at[self.row].set(jnp.nan) if self.steps == self.poison_step else logits), state


@pytest.mark.parametrize("sync_every, stream", [(16, False), (2, False), (1, True)])
def test_nan_during_decoding_names_the_step_and_row(llama, sync_every, stream):
    seen = []
    with pytest.raises(NonFiniteLogitsError) as e:
        generate(llama, PROMPTS, 10, policy=PoisonedAt(3, 1), stop_on_eos=False, sync_every=sync_every,
                 on_token=(lambda s, t, d: seen.append(s)) if stream else None)
    msg = str(e.value)
    assert "at decode step 3 (the prefill is step 0) for prompt 1" in msg
    assert "prefill is finite in every layer" in msg and "Every weight is finite." in msg
    assert seen == ([0, 1, 2] if stream else [])  # step 3's tokens were never handed out


def test_nan_in_a_finished_row_is_ignored(eos_model):
    want = reference_generate(eos_model, PROMPTS, 12)[0]
    first_end = min(map(len, want))  # the row that ends first
    row = [len(o) for o in want].index(first_end)

    class PoisonFinished(Counting):  # NaN logits for the row from the step after its end token
        def decode_step(self, model, state, tokens):
            logits, state = Counting.decode_step(self, model, state, tokens)
            return (logits.at[row].set(jnp.nan) if self.steps >= first_end else logits), state

    assert generate(eos_model, PROMPTS, 12, policy=PoisonFinished(make_policy("full"))) == want


# --- streaming ----------------------------------------------------------------------------------

def test_on_token_streams_each_step(eos_model):
    want = reference_generate(eos_model, PROMPTS, 12)[0]
    calls = []
    got = generate(eos_model, PROMPTS, 12, on_token=lambda s, t, d: calls.append((s, t, d.copy())))
    assert got == want
    assert [c[0] for c in calls] == list(range(max(map(len, want))))
    for i, o in enumerate(want):
        streamed = [t[i] for _, t, d in calls if not d[i]]
        assert streamed == o  # done_mask hides exactly the tokens after a row's end


def test_text_streamer_holds_incomplete_characters_and_stops_at_end():
    tok = tiny_random_model("llama").tokenizer
    pieces = []
    s = TextStreamer(tok, pieces.append, end_ids=[257])
    ids = list("é€".encode()) + [257, 65]  # 2-byte and 3-byte characters, then the end token
    for step, t in enumerate(ids):
        s(step, [t], np.zeros(1, bool))
    s.finish()
    assert pieces == ["é", "€"]


def test_cli_stream_prints_same_text(tmp_path, capsys):
    model = tiny_random_model("llama", seed=4)
    save_converted(str(tmp_path / "m"), model.config, model.params, model.tokenizer)
    assert main(["generate", "ab", "--model", str(tmp_path / "m"), "--max-new-tokens", "6"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "ab", "--model", str(tmp_path / "m"), "--max-new-tokens", "6", "--stream"]) == 0
    assert capsys.readouterr().out == plain
    assert plain.startswith("ab") and len(plain) > 3


# --- compilations -------------------------------------------------------------------------------

def test_count_compilations_counts_new_shapes_only():
    f = jax.jit(lambda x: x * 2 + 1)
    a, b = jnp.ones(3), jnp.ones(4)
    with count_compilations() as c:
        f(a).block_until_ready()
        assert c.count == 1
        f(a).block_until_ready()
        assert c.count == 1
        f(b).block_until_ready()
        assert c.count == 2
    f(jnp.ones(5)).block_until_ready()
    assert c.count == 2 and c.names == ["jit(<lambda>)", "jit(<lambda>)"]


@pytest.mark.parametrize("policy", ["full", "offload", "kvpr"])
def test_decoding_compiles_nothing_new_as_the_context_grows(llama, policy):
    """A 200-token generation with 8-token blocks: the pool's tail is flushed every 8 steps and new
    extents come into use as it fills, yet after the first flush (step 8) no program compiles again."""
    snap = {}
    opts = dict(block_tokens=8, extent_mb=4 * 8 * 2 * 16 * 4 / 2**20)  # 4-block extents of the tiny llama
    if policy == "kvpr":
        opts["split_point"] = 16  # recompute the first extents every step (the tiny llama is GQA)
    with count_compilations() as c:
        pol = Counting(make_policy(policy, **opts), after_step=lambda s, _: snap.setdefault(s, c.count))
        out = generate(llama, [[1, 2, 3, 4], [5, 6]], 200, policy=pol, stop_on_eos=False)
    assert len(out[0]) == 200
    assert c.names[snap[20]:] == [], c.names[snap[20]:]
    # each step's programs compile once: the prompt is committed to the device, so the prefill's
    # outputs are committed like a step's and the second step does not compile again
    assert c.names.count("jit(_choose_tokens)") <= 1 and c.names.count("jit(layer_body)") <= 1


@pytest.mark.gpu
def test_gpu_sync_every_saves_host_round_trips():
    """OPT-6.7B shape (random weights, bf16), batch 64, prompt 512: per-step time of generate with a
    host read every step (the old loop's cost) against every 16 steps; same tokens, and no
    compilation after step 40. Prints both; the lead compares with the 13.5 / 10.6 ms measured."""
    import time

    from kvoffload.offload.bench import make_model

    model = make_model("opt-6.7b", jnp.bfloat16, offload_weights=False)
    prompts = np.random.default_rng(0).integers(4, model.config.vocab_size - 1, (64, 512)).tolist()
    n = 65

    def timed(new, **kw):
        t = time.perf_counter()
        out = generate(model, prompts, new, stop_on_eos=False, **kw)
        return out, time.perf_counter() - t

    for new in (1, n):  # compile everything once
        generate(model, prompts, new, stop_on_eos=False, sync_every=1)
    results = {}
    for sync_every in (1, 16):
        _, t1 = timed(1, sync_every=sync_every)
        out, tn = timed(n, sync_every=sync_every)
        results[sync_every] = (out, (tn - t1) / (n - 1) * 1e3)
    print(f"\nms/step: read every step {results[1][1]:.2f}, every 16 steps {results[16][1]:.2f}")
    assert results[1][0] == results[16][0]
    snap = {}
    with count_compilations() as c:
        pol = Counting(make_policy("full"), after_step=lambda s, _: snap.setdefault(s, c.count))
        generate(model, prompts[:8], 200, policy=pol, stop_on_eos=False)
    assert c.names[snap[80]:] == [], c.names[snap[80]:]  # after the first flush (64-token blocks)
