"""OPT's learned position table is read only at real positions: a table size that is not a multiple of
the prompt bucket (500 here; prompts pad to 512) must not put NaN into any policy's output."""

import numpy as np
import pytest

from kvoffload.engine import generate
from kvoffload.models import tiny_random_model
from kvoffload.policies import available_policies


@pytest.fixture(scope="module")
def opt500():
    return tiny_random_model("opt", max_position_embeddings=500)


@pytest.mark.parametrize("prompt_len", [475])
def test_opt_prompt_near_position_limit_is_finite_under_every_policy(opt500, prompt_len):
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, 256, prompt_len).tolist()
    want, want_logits = generate(opt500, [prompt], 4, policy="full", return_logits=True)
    assert np.isfinite(want_logits).all()
    for name in available_policies():
        got, logits = generate(opt500, [prompt], 4, policy=name, return_logits=True)
        assert np.isfinite(logits).all(), name
        assert got == want, name
