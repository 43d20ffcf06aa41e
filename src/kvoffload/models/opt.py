"""OPT family: learned positions (offset 2), LayerNorm, pre-LN or post-LN (opt-350m), ReLU MLP,
optional project_in/project_out around a smaller word-embedding width, head tied to the embedding."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.config import ModelConfig
from kvoffload.models.common import layer_norm, linear, merge_heads, pytree_dataclass, split_heads


@pytree_dataclass
class OPTLayer:
    attn_ln_w: Any
    attn_ln_b: Any
    wq: Any
    bq: Any
    wk: Any
    bk: Any
    wv: Any
    bv: Any
    wo: Any
    bo: Any
    mlp_ln_w: Any
    mlp_ln_b: Any
    fc1: Any
    b1: Any
    fc2: Any
    b2: Any


@pytree_dataclass
class OPTParams:
    embed: Any  # [V, word_embed_proj_dim]
    pos_embed: Any  # [max_positions + 2, H]
    layers: tuple
    final_ln_w: Any = None  # absent for post-LN models
    final_ln_b: Any = None
    project_in: Any = None  # [proj_dim, H]
    project_out: Any = None  # [H, proj_dim]


def embed(cfg: ModelConfig, params: OPTParams, tokens, positions):
    e = jnp.take(params.embed, tokens, axis=0)
    if params.project_in is not None:
        e = linear(e, params.project_in)
    # padded slots of a bucketed prompt may sit past the learned table; jnp.take would fill them with
    # NaN, which reaches real tokens through attention (NaN * 0). Clip them to the last row instead:
    # real positions are always inside the table, and padded slots are masked.
    idx = positions + cfg.position_offset
    return e + jnp.take(params.pos_embed, idx, axis=0, mode="clip").astype(e.dtype)


def attn_input(cfg: ModelConfig, lp: OPTLayer, h):
    if cfg.do_layer_norm_before:
        return layer_norm(h, lp.attn_ln_w, lp.attn_ln_b, cfg.norm_eps)
    return h


def recompute_kv(cfg: ModelConfig, lp: OPTLayer, x, positions, impl="auto"):
    del positions  # positions entered through the embedding
    return ops.recompute_kv(x, lp.wk, lp.bk, lp.wv, lp.bv, None, None, n_kv=cfg.num_kv_heads, impl=impl)


def qkv(cfg: ModelConfig, lp: OPTLayer, x, positions):
    q = split_heads(linear(x, lp.wq, lp.bq), cfg.num_heads, cfg.head_dim)
    k, v = recompute_kv(cfg, lp, x, positions)
    return q, k, v


def attn_out(cfg: ModelConfig, lp: OPTLayer, o):
    del cfg
    return linear(merge_heads(o), lp.wo, lp.bo)


def mlp(cfg: ModelConfig, lp: OPTLayer, x):
    act = jax.nn.relu if cfg.activation == "relu" else (lambda a: jax.nn.gelu(a, approximate=False))
    return linear(act(linear(x, lp.fc1, lp.b1)), lp.fc2, lp.b2)


def post_attention(cfg: ModelConfig, lp: OPTLayer, h, attn):
    eps = cfg.norm_eps
    if cfg.do_layer_norm_before:
        h = h + attn
        return h + mlp(cfg, lp, layer_norm(h, lp.mlp_ln_w, lp.mlp_ln_b, eps))
    h = layer_norm(h + attn, lp.attn_ln_w, lp.attn_ln_b, eps)
    return layer_norm(h + mlp(cfg, lp, h), lp.mlp_ln_w, lp.mlp_ln_b, eps)


def logits(cfg: ModelConfig, params: OPTParams, h):
    if params.final_ln_w is not None:
        h = layer_norm(h, params.final_ln_w, params.final_ln_b, cfg.norm_eps)
    if params.project_out is not None:
        h = linear(h, params.project_out)
    return jnp.einsum("...h,vh->...v", h, params.embed, preferred_element_type=jnp.float32)


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, scale=0.02) -> OPTParams:
    """Random parameters in the model's shapes (tests and speed benchmarks)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    p = cfg.word_embed_proj_dim or h
    keys = iter(jax.random.split(key, 20 * cfg.num_layers + 8))

    def rnd(*shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def ln():
        return (1.0 + rnd(h, s=0.1)).astype(dtype), rnd(h)

    layers = []
    for _ in range(cfg.num_layers):
        a_w, a_b = ln()
        m_w, m_b = ln()
        layers.append(OPTLayer(
            attn_ln_w=a_w, attn_ln_b=a_b, wq=rnd(h, h), bq=rnd(h), wk=rnd(h, h), bk=rnd(h),
            wv=rnd(h, h), bv=rnd(h), wo=rnd(h, h), bo=rnd(h), mlp_ln_w=m_w, mlp_ln_b=m_b,
            fc1=rnd(h, f), b1=rnd(f), fc2=rnd(f, h), b2=rnd(h),
        ))
    f_w, f_b = ln() if cfg.final_layer_norm else (None, None)
    return OPTParams(
        embed=rnd(cfg.vocab_size, p), pos_embed=rnd(cfg.max_position_embeddings + cfg.position_offset, h),
        layers=tuple(layers), final_ln_w=f_w, final_ln_b=f_b,
        project_in=rnd(p, h) if p != h else None, project_out=rnd(h, p) if p != h else None,
    )
