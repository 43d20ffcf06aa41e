"""Slow checks on the embedded SmolLM2-135M (pytest -m slow): the shipped head scores mean something."""

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SCORES = os.path.join(os.path.dirname(__file__), "..", "src", "kvoffload", "importance", "pretrained",
                      "smollm2_135m_instruct_head_scores.json")


def test_pretrained_scores_lowest_vs_highest_streaming():
    from kvoffload.importance import PasskeyData, highest_mask, load_scores, lowest_mask, passkey_accuracy
    from kvoffload.models import load_model

    model = load_model(None, quiet=True)
    alpha = load_scores(SCORES)
    meta = json.load(open(SCORES))
    assert alpha.shape == (model.config.num_layers, model.config.num_kv_heads)
    data = PasskeyData(model.tokenizer)
    kw = dict(num_samples=4, length=1024, sink=meta["sink"], recent=meta["recent"], start_index=100)
    low = passkey_accuracy(model, data, lowest_mask(alpha, 0.5), **kw)
    high = passkey_accuracy(model, data, highest_mask(alpha, 0.5), **kw)
    assert low["token_accuracy"] > high["token_accuracy"] + 0.3
    assert low["answer_logprob"] > high["answer_logprob"] + 2.0


def test_hata_training_beats_random_on_smollm2(tmp_path):
    from kvoffload.importance import HataConfig, train_hata
    from kvoffload.models import load_model

    model = load_model(None, quiet=True)
    res = train_hata(model, HataConfig(steps=30, num_prompts=2, eval_prompts=1, prompt_length=512,
                                       queries_per_prompt=16), quiet=True)
    assert res.recall_trained.mean() > res.recall_random.mean() + 0.05
    assert np.all(res.recall_trained > res.recall_random - 0.02)
