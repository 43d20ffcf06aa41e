"""Checkpoint conversion: HF safetensors (single or sharded), pytorch_model.bin, GGUF -> parameter
pytrees, and orbax save/restore of converted parameters.

Every HF or GGUF tensor name maps through one key map per family to a slot in the parameter pytree;
tensors are converted one at a time so host memory stays near the model size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import sys
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvoffload.config import ModelConfig, UnsupportedModelError
from kvoffload.errors import KVOffloadError
from kvoffload.paths import check_output_dir


class CheckpointError(KVOffloadError, ValueError):
    """A missing, corrupt or mismatched checkpoint; the message names the file and tensor."""


# ----------------------------------------------------------------------------- key maps
# Each entry: HF suffix pattern -> (field, transform). Layer entries use "layers.{i}." prefixes.
_ATTENTION_PROJ = {  # the LLaMA family's and Gemma 3's attention projections
    "self_attn.q_proj.weight": ("wq", "T"),
    "self_attn.k_proj.weight": ("wk", "T"),
    "self_attn.v_proj.weight": ("wv", "T"),
    "self_attn.o_proj.weight": ("wo", "T"),
    "self_attn.q_proj.bias": ("bq", "id"),
    "self_attn.k_proj.bias": ("bk", "id"),
    "self_attn.v_proj.bias": ("bv", "id"),
    "self_attn.o_proj.bias": ("bo", "id"),
}
_GATED_MLP = {
    "mlp.gate_proj.weight": ("w_gate", "T"),
    "mlp.up_proj.weight": ("w_up", "T"),
    "mlp.down_proj.weight": ("w_down", "T"),
}
_LLAMA_LAYER = {
    "input_layernorm.weight": ("attn_norm", "id"),
    **_ATTENTION_PROJ,
    "post_attention_layernorm.weight": ("mlp_norm", "id"),
    **_GATED_MLP,
    "mlp.gate_proj.bias": ("b_gate", "id"),
    "mlp.up_proj.bias": ("b_up", "id"),
    "mlp.down_proj.bias": ("b_down", "id"),
}
_LLAMA_TOP = {
    "embed_tokens.weight": ("embed", "id"),
    "norm.weight": ("final_norm", "id"),
    "lm_head.weight": ("lm_head", "T"),
}
_OPT_LAYER = {
    "self_attn_layer_norm.weight": ("attn_ln_w", "id"),
    "self_attn_layer_norm.bias": ("attn_ln_b", "id"),
    "self_attn.q_proj.weight": ("wq", "T"),
    "self_attn.q_proj.bias": ("bq", "id"),
    "self_attn.k_proj.weight": ("wk", "T"),
    "self_attn.k_proj.bias": ("bk", "id"),
    "self_attn.v_proj.weight": ("wv", "T"),
    "self_attn.v_proj.bias": ("bv", "id"),
    "self_attn.out_proj.weight": ("wo", "T"),
    "self_attn.out_proj.bias": ("bo", "id"),
    "final_layer_norm.weight": ("mlp_ln_w", "id"),
    "final_layer_norm.bias": ("mlp_ln_b", "id"),
    "fc1.weight": ("fc1", "T"),
    "fc1.bias": ("b1", "id"),
    "fc2.weight": ("fc2", "T"),
    "fc2.bias": ("b2", "id"),
}
_OPT_TOP = {
    "embed_tokens.weight": ("embed", "id"),
    "embed_positions.weight": ("pos_embed", "id"),
    "final_layer_norm.weight": ("final_ln_w", "id"),
    "final_layer_norm.bias": ("final_ln_b", "id"),
    "project_in.weight": ("project_in", "T"),
    "project_out.weight": ("project_out", "T"),
}
_GEMMA3_LAYER = {
    "input_layernorm.weight": ("attn_norm", "id"),
    **_ATTENTION_PROJ,
    "self_attn.q_norm.weight": ("q_norm", "id"),
    "self_attn.k_norm.weight": ("k_norm", "id"),
    "post_attention_layernorm.weight": ("post_attn_norm", "id"),
    "pre_feedforward_layernorm.weight": ("mlp_norm", "id"),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", "id"),
    **_GATED_MLP,
}
_KEY_MAPS = {"llama": (_LLAMA_LAYER, _LLAMA_TOP), "opt": (_OPT_LAYER, _OPT_TOP), "gemma3": (_GEMMA3_LAYER, _LLAMA_TOP)}
_PREFIXES = ("model.decoder.", "decoder.", "model.", "")


def hf_key_map(cfg: ModelConfig, name: str):
    """HF tensor name -> (layer index or None, field, transform) or None for tensors we ignore."""
    layer_map, top_map = _KEY_MAPS[cfg.family]
    if name == "lm_head.weight":
        return None if cfg.family == "opt" or cfg.tie_word_embeddings else (None, "lm_head", "T")
    for prefix in _PREFIXES:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        m = re.match(r"layers\.(\d+)\.(.+)$", rest)
        if m and m.group(2) in layer_map:
            return (int(m.group(1)),) + layer_map[m.group(2)]
        if rest in top_map and rest != "lm_head.weight":
            return (None,) + top_map[rest]
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return None




def check_finite(arr, what: str):
    """Refuses a tensor holding NaN or infinity (a damaged file decodes to them), naming it."""
    arr = np.asarray(arr)
    if arr.dtype.kind == "f" or arr.dtype == ml_dtypes.bfloat16:
        finite = np.isfinite(arr)
        if not finite.all():
            bad = int(arr.size - np.count_nonzero(finite))
            raise CheckpointError(f"{what} holds {bad} non-finite value(s) (NaN or infinity): the file is damaged")


def expected_shapes(cfg: ModelConfig):
    """The parameter pytree of this config with jax.ShapeDtypeStruct leaves (float32)."""
    from kvoffload.models.transformer import init_params

    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.float32))


def assemble_params(cfg: ModelConfig, tensors: Iterator[tuple[str, str, Any]], dtype, source: str):
    """Builds the parameter pytree from (name, slot, file, array) items produced in any order;
    slot is (layer index or None, field, "T" to transpose or "id") or None to skip the tensor.

    Checks every slot is filled exactly once with the expected shape; returns the pytree with
    leaves as jax arrays of `dtype`.
    """
    expect = expected_shapes(cfg)
    top: dict[str, Any] = {}
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    for name, slot, file, arr in tensors:
        if slot is None:
            continue
        layer, field, transform = slot
        if layer is not None and layer >= cfg.num_layers:
            raise CheckpointError(f"{file}: tensor {name} is for layer {layer}, but the config has {cfg.num_layers} layers")
        arr = np.asarray(arr)
        if transform == "T":
            arr = arr.T
        want = getattr(expect.layers[layer] if layer is not None else expect, field)
        if want is None:
            raise CheckpointError(f"{file}: unexpected tensor {name} (the config does not use {field})")
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{file}: tensor {name} has shape {tuple(np.asarray(arr).shape)}, expected "
                f"{tuple(want.shape) if transform == 'id' else tuple(reversed(want.shape))} for {cfg.model_type}"
            )
        check_finite(arr, f"{file}: tensor {name}")
        val = jnp.asarray(arr.astype(np.float32) if arr.dtype != np.float32 and dtype == jnp.float32 else arr, dtype=dtype)
        (layers[layer] if layer is not None else top)[field] = val
    missing = []
    is_tensor = lambda want: isinstance(want, jax.ShapeDtypeStruct)  # noqa: E731 (not None, not a static field)
    for f, want in vars(expect).items():
        if f != "layers" and is_tensor(want) and f not in top:
            missing.append(f)
    for i in range(cfg.num_layers):
        for f, want in vars(expect.layers[i]).items():
            if is_tensor(want) and f not in layers[i]:
                missing.append(f"layers.{i}.{f}")
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: missing tensors for {cfg.model_type}: {shown}")
    # the expected tree's dataclasses with the tensors in place (static fields, e.g. a layer's kind, kept)
    return dataclasses.replace(expect, **top, layers=tuple(dataclasses.replace(e, **d)
                                                           for e, d in zip(expect.layers, layers)))


# ----------------------------------------------------------------------------- safetensors
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def iter_safetensors(path: str):
    """Yields (name, path, array) from one safetensors file, memory-mapped (no full read)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors file (header length {n}, file size {size})")
            header = json.loads(f.read(n))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    for name, info in header.items():
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end > mm.shape[0] or end - start != int(np.prod(shape)) * np.dtype(dt).itemsize:
            raise CheckpointError(f"{path}: tensor {name} is truncated or corrupt (data_offsets {start}..{end})")
        yield name, path, mm[start:end].view(dt).reshape(shape)


