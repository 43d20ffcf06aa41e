"""The attention a retrieval keeps at its policy's budget, on a real-model RULER prompt (the embedded SmolLM2,
plain template, a generator seed no configuration was tuned on): Quest's pages at 10% of a 2K context (205
tokens) keep about two thirds of the exact attention, which lost RULER points; at 1024 tokens (clo's floor for
exact keys, half Quest's) they keep nearly all of it."""

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
