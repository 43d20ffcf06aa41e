"""ModelConfig: the static description of a model, built from a HuggingFace config.json.

The config is a frozen (hashable) dataclass so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from kvoffload.errors import KVOffloadError

# model_type -> family. Families share one set of layer functions (models/llama.py, models/opt.py,
# models/gemma3.py).
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "opt": "opt",
    "gemma3_text": "gemma3",
}
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # HF's layer_types values


class UnsupportedModelError(KVOffloadError, ValueError):
    """A model type or setting kvoffload does not implement; the message names what is supported."""


class ModelConfigError(KVOffloadError, ValueError):
    """A config.json of the wrong shape: not a JSON object, a key missing, or a value of the wrong type."""


_REQUIRED = object()


class _ConfigKeys:
    """Typed reads of an HF config dict: each names the key (and the file) when it is missing or of the wrong
    type, instead of a KeyError or a bare int() error."""

    def __init__(self, d, source: str):
        if not isinstance(d, dict):
            raise ModelConfigError(f"{source} must be a JSON object (HF config.json), got a JSON {_json_kind(d)}")
        self.d, self.source = d, source

    def _get(self, key, default):
        if key not in self.d or (self.d[key] is None and default is not _REQUIRED):
            if default is _REQUIRED:
                raise ModelConfigError(f"{self.source}: key {key!r} is missing (an HF config.json has it)")
            return default
        return self.d[key]

    def int(self, key, default=_REQUIRED, low: int = 1):
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer() or v < low:
            raise ModelConfigError(f"{self.source}: key {key!r} must be an integer >= {low}, got {v!r}")
        return int(v)

    def float(self, key, default=_REQUIRED):
        import math

        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ModelConfigError(f"{self.source}: key {key!r} must be a finite number, got {v!r}")
        return float(v)


def _json_kind(v) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(v), type(v).__name__)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "opt" | "gemma3"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # llama family
    rope_theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # opt family
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    final_layer_norm: bool = True
    position_offset: int = 0  # OPT's learned positions start at index 2
    activation: str = "silu"
    # gemma3 family: per-layer attention kind (SLIDING or GLOBAL; () = every layer global), the window of the
    # sliding layers (a query at position p attends keys at positions > p - sliding_window, itself included:
    # HF's sliding_window_overlay), their RoPE base (default RoPE; global layers use rope_theta / rope_type),
    # the attention scale's query_pre_attn_scalar (0: head_dim) and the final logits' tanh softcap (0: none)
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, or None for a layer attending the whole context."""
        if self.layer_types and self.layer_types[i] == SLIDING:
            return self.sliding_window
        return None

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V elements per token per layer (multiply by the element size for bytes)."""
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        keys = _ConfigKeys(d, source)
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures")
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures={archs}); kvoffload supports "
                f"model_type in {sorted(SUPPORTED_MODEL_TYPES)} (LLaMA, Mistral, Qwen2, OPT, Gemma 3 text)"
            )
        family = SUPPORTED_MODEL_TYPES[model_type]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        common = dict(
            family=family,
            model_type=model_type,
            vocab_size=keys.int("vocab_size"),
            hidden_size=keys.int("hidden_size"),
            num_layers=keys.int("num_hidden_layers"),
            num_heads=keys.int("num_attention_heads"),
            max_position_embeddings=keys.int("max_position_embeddings"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
        )
        if family == "gemma3":
            return cls(**common, **_gemma3_settings(d, common))
        if family == "opt":
            h = common["hidden_size"]
            proj = keys.int("word_embed_proj_dim", h)
            pre = bool(d.get("do_layer_norm_before", True))
            if not d.get("enable_bias", True):
                raise UnsupportedModelError("OPT with enable_bias=False is not supported")
            if not d.get("layer_norm_elementwise_affine", True):
                raise UnsupportedModelError("OPT with layer_norm_elementwise_affine=False is not supported")
            act = d.get("activation_function", "relu")
            if act not in ("relu", "gelu"):
                raise UnsupportedModelError(f"OPT activation {act!r} is not supported (relu, gelu)")
            return cls(
                **common,
                intermediate_size=keys.int("ffn_dim"),
                num_kv_heads=common["num_heads"],
                head_dim=h // common["num_heads"],
                norm_eps=1e-5,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                do_layer_norm_before=pre,
                word_embed_proj_dim=proj,
                # HF OPT: the final layer norm exists only for pre-LN models (opt-350m has none).
                final_layer_norm=pre and not d.get("_remove_final_layer_norm", False),
                position_offset=2,
                activation=act,
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
            )
        # llama family
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported for {model_type} (silu)")
        n_heads = common["num_heads"]
        head_dim = keys.int("head_dim", common["hidden_size"] // n_heads)
        rope = _rope_settings(d)
        attn_bias = bool(d.get("attention_bias", False))
        return cls(
            **common,
            intermediate_size=keys.int("intermediate_size"),
            num_kv_heads=keys.int("num_key_value_heads", n_heads),
            head_dim=head_dim,
            norm_eps=keys.float("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias or model_type == "qwen2",
            o_bias=attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            activation="silu",
            **rope,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            with open(path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"corrupt model config {path}: {e}") from e
        return cls.from_hf_dict(d, path)


def _gemma3_settings(d: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """The gemma3 family's fields of an HF Gemma3TextConfig dict (classic keys or transformers 5's
    per-layer-type rope_parameters)."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"gemma3 hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if d.get("attn_logit_softcapping"):
        raise UnsupportedModelError(
            "attn_logit_softcapping (Gemma 2's attention softcap) is not supported: no attention path of kvoffload "
            "applies a tanh cap to its scores")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3 with use_bidirectional_attention (an encoder) is not supported")
    n = common["num_layers"]
    types = d.get("layer_types")
    if types is None:  # the older configs' period: every pattern-th layer global
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
    types = tuple(types)
    if len(types) != n or not set(types) <= {SLIDING, GLOBAL}:
        raise UnsupportedModelError(f"gemma3 layer_types must name {n} layers, each {SLIDING!r} or {GLOBAL!r}; "
                                    f"got {list(types)}")
    window = int(d.get("sliding_window") or 0)
    if SLIDING in types and window < 1:
        raise UnsupportedModelError("gemma3 config has sliding layers but no sliding_window")
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        rope = _rope_settings({"rope_parameters": params.get("full_attention") or {"rope_theta": 1_000_000.0}})
        local = dict(params.get("sliding_attention") or {})
        local_theta = float(local.get("rope_theta", 10000.0))
        local_type = local.get("rope_type", "default") or "default"
    else:
        rope = _rope_settings({"rope_theta": d.get("rope_theta", 1_000_000.0), "rope_scaling": d.get("rope_scaling")})
        local_theta, local_type = float(d.get("rope_local_base_freq", 10000.0)), "default"
    if local_type != "default":
        raise UnsupportedModelError(f"gemma3 sliding layers' rope type {local_type!r} is not supported (default)")
    attn_bias = bool(d.get("attention_bias", False))
    n_heads = common["num_heads"]
    return dict(
        intermediate_size=int(d["intermediate_size"]),
        num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or common["hidden_size"] // n_heads),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qkv_bias=attn_bias, o_bias=attn_bias, activation="gelu_tanh",
        layer_types=types, sliding_window=window, rope_local_theta=local_theta,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 0.0),
        final_logit_softcapping=float(d.get("final_logit_softcapping") or 0.0),
        **rope,
    )


def _rope_settings(d: dict[str, Any]) -> dict[str, Any]:
    """Reads RoPE settings from either the classic (rope_theta, rope_scaling) keys or the newer
    `rope_parameters` dict (transformers >= 5)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        raise UnsupportedModelError("per-layer-type rope_parameters are supported for gemma3 only")
    scaling = dict(params) if isinstance(params, dict) else dict(d.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", d.get("rope_theta", 10000.0)))
    rtype = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    out = dict(rope_theta=theta, rope_type=rtype)
    if rtype == "default":
        return out
    if rtype == "linear":
        out["rope_factor"] = float(scaling["factor"])
        return out
    if rtype == "llama3":
        out.update(
            rope_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_position=int(scaling["original_max_position_embeddings"]),
        )
        return out
    raise UnsupportedModelError(f"rope type {rtype!r} is not supported (default, linear, llama3)")
