"""Gemma 3 (text) family: RMSNorm with (1 + weight) scales, four sandwich norms per layer, RMSNorm on each
query and key head (QK norm), GeGLU (tanh gelu) MLP, the embedding scaled by sqrt(hidden), tied head,
split-half RoPE whose base differs between sliding-window and global layers, attention scale
query_pre_attn_scalar ** -0.5, and optional final logit softcapping.

A layer's kind (sliding window or global) is a static field of its parameters (`Gemma3Layer.sliding`), so the
layer functions and the attention paths read it without a layer index: a sliding layer's programs carry the
window mask, a global layer's are those of any full-attention layer.

Linear weights are stored [in, out] so a projection is x @ W; norm weights as HF stores them (weight, the
scale being 1 + weight).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.config import ModelConfig
from kvoffload.models import llama
from kvoffload.models.common import (
    apply_rope,
    linear,
    pytree_dataclass,
    rms_norm,
    rope_cos_sin,
    split_heads,
)

NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + weight)


@pytree_dataclass(meta=("sliding",))
class Gemma3Layer:
    attn_norm: Any  # input_layernorm
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    q_norm: Any  # [head_dim]
    k_norm: Any  # [head_dim]
    post_attn_norm: Any  # post_attention_layernorm (on the attention output, before the residual)
    mlp_norm: Any  # pre_feedforward_layernorm
    post_mlp_norm: Any  # post_feedforward_layernorm
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    bo: Any = None
    sliding: bool = False  # static: a sliding-window layer (cfg.sliding_window) rather than a global one


@pytree_dataclass
class Gemma3Params:
    embed: Any  # [V, H]
    layers: tuple  # of Gemma3Layer
    final_norm: Any  # [H]
    lm_head: Any = None  # [H, V]; None when tied to embed (Gemma 3 always ties)


def _norm(cfg: ModelConfig, x, w):
    return rms_norm(x, w, cfg.norm_eps, offset=NORM_OFFSET)


def embed(cfg: ModelConfig, params: Gemma3Params, tokens, positions):
    del positions  # RoPE carries positions
    e = jnp.take(params.embed, tokens, axis=0)
    return e * jnp.asarray(cfg.hidden_size**0.5, e.dtype)  # HF rounds the scale to the weights' dtype first


def attn_input(cfg: ModelConfig, lp: Gemma3Layer, h):
    """The activation KVPR stores: the normed hidden state that q/k/v are projected from."""
    return _norm(cfg, h, lp.attn_norm)


def _k_heads(cfg: ModelConfig, lp: Gemma3Layer, k, positions):
    """Projected keys [B, n_kv, T, d] -> normed, then RoPE at positions with the layer's base."""
    cos, sin = rope_cos_sin(cfg, positions, local=lp.sliding)
    return apply_rope(_norm(cfg, k, lp.k_norm), cos, sin)


def recompute_kv(cfg: ModelConfig, lp: Gemma3Layer, x, positions, impl="auto"):
    """K, V [B, n_kv, T, d] from stored activations x [B, T, H] at positions [B, T]: the projections through
    `ops.recompute_kv` (no RoPE there: the key norm comes between the projection and RoPE)."""
    k, v = ops.recompute_kv(x, lp.wk, lp.bk, lp.wv, lp.bv, None, None, n_kv=cfg.num_kv_heads, impl=impl)
    return _k_heads(cfg, lp, k, positions), v


def query_factor(cfg: ModelConfig) -> float:
    """What q is multiplied by so that the attention paths' default scale head_dim ** -0.5 becomes
    query_pre_attn_scalar ** -0.5 (1.0 where they are equal, as in every released Gemma 3 but 27B)."""
    if not cfg.query_pre_attn_scalar:
        return 1.0
    return float((cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5)


def qkv(cfg: ModelConfig, lp: Gemma3Layer, x, positions):
    """q [B, nh, T, d], k, v [B, n_kv, T, d], QK-normed, RoPE applied at positions [B, T]."""
    cos, sin = rope_cos_sin(cfg, positions, local=lp.sliding)
    q = split_heads(linear(x, lp.wq, lp.bq), cfg.num_heads, cfg.head_dim)
    q = apply_rope(_norm(cfg, q, lp.q_norm), cos, sin)
    f = query_factor(cfg)
    if f != 1.0:
        q = (q.astype(jnp.float32) * f).astype(q.dtype)
    k, v = recompute_kv(cfg, lp, x, positions)
    return q, k, v


attn_out = llama.attn_out  # the output projection of the merged heads, as in the LLaMA family


def mlp(cfg: ModelConfig, lp: Gemma3Layer, x):
    """GeGLU over the normed hidden state x (gelu with the tanh approximation: HF's gelu_pytorch_tanh)."""
    del cfg
    gate = linear(x, lp.w_gate)
    up = linear(x, lp.w_up)
    return linear(jax.nn.gelu(gate, approximate=True) * up, lp.w_down)


def post_attention(cfg: ModelConfig, lp: Gemma3Layer, h, attn):
    """The sandwich: attention output normed then added; the MLP between its pre and post norms, added."""
    h = h + _norm(cfg, attn, lp.post_attn_norm)
    return h + _norm(cfg, mlp(cfg, lp, _norm(cfg, h, lp.mlp_norm)), lp.post_mlp_norm)


def logits(cfg: ModelConfig, params: Gemma3Params, h):
    h = _norm(cfg, h, params.final_norm)
    if params.lm_head is None:  # tied: contract with the embedding directly (a transpose would copy it)
        out = jnp.einsum("...h,vh->...v", h, params.embed, preferred_element_type=jnp.float32)
    else:
        out = ops.matmul_f32(h, params.lm_head)
    cap = cfg.final_logit_softcapping
    return out if not cap else jnp.tanh(out / cap) * cap


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, scale=0.02) -> Gemma3Params:
    """Random parameters in the model's shapes (tests and speed benchmarks); norm weights near 0 (scale ~1)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    keys = iter(jax.random.split(key, 20 * cfg.num_layers + 8))

    def rnd(*shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm_w(n=h, mean=0.0):
        return (mean + rnd(n, s=0.1)).astype(dtype)

    def bias(n, on):
        return rnd(n) if on else None

    layers = tuple(
        Gemma3Layer(
            attn_norm=norm_w(), wq=rnd(h, nq), wk=rnd(h, nkv), wv=rnd(h, nkv), wo=rnd(nq, h),
            # the post norms scale the branches' outputs ~3x (as trained Gemmas' do): near 1 the sqrt(H)-scaled
            # embedding outweighs them and a random model mostly repeats its input token
            q_norm=norm_w(d), k_norm=norm_w(d), post_attn_norm=norm_w(mean=2.0), mlp_norm=norm_w(),
            post_mlp_norm=norm_w(mean=2.0), w_gate=rnd(h, i), w_up=rnd(h, i), w_down=rnd(i, h),
            bq=bias(nq, cfg.qkv_bias), bk=bias(nkv, cfg.qkv_bias), bv=bias(nkv, cfg.qkv_bias),
            bo=bias(h, cfg.o_bias), sliding=cfg.layer_window(j) is not None,
        )
        for j in range(cfg.num_layers)
    )
    return Gemma3Params(
        embed=rnd(cfg.vocab_size, h), layers=layers, final_norm=norm_w(),
        lm_head=None if cfg.tie_word_embeddings else rnd(h, cfg.vocab_size),
    )

