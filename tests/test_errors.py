"""Bad input gets one clear error that names the problem (file, tensor, lengths)."""

import json
import shutil
import sys

import numpy as np
import pytest

from kvoffload.config import ModelConfig, UnsupportedModelError
from kvoffload.engine import generate
from kvoffload.models import CheckpointError, load_model, tiny_random_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def copy(hf_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_dir, dst)
    return dst


def test_unknown_architecture_names_supported():
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supports.*llama.*opt"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="model not found: /nonexistent/model"):
        load_model("/nonexistent/model", quiet=True)


def test_corrupt_config(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"corrupt model config .*config.json"):
        load_model(str(d), quiet=True)


def test_no_weights(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights found.*model.safetensors"):
        load_model(str(d), quiet=True)


def test_truncated_safetensors(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* truncated or corrupt"):
        load_model(str(d), quiet=True)


def test_garbage_safetensors_header(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-json")
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt safetensors header"):
        load_model(str(d), quiet=True)


def test_missing_tensor(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors for llama: layers.1.w_up"):
        load_model(str(d), quiet=True)


def test_misshaped_tensor(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.k_proj.weight"] = np.ones((8, 32), np.float32)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.0.self_attn.k_proj.weight has shape \(32, 8\), expected \(16, 32\)"):
        load_model(str(d), quiet=True)


def test_missing_shard(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002.safetensors is missing"):
        load_model(str(d), quiet=True)


def test_bin_without_torch(hf_dir, tmp_path, monkeypatch):
    d = copy(hf_dir, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: reading pytorch_model.bin needs torch"):
        load_model(str(d), quiet=True)


def test_corrupt_bin(hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: corrupt pytorch checkpoint"):
        load_model(str(d), quiet=True)


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(CheckpointError, match=r"broken.gguf: corrupt or unreadable GGUF file"):
        load_model(str(f), quiet=True)


def test_prompt_longer_than_positions():
    model = tiny_random_model("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"prompt 0 has 60 tokens; with max_new_tokens=10 it needs 70 positions but the model allows 64"):
        generate(model, [[1] * 60], 10)


def test_token_outside_vocab():
    model = tiny_random_model("opt")
    with pytest.raises(ValueError, match=r"outside the vocabulary \(size 258\): \[999\]"):
        generate(model, [[1, 999]], 2)


def test_unknown_policy():
    model = tiny_random_model("llama")
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; available: .*full"):
        generate(model, [[1, 2]], 2, policy="nope")