def iter_torch_bin(path: str):
    try:
        import torch
    except ImportError as e:
        raise CheckpointError(
            f"{path}: reading pytorch_model.bin needs torch; install it (pip install torch) or convert "
            "the checkpoint to safetensors"
        ) from e
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for corrupt pickles
        raise CheckpointError(f"{path}: corrupt pytorch checkpoint ({type(e).__name__}: {e})") from e
    for name in list(sd):
        t = sd.pop(name)
        yield name, path, t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def hf_weight_files(directory: str) -> list[str]:
    """The weight files of an HF checkpoint directory, sharded (index json) or single."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = os.path.join(directory, index_name)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: corrupt index file ({e})") from e
            files = sorted(set(weight_map.values()))
            paths = [os.path.join(directory, x) for x in files]
            for p in paths:
                if not os.path.exists(p):
                    raise CheckpointError(f"{index}: shard {os.path.basename(p)} is missing")
            return paths
        if os.path.exists(os.path.join(directory, single)):
            return [os.path.join(directory, single)]
    raise CheckpointError(
        f"{directory}: no weights found (expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json)"
    )


def load_hf_params(directory: str, cfg: ModelConfig, dtype=jnp.float32, progress: Callable[[int, int], None] | None = None):
    files = hf_weight_files(directory)

    def tensors():
        for i, p in enumerate(files):
            for name, file, arr in iter_torch_bin(p) if p.endswith(".bin") else iter_safetensors(p):
                yield name, hf_key_map(cfg, name), file, arr
            if progress:
                progress(i + 1, len(files))

    return assemble_params(cfg, tensors(), dtype, directory)


# ----------------------------------------------------------------------------- GGUF
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
}
_GGUF_TOP = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row permutation of q/k projections (rows = output features):
    llama.cpp interleaves the two RoPE halves; HF keeps them split."""
    rows = w.shape[0]
    # llama.cpp's convert did reshape(n_heads, 2, half, ...).swapaxes(1, 2); this is its inverse
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(path: str):
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise CheckpointError("reading GGUF files needs the `gguf` package (pip install gguf)") from e
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        return GGUFReader(path)
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt or unreadable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


