import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload.cli import main
from kvoffload.config import ModelConfig
from kvoffload.engine import generate
from kvoffload.models import load_model, save_converted, tiny_random_model
from kvoffload.models.sampling import sample

LLAMA = dict(model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, max_position_embeddings=64)


def test_rope_parameters_form_equals_classic():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    classic = ModelConfig.from_hf_dict(dict(LLAMA, rope_theta=5e5, rope_scaling=scaling))
    newer = ModelConfig.from_hf_dict(dict(LLAMA, rope_parameters=dict(scaling, rope_theta=5e5)))
    assert classic == newer
    assert classic.rope_type == "llama3" and classic.rope_theta == 5e5 and classic.rope_factor == 8.0


def test_rope_parameters_default():
    cfg = ModelConfig.from_hf_dict(dict(LLAMA, rope_parameters=dict(rope_type="default", rope_theta=1e4)))
    assert cfg.rope_type == "default" and cfg.rope_theta == 1e4


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_hf_dict(dict(LLAMA, rope_scaling=dict(rope_type="yarn", factor=4.0)))


def test_greedy_topk1_and_top_p_small_are_argmax():
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    best = np.argmax(np.asarray(logits), -1)
    key = jax.random.key(1)
    np.testing.assert_array_equal(sample(logits, key), best)
    np.testing.assert_array_equal(sample(logits, key, temperature=1.5, top_k=1), best)
    np.testing.assert_array_equal(sample(logits, key, temperature=1.5, top_p=1e-6), best)


def test_sampling_follows_distribution_and_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    draw = jax.vmap(lambda k: sample(logits, k, temperature=1.0))(keys)[:, 0]
    freq = np.bincount(np.asarray(draw), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    topk = np.asarray(jax.vmap(lambda k: sample(logits, k, temperature=1.0, top_k=2))(keys)[:, 0])
    assert set(np.unique(topk)) == {0, 1}
    # nucleus 0.7: {0.5, 0.3} reach it; 0.15 and 0.05 never drawn
    topp = np.asarray(jax.vmap(lambda k: sample(logits, k, temperature=1.0, top_p=0.7))(keys)[:, 0])
    assert set(np.unique(topp)) == {0, 1}
    assert abs(np.mean(topp == 0) - 0.5 / 0.8) < 0.03


def test_seeded_generation_reproducible():
    model = tiny_random_model("llama", seed=3)
    a = generate(model, [[1, 2, 3]], 8, temperature=1.0, top_p=0.9, seed=7, stop_on_eos=False)
    b = generate(model, [[1, 2, 3]], 8, temperature=1.0, top_p=0.9, seed=7, stop_on_eos=False)
    c = generate(model, [[1, 2, 3]], 8, temperature=1.0, top_p=0.9, seed=8, stop_on_eos=False)
    assert a == b and a != c


def test_converted_checkpoint_roundtrip(tmp_path):
    model = tiny_random_model("opt", seed=2)
    save_converted(str(tmp_path / "conv"), model.config, model.params, model.tokenizer)
    back = load_model(str(tmp_path / "conv"), quiet=True)
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.tokenizer.encode("héllo") == model.tokenizer.encode("héllo")


def test_cli_convert_and_generate(tmp_path, capsys):
    model = tiny_random_model("llama", seed=4)
    src = tmp_path / "src"
    save_converted(str(src), model.config, model.params, model.tokenizer)
    assert main(["convert", str(src), str(tmp_path / "dst"), "--dtype", "bfloat16"]) == 0
    assert load_model(str(tmp_path / "dst"), "bfloat16", quiet=True).params.embed.dtype == jnp.bfloat16
    assert main(["generate", "ab", "--model", str(src), "--max-new-tokens", "4"]) == 0
    expected = model.tokenizer.decode(generate(model, [model.tokenizer.encode("ab")], 4)[0])
    assert capsys.readouterr().out == "ab" + expected + "\n"


def test_cli_rejects_long_prompt(tmp_path, capsys):
    model = tiny_random_model("llama", max_position_embeddings=32)
    save_converted(str(tmp_path / "m"), model.config, model.params, model.tokenizer)
    assert main(["generate", "x" * 40, "--model", str(tmp_path / "m")]) == 2
    assert "needs 73 positions but the model allows 32" in capsys.readouterr().err


def test_check_sampling_normalizes_numpy_scalars_and_refuses_bools():
    from kvoffload.models.sampling import SamplingParameterError, check_sampling

    t, k, p = check_sampling(np.float32(0.5), np.int64(5), 1)
    assert (t, k, p) == (0.5, 5, 1.0) and type(k) is int and type(p) is float
    with pytest.raises(SamplingParameterError, match=r"top_k must be an integer >= 0 \(0 = no top-k filter\), got True"):
        check_sampling(1.0, True, 1.0)
    with pytest.raises(SamplingParameterError, match="temperature must be a number, got None"):
        check_sampling(None, 0, 1.0)
