"""The attention a retrieval keeps at its policy's budget, on a real-model RULER prompt (the embedded SmolLM2,
plain template, a generator seed no configuration was tuned on): Quest's pages at 10% of a 2K context (205
tokens) keep about two thirds of the exact attention, which lost RULER points; at 1024 tokens (clo's floor for
exact keys, half Quest's) they keep nearly all of it. The real model's tests load SmolLM2 and prefill 2K tokens
(~30 s): slow; the default run checks the measurement itself on a tiny model."""

import numpy as np
import pytest

from kvoffload.eval.selection_recall import RetrievalSpec, selection_recall
from kvoffload.policies.clo import TOPK_MIN


@pytest.fixture(scope="module")
def smollm():
    from kvoffload.models import load_model

    return load_model(None, quiet=True)


@pytest.fixture(scope="module")
def prompt(smollm):
    from kvoffload.eval import ruler

    plain = ruler.ChatWrapper.from_tokenizer(smollm.tokenizer, False)
    return ruler.generate_samples(smollm.tokenizer, "niah_single_2", 2048, 1, seed=7, chat=plain)[0].prompt_ids


def test_selection_mass_on_a_tiny_model():
    """The measurement on a tiny random model (512 tokens, 8 blocks of 64): a floor above the context selects
    every token (mass 1 in every layer); at 10% the exact top-k and Quest's pages each keep a share of it, below
    1, in every layer."""
    from kvoffload.models import tiny_random_model

    model = tiny_random_model("llama", seed=1, max_position_embeddings=2048)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 512).tolist()
    specs = [RetrievalSpec("exact", token_min=4096), RetrievalSpec("exact", num_recent=16),
             RetrievalSpec("quest", num_recent=16)]
    got = selection_recall(model, [prompt], specs)
    every, tenth, quest = (got[s.label] for s in specs)
    np.testing.assert_allclose(every["per_layer"], 1.0, rtol=1e-5)
    assert every["below_half"] == 0.0 and len(tenth["per_layer"]) == model.config.num_layers
    assert 0 < tenth["mass"] < 0.99 and 0 < quest["mass"] < 0.99 and 0 <= quest["below_half"] <= 1


@pytest.mark.slow  # ~30 s: SmolLM2 loaded, a 2K prompt prefilled
def test_quest_keeps_the_attention_at_clo_default_budget_not_at_a_bare_ratio(smollm, prompt):
    specs = [RetrievalSpec("exact"), RetrievalSpec("quest"), RetrievalSpec("quest", token_min=TOPK_MIN["exact"])]
    got = selection_recall(smollm, [prompt], specs)
    exact, bare, floored = (got[s.label] for s in specs)
    assert bare["mass"] < 0.75 and bare["below_half"] > 0.15  # 10% of 2K: Quest's pages miss much of it
    assert exact["mass"] > bare["mass"] + 0.1  # the exact top-k at the same budget keeps more
    assert floored["mass"] > 0.95 and floored["below_half"] == 0.0
    assert np.min(floored["per_layer"]) > 0.85  # no layer loses much, layer 0 (attended whole by clo) included


@pytest.mark.slow
def test_hata_random_projections_at_the_floor(smollm, prompt):
    specs = [RetrievalSpec("hata"), RetrievalSpec("hata", token_min=TOPK_MIN["exact"])]
    bare, floored = (selection_recall(smollm, [prompt], specs)[s.label] for s in specs)
    assert floored["mass"] > 0.95 > bare["mass"]


def test_a_vote_over_quantized_keys_keeps_the_exact_votes_selection_on_a_tiny_model():
    """On a tiny random model the vote over int8 keys selects nearly what the exact vote selects, int4 less;
    the exact vote against itself keeps everything (the measurement's own check)."""
    from kvoffload.eval.selection_recall import topk_recall
    from kvoffload.models import tiny_random_model

    model = tiny_random_model("llama", seed=1, max_position_embeddings=2048)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 512).tolist()
    exact = RetrievalSpec("vote", num_recent=16)
    same, int8, int4 = (topk_recall(model, [prompt], RetrievalSpec("vote", num_recent=16, vote_keys=f), exact)
                        for f in ("native", "int8", "int4"))
    assert same["recall"] == 1.0 and same["min"] == 1.0
    assert int8["recall"] > 0.95 and int8["min"] > 0.85
    assert 0.6 < int4["recall"] < int8["recall"]
    assert len(int8["per_layer"]) == model.config.num_layers


@pytest.mark.slow  # SmolLM2 loaded, 2K and 4K prompts prefilled in both templates
def test_the_vote_over_int8_keys_keeps_the_exact_votes_top_k_on_real_prompts(smollm):
    from kvoffload.eval import ruler
    from kvoffload.eval.selection_recall import topk_recall

    prompts = []
    for chat in (False, True):
        wrap = ruler.ChatWrapper.from_tokenizer(smollm.tokenizer, chat)
        for task, n in (("niah_single_2", 2048), ("niah_multikey_2", 4096)):
            prompts.append(ruler.generate_samples(smollm.tokenizer, task, n, 1, seed=7, chat=wrap)[0].prompt_ids)
    for ratio, floor in ((0.1, 0), (0.1, 1024)):
        exact = RetrievalSpec("vote", ratio=ratio, token_min=floor)
        got = {f: topk_recall(smollm, prompts, RetrievalSpec("vote", ratio=ratio, token_min=floor, vote_keys=f),
                              exact) for f in ("int8", "int4")}
        print(ratio, floor, {f: (round(g["recall"], 4), round(g["min"], 4)) for f, g in got.items()})
        assert got["int8"]["recall"] > 0.98 and got["int8"]["min"] > 0.9
        assert got["int4"]["recall"] > 0.85