_GGUF_GEMMA3_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm", "ffn_norm.weight": "mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
GGUF_ARCHITECTURES = ("llama", "gemma3")


def gguf_gemma3_config(reader, path: str) -> ModelConfig:
    """A gemma3 GGUF's config. What llama.cpp's gemma3 loader takes as given where the file is silent: every
    6th layer global (a `attention.sliding_window_pattern` key, where present, overrides), the sliding layers'
    RoPE base 10000, and the attention scale head_dim ** -0.5 (hidden / heads for the 62-layer 27B)."""
    a = "gemma3."
    n_layers = int(_field(reader, a + "block_count"))
    n_heads = int(_field(reader, a + "attention.head_count"))
    hidden = int(_field(reader, a + "embedding_length"))
    head_dim = int(_field(reader, a + "attention.key_length", hidden // n_heads))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, a + "vocab_size") or len(_field(reader, "tokenizer.ggml.tokens") or [])
    pattern = _field(reader, a + "attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):  # per layer: true where sliding
        types = ["sliding_attention" if bool(x) else "full_attention" for x in pattern]
    else:
        p = int(pattern or 6)
        types = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n_layers)]
    d = {
        "model_type": "gemma3_text",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, a + "context_length")),
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, a + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(_field(reader, a + "rope.freq_base_swa", 10000.0)),
        "sliding_window": int(_field(reader, a + "attention.sliding_window", 0)),
        "layer_types": types,
        "query_pre_attn_scalar": hidden / n_heads if n_layers == 62 else head_dim,
        "final_logit_softcapping": _field(reader, a + "final_logit_softcapping"),
        "attn_logit_softcapping": _field(reader, a + "attn_logit_softcapping"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    stype = _field(reader, a + "rope.scaling.type")
    if stype == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, a + "rope.scaling.factor"))}
    elif stype not in (None, "none"):
        raise UnsupportedModelError(f"{path}: GGUF rope scaling {stype!r} is not supported")
    return ModelConfig.from_hf_dict(d)


