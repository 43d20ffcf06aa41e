"""LLaMA family (LLaMA 1/2/3, Mistral, Qwen2, SmolLM): RMSNorm, split-half RoPE, GQA, SwiGLU.

Linear weights are stored [in, out] so a projection is x @ W.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.config import ModelConfig
from kvoffload.models.common import (
    apply_rope,
    linear,
    merge_heads,
    pytree_dataclass,
    rms_norm,
    rope_cos_sin,
    split_heads,
)


@pytree_dataclass
class LlamaLayer:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    mlp_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    bo: Any = None
    b_gate: Any = None
    b_up: Any = None
    b_down: Any = None


@pytree_dataclass
class LlamaParams:
    embed: Any  # [V, H]
    layers: tuple  # of LlamaLayer
    final_norm: Any  # [H]
    lm_head: Any = None  # [H, V]; None when tied to embed


def embed(cfg: ModelConfig, params: LlamaParams, tokens, positions):
    del cfg, positions  # RoPE carries positions
    return jnp.take(params.embed, tokens, axis=0)


def attn_input(cfg: ModelConfig, lp: LlamaLayer, h):
    """The activation KVPR stores: the normed hidden state that q/k/v are projected from."""
    return rms_norm(h, lp.attn_norm, cfg.norm_eps)


def recompute_kv(cfg: ModelConfig, lp: LlamaLayer, x, positions, impl="auto"):
    """K, V [B, n_kv, T, d] from stored activations x [B, T, H] at positions [B, T]."""
    cos, sin = rope_cos_sin(cfg, positions)
    return ops.recompute_kv(x, lp.wk, lp.bk, lp.wv, lp.bv, cos, sin, n_kv=cfg.num_kv_heads, impl=impl)


def qkv(cfg: ModelConfig, lp: LlamaLayer, x, positions):
    """q [B, nh, T, d], k, v [B, n_kv, T, d], RoPE applied at positions [B, T]."""
    cos, sin = rope_cos_sin(cfg, positions)
    q = apply_rope(split_heads(linear(x, lp.wq, lp.bq), cfg.num_heads, cfg.head_dim), cos, sin)
    k, v = ops.recompute_kv(x, lp.wk, lp.bk, lp.wv, lp.bv, cos, sin, n_kv=cfg.num_kv_heads)
    return q, k, v


def attn_out(cfg: ModelConfig, lp: LlamaLayer, o):
    del cfg
    return linear(merge_heads(o), lp.wo, lp.bo)


def mlp(cfg: ModelConfig, lp: LlamaLayer, x):
    """SwiGLU over the normed hidden state x."""
    del cfg
    gate = linear(x, lp.w_gate, lp.b_gate)
    up = linear(x, lp.w_up, lp.b_up)
    return linear(jax.nn.silu(gate) * up, lp.w_down, lp.b_down)


def post_attention(cfg: ModelConfig, lp: LlamaLayer, h, attn):
    """Residual after attention, then the MLP block: the layer's output hidden state."""
    h = h + attn
    return h + mlp(cfg, lp, rms_norm(h, lp.mlp_norm, cfg.norm_eps))


def logits(cfg: ModelConfig, params: LlamaParams, h):
    h = rms_norm(h, params.final_norm, cfg.norm_eps)
    if params.lm_head is None:  # tied: contract with the embedding directly (a transpose would copy it)
        return jnp.einsum("...h,vh->...v", h, params.embed, preferred_element_type=jnp.float32)
    return ops.matmul_f32(h, params.lm_head)


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, scale=0.02) -> LlamaParams:
    """Random parameters in the model's shapes (tests and speed benchmarks)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    keys = iter(jax.random.split(key, 16 * cfg.num_layers + 8))

    def rnd(*shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm_w():
        return (1.0 + rnd(h, s=0.1)).astype(dtype)

    def bias(n, on):
        return rnd(n) if on else None

    layers = tuple(
        LlamaLayer(
            attn_norm=norm_w(), wq=rnd(h, nq), wk=rnd(h, nkv), wv=rnd(h, nkv), wo=rnd(nq, h),
            mlp_norm=norm_w(), w_gate=rnd(h, i), w_up=rnd(h, i), w_down=rnd(i, h),
            bq=bias(nq, cfg.qkv_bias), bk=bias(nkv, cfg.qkv_bias), bv=bias(nkv, cfg.qkv_bias),
            bo=bias(h, cfg.o_bias), b_gate=bias(i, cfg.mlp_bias), b_up=bias(i, cfg.mlp_bias),
            b_down=bias(h, cfg.mlp_bias),
        )
        for _ in range(cfg.num_layers)
    )
    return LlamaParams(
        embed=rnd(cfg.vocab_size, h), layers=layers, final_norm=norm_w(),
        lm_head=None if cfg.tie_word_embeddings else rnd(h, cfg.vocab_size),
    )
