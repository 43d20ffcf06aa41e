"""TokenSelect length extrapolation: over-long prompts refused without the option,
run with it, every RoPE position inside the trained window, and the same tokens as without it inside
the window with the budget at the whole context."""

import numpy as np
import pytest

from kvoffload import engine
from kvoffload.engine import GenerationInputError, generate
from kvoffload.models import tiny_random_model
from kvoffload.policies import make_policy
from kvoffload.policies.extrapolation import ExtrapolationError
from kvoffload.policies.tokenselect import TokenSelectOptionError

MAX_POS = 64
OPTS = dict(extrapolate=True, token_budget=48, num_sink=4, num_recent=8, prefill_chunk=16)


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", max_position_embeddings=MAX_POS)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def test_over_long_prompt_refused_without_the_option(model):
    for policy, opts in [("tokenselect", {"token_budget": 16, "num_recent": 8}), ("full", None)]:
        with pytest.raises(GenerationInputError, match="the model allows 64"):
            generate(model, [prompt(100)], 4, policy=policy, policy_options=opts)


def test_extrapolation_runs_and_keeps_positions_inside_the_window(model, monkeypatch):
    pol = make_policy("tokenselect", **OPTS)
    seen = []
    real_prefill = pol.prefill

    def spy_prefill(*a):  # the state records the largest position fed to RoPE
        logits, state = real_prefill(*a)
        seen.append(int(state.max_position))
        return logits, state

    monkeypatch.setattr(pol, "prefill", spy_prefill)
    real_step = pol.decode_step

    def spy_step(m, state, tokens):
        logits, state = real_step(m, state, tokens)
        seen.append(int(state.max_position))
        return logits, state

    monkeypatch.setattr(pol, "decode_step", spy_step)
    prompts = [prompt(150, 1), prompt(97, 2)]  # over 64 positions, two lengths in one batch
    out = generate(model, prompts, 12, policy=pol, stop_on_eos=False)
    assert [len(o) for o in out] == [12, 12]
    assert len(seen) == 12  # the prefill and 11 steps
    assert max(seen) == OPTS["token_budget"] - 1 < MAX_POS  # the selection is full: ranks 0..budget-1
    assert all(0 <= t < model.config.vocab_size for o in out for t in o)


@pytest.mark.slow  # 25 s un-jitted; the recorded max_position is checked by default
def test_rope_positions_spy(model, monkeypatch):
    """Every position array given to rope_cos_sin while tracing stays below the trained window."""
    import jax
    from kvoffload.policies import extrapolation as ex

    bounds = []
    real = ex.rope_cos_sin

    def spy(cfg, positions):
        bounds.append(positions)
        return real(cfg, positions)

    monkeypatch.setattr(ex, "rope_cos_sin", spy)
    pol = make_policy("tokenselect", **{**OPTS, "token_budget": 40})
    # run eagerly (no jit) so the positions are concrete values
    with jax.disable_jit():
        tokens, lengths = engine.pad_prompts([prompt(75, 3)])
        logits, state = pol.prefill(model, tokens, np.asarray([75], np.int32), 128)
        logits, state = pol.decode_step(model, state, np.argmax(np.asarray(logits), -1))
    concrete = [int(np.max(np.asarray(p))) for p in bounds]
    assert concrete and max(concrete) < 40 <= MAX_POS
    assert max(concrete) >= 39 - 1  # the chunk next to a full selection reaches the budget's top


@pytest.mark.slow  # slow only, both sizes
@pytest.mark.parametrize("n,new", [(20, 10), (40, 8)])
def test_inside_the_window_same_tokens_as_without(model, n, new):
    budget = 48 + 16  # the whole context (n + new <= 64) and room for a chunk
    opts = dict(token_budget=budget, num_sink=4, num_recent=8)
    ps = [prompt(n, 5), prompt(n - 7, 6)]
    want = generate(model, ps, new, policy="tokenselect", policy_options=opts, stop_on_eos=False)
    full = generate(model, ps, new, policy="full", stop_on_eos=False)
    got = generate(model, ps, new, policy="tokenselect", policy_options={**opts, "extrapolate": True,
                                                                         "prefill_chunk": 16}, stop_on_eos=False)
    assert got == want == full


@pytest.mark.slow  # keeps the default suite under 10 min
def test_small_budget_changes_what_is_attended(model):
    """Past the budget the selection is a strict subset: the logits differ from full attention's."""
    p = [prompt(60, 7)]
    _, full = generate(model, p, 3, policy="full", return_logits=True, stop_on_eos=False)
    _, sel = generate(model, p, 3, policy="tokenselect", policy_options={**OPTS, "token_budget": 28},
                      return_logits=True, stop_on_eos=False)
    assert not np.allclose(full, sel, atol=1e-3)


def test_refusals(model):
    opt = tiny_random_model("opt", max_position_embeddings=MAX_POS)
    with pytest.raises(ExtrapolationError, match="learned absolute positions"):
        generate(opt, [prompt(100)], 2, policy="tokenselect", policy_options=OPTS)
    with pytest.raises(ExtrapolationError, match="max_position_embeddings"):
        generate(model, [prompt(100)], 2, policy="tokenselect", policy_options={**OPTS, "token_budget": 80})
    with pytest.raises(TokenSelectOptionError, match="kv=gpu"):
        make_policy("tokenselect", **{**OPTS, "kv": "split"})
    with pytest.raises(TokenSelectOptionError, match="prefill_chunk"):
        make_policy("tokenselect", **{**OPTS, "prefill_chunk": 40})
    with pytest.raises(TokenSelectOptionError, match="true or false"):
        make_policy("tokenselect", extrapolate="maybe")