def gguf_config(reader, path: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch == "gemma3":
        return gguf_gemma3_config(reader, path)
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported {GGUF_ARCHITECTURES}")
    a = "llama."
    n_heads = int(_field(reader, a + "attention.head_count"))
    hidden = int(_field(reader, a + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, a + "vocab_size") or len(_field(reader, "tokenizer.ggml.tokens") or [])
    d = {
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, a + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", n_heads)),
        "head_dim": int(_field(reader, a + "rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": int(_field(reader, a + "context_length")),
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, a + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if "blk.0.attn_q.bias" in names:
        d["model_type"] = "qwen2"
    stype = _field(reader, a + "rope.scaling.type")
    if stype in ("linear",):
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, a + "rope.scaling.factor"))}
    elif stype not in (None, "none"):
        raise UnsupportedModelError(f"{path}: GGUF rope scaling {stype!r} is not supported")
    return ModelConfig.from_hf_dict(d, f"{path} (GGUF metadata)")


def load_gguf(path: str, dtype=jnp.float32, progress: Callable[[int, int], None] | None = None):
    """Returns (config, params, reader). Quantized tensors are dequantized with the gguf package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    cfg = gguf_config(reader, path)

    gemma = cfg.family == "gemma3"
    layer_map = _GGUF_GEMMA3_LAYER if gemma else _GGUF_LAYER

    def tensors():
        n = len(reader.tensors)
        for i, t in enumerate(reader.tensors):
            m = re.match(r"blk\.(\d+)\.(.+)$", t.name)
            if m:
                layer, field = int(m.group(1)), layer_map.get(m.group(2))
            else:
                layer, field = None, _GGUF_TOP.get(t.name)
            if field is None:
                continue
            try:
                if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                    arr = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed([int(x) for x in t.shape])))
                else:
                    arr = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot dequantize tensor {t.name} ({type(e).__name__}: {e})") from e
            if gemma:  # NEOX RoPE (no q/k permutation); llama.cpp stores Gemma's norm weights as 1 + weight
                if t.name.endswith("norm.weight"):
                    arr = np.asarray(arr, np.float32) - 1.0
            elif field == "wq":
                arr = unpermute_qk(arr, cfg.num_heads)
            elif field == "wk":
                arr = unpermute_qk(arr, cfg.num_kv_heads)
            transform = "id" if arr.ndim == 1 or field == "embed" else "T"
            yield t.name, (layer, field, transform), path, arr
            if progress:
                progress(i + 1, n)

    return cfg, assemble_params(cfg, tensors(), dtype, path), reader


# ----------------------------------------------------------------------------- orbax
CONVERTED_MARKER = "kvoffload.json"  # written last: its presence means the conversion finished
INCOMPLETE_MARKER = "kvoffload.incomplete"  # written first, removed last: a conversion under way or cut
# what save_converted wrote before its marker listed the files (format 2): all that --overwrite may remove there
_LEGACY_ENTRIES = ("params/", "tokenizer.json", "tokenizer_meta.json")
_FORMAT = 3  # 3: the marker's "files" is the manifest of what the conversion wrote (2: every file in the folder)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_digests(directory: str) -> dict[str, str]:
    """sha256 of every file under directory except the markers, by path relative to it (the manifest of a
    conversion written into a folder of its own)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, directory)
            if rel not in (CONVERTED_MARKER, INCOMPLETE_MARKER):
                out[rel] = _sha256(p)
    return dict(sorted(out.items()))


def _written_files(directory: str) -> list[str]:
    """The files an earlier conversion into directory wrote (and --overwrite replaces): its marker's manifest
    (format 3), or, for an older marker or a cut conversion, its files under params/ and the tokenizer's.
    Other files (a user's notes) are never among them."""
    for marker in (CONVERTED_MARKER, INCOMPLETE_MARKER):
        try:
            with open(os.path.join(directory, marker)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("format") == _FORMAT and isinstance(meta.get("files"), (dict, list)):
            return sorted(meta["files"])
    held = [os.path.relpath(os.path.join(r, n), directory) for r, _, fs in os.walk(directory) for n in fs]
    return sorted(rel for rel in held if rel.startswith(_LEGACY_ENTRIES[0]) or rel in _LEGACY_ENTRIES[1:])


def converted_state(directory: str) -> str | None:
    """'complete', 'incomplete' (a conversion was cut or is under way) or None (not a converted dir)."""
    if os.path.exists(os.path.join(directory, CONVERTED_MARKER)):
        return "complete"
    if os.path.exists(os.path.join(directory, INCOMPLETE_MARKER)):
        return "incomplete"
    return None


def incomplete_error(directory: str) -> CheckpointError:
    source = None
    try:
        with open(os.path.join(directory, INCOMPLETE_MARKER)) as f:
            source = json.load(f).get("source")
    except (OSError, ValueError, AttributeError):
        pass
    return CheckpointError(
        f"{directory}: the conversion into this directory did not finish (it was interrupted); convert again "
        f"with `kvoffload convert {source or 'SRC'} {directory} --overwrite`")


def check_destination(directory: str, overwrite: bool = False):
    """Refuses, before any work, a destination that cannot be written or whose files would be lost:
    a non-empty directory that is not a kvoffload checkpoint, or one that is unless overwrite."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: exists and is not a directory; choose a new or empty directory")
        entries = sorted(os.listdir(directory))
        if entries and converted_state(directory) is None:
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise CheckpointError(f"{directory}: not empty ({shown}) and not a kvoffload checkpoint; its files "
                                  "would be lost: choose a new or empty directory")
        if entries and not overwrite:
            raise CheckpointError(f"{directory}: already holds a kvoffload checkpoint; pass --overwrite "
                                  "(overwrite=True) to replace it")
    # a path under a file, a read-only or virtual file system (/sys) fails here, before minutes of loading
    check_output_dir(directory, error=CheckpointError)


def _remove_files(directory: str, rels):
    """Removes these files (relative paths) and the folders they leave empty; nothing else."""
    for rel in rels:
        p = os.path.join(directory, rel)
        if os.path.isfile(p) or os.path.islink(p):
            os.remove(p)
        d = os.path.dirname(p)
        while d != directory and os.path.isdir(d) and not os.listdir(d):
            os.rmdir(d)
            d = os.path.dirname(d)


def _write_json_atomically(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_converted(directory: str, cfg: ModelConfig, params, tokenizer=None, *, overwrite: bool = False,
                   source: str | None = None):
    """Writes an orbax checkpoint of params plus the config (and tokenizer) beside it.

    Everything is written first into a folder beside the destination (same file system), then moved in by
    renames: a full disk or an error while writing leaves the destination as it was (a previous checkpoint
    intact). The marker (kvoffload.json, written last) holds the manifest of the files written with their
    sha256, verified at load; only those files are replaced by overwrite, other files in the folder stay and
    are not checksummed. kvoffload.incomplete marks the folder while it is incomplete. Refuses a non-empty
    directory that is not a kvoffload checkpoint, and replaces one only with overwrite.
    """
    import dataclasses

    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    check_destination(directory, overwrite)
    for what, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        check_finite(leaf, f"parameter {jax.tree_util.keystr(what)}")
    os.makedirs(directory, exist_ok=True)
    if converted_state(directory) is None:  # a new folder: marked at once, so a cut conversion is recognised
        _write_json_atomically(os.path.join(directory, INCOMPLETE_MARKER), {"source": source})
    staging = os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}.kvoffload-tmp")
    shutil.rmtree(staging, ignore_errors=True)  # what a cut conversion left
    try:
        os.makedirs(staging)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(os.path.join(staging, "params"), params, force=True)
        ckpt.wait_until_finished()
        if tokenizer is not None:
            tokenizer.save(staging)
        written = _file_digests(staging)
    except OSError as e:  # a full disk, a quota: one line, the destination untouched
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write the converted checkpoint beside {directory}: {e.strerror or e}; "
                              f"{directory} was left as it was") from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # the swap: renames only (no new space needed); marked incomplete with both file lists until it is done
    old = _written_files(directory)
    _write_json_atomically(os.path.join(directory, INCOMPLETE_MARKER),
                           {"source": source, "format": _FORMAT, "files": sorted(set(old) | set(written))})
    if os.path.exists(os.path.join(directory, CONVERTED_MARKER)):
        os.remove(os.path.join(directory, CONVERTED_MARKER))
    _remove_files(directory, old)
    for rel in written:
        os.renames(os.path.join(staging, rel), os.path.join(directory, rel))
    shutil.rmtree(staging, ignore_errors=True)
    meta = {"config": dataclasses.asdict(cfg), "dtype": str(jax.tree.leaves(params)[0].dtype), "format": _FORMAT,
            "source": source, "files": written}
    _write_json_atomically(os.path.join(directory, CONVERTED_MARKER), meta)
    os.remove(os.path.join(directory, INCOMPLETE_MARKER))


def _verify_files(directory: str, digests: dict[str, str], redo: str):
    for rel, want in digests.items():
        p = os.path.join(directory, rel)
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: file missing from the converted checkpoint{redo}")
        if _sha256(p) != want:
            raise CheckpointError(f"{p}: file damaged (its sha256 differs from the one recorded at conversion){redo}")


def load_converted(directory: str, verify: bool = True, redo_hint: bool = True):
    """Returns (config, params) from a directory written by save_converted. verify: check every file
    against the sha256 recorded at conversion, and every weight for NaN or infinity. redo_hint: a
    damaged file's error says how to convert again."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    marker = os.path.join(directory, CONVERTED_MARKER)
    try:
        with open(marker) as f:
            meta = json.load(f)
        c = meta["config"]
        c["eos_token_ids"] = tuple(c.get("eos_token_ids") or ())
        c["layer_types"] = tuple(c.get("layer_types") or ())
        cfg = ModelConfig(**c)
        dtype = jnp.dtype(meta.get("dtype", "float32"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: corrupt kvoffload checkpoint metadata ({e})") from e
    if verify and meta.get("files"):
        redo = f"; convert again with `kvoffload convert {meta.get('source') or 'SRC'} {directory} --overwrite`"
        _verify_files(directory, meta["files"], redo if redo_hint else "")
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), expected_shapes(cfg))
    try:
        params = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract)
    except Exception as e:  # orbax/TensorStore raise many types with multi-line dumps: keep the first line
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"{directory}/params: cannot restore the orbax checkpoint ({type(e).__name__}: "
                              f"{first}); convert the model again") from e
    if verify:
        for what, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            check_finite(leaf, f"{directory}: parameter {jax.tree_util.keystr(what)}")
    return cfg, params


def print_progress(label: str, quiet: bool = False, unit: str = "tensor"):
    """A progress callback cb(done, total) drawing a tqdm bar (rate, ETA) on stderr; None when quiet."""
    if quiet:
        return None
    from tqdm import tqdm

    bar = None

    def cb(done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, dynamic_ncols=True)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return cb
