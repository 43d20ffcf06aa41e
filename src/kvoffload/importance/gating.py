"""The two-way forward of head-importance training (DuoAttention-style).

Teacher: the model with full causal attention in every layer (models.common.prefill_attention).
Student: the same layers, but each query head's attention output is
``alpha * full + (1 - alpha) * streaming`` where streaming attention sees only the first `sink` tokens
and the last `recent` tokens (the query's own included). Both forwards are assembled from the family's
layer functions (attn_input, qkv, attn_out, post_attention); only the attention differs.

The gated attention mixes the two softmax distributions before the value product,
``(alpha P_full + (1 - alpha) P_stream) V``, which equals the mix of the two outputs exactly.

alpha has shape [L, n_kv] (one gate per layer and KV head; a query head uses its group's gate) or
[L, n_heads] (per query head, the variant CLO's GQA aggregation uses).

Layers run under ``lax.scan`` over stacked layer parameters (one compiled layer body), each step
rematerialised in the backward pass so memory stays at one layer's attention scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvoffload.config import ModelConfig, UnsupportedModelError
from kvoffload.models.common import layer_norm, linear, prefill_attention, rms_norm, stack_trees
from kvoffload.models.transformer import family

QUERY_CHUNK = 256


TRAINABLE_FAMILIES = ("llama", "opt")


def check_trainable(cfg: ModelConfig, what: str):
    """Training runs its own forward pass (gated heads, captured queries and keys), written for the full-attention
    llama and opt families: refuse any other model before work starts rather than train on a wrong forward."""
    if cfg.family not in TRAINABLE_FAMILIES:
        raise UnsupportedModelError(f"{what}: the {cfg.family} family is not supported (training covers "
                                    f"{', '.join(TRAINABLE_FAMILIES)}); its scores serve clo / tokenselect, which do "
                                    f"not run {cfg.family} models either")


def final_hidden(cfg: ModelConfig, params, h):
    """The final normed hidden state (what `logits` multiplies by the LM head)."""
    if cfg.family == "llama":
        return rms_norm(h, params.final_norm, cfg.norm_eps)
    if cfg.family == "opt":
        if params.final_ln_w is not None:
            h = layer_norm(h, params.final_ln_w, params.final_ln_b, cfg.norm_eps)
        if params.project_out is not None:
            h = linear(h, params.project_out)
        return h
    raise ValueError(f"unknown family {cfg.family!r}")


def stack_layers(params):
    """params.layers (tuple of per-layer pytrees) -> one pytree with a leading layer axis."""
    return stack_trees(params.layers)


def head_gates(cfg: ModelConfig, alpha):
    """alpha [L, n_kv] or [L, n_heads] -> per query head [L, n_heads]."""
    if alpha.shape[-1] == cfg.num_heads:
        return alpha
    if alpha.shape[-1] == cfg.num_kv_heads:
        return jnp.repeat(alpha, cfg.group_size, axis=-1)
    raise ValueError(f"alpha last dim {alpha.shape[-1]} is neither n_kv={cfg.num_kv_heads} "
                     f"nor n_heads={cfg.num_heads}")


def gated_attention(q, k, v, lengths, gate, *, sink: int, recent: int, scale=None, chunk=QUERY_CHUNK):
    """alpha-mix of full causal and streaming (sink + recent) attention.

    q [B, nh, T, d]; k, v [B, nkv, T, d]; lengths [B]; gate [nh] (1 = full, 0 = streaming).
    Returns [B, nh, T, d] in q.dtype.
    """
    b, nh, t, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, nkv, g, t, d)
    a = gate.astype(jnp.float32).reshape(1, nkv, g, 1, 1)

    def one(q_c, qpos, k_c, v_c):
        kpos = jnp.arange(k_c.shape[2])
        s = jnp.einsum("bkgqd,bksd->bkgqs", q_c, k_c, preferred_element_type=jnp.float32) * scale
        causal = (kpos[None, :] <= qpos[:, None])[None] & (kpos[None, None, :] < lengths[:, None, None])
        window = ((kpos[None, :] < sink) | (qpos[:, None] - kpos[None, :] < recent)).astype(jnp.float32)
        s = jnp.where(causal[:, None, None], s, -jnp.inf)
        # one exponential serves both softmaxes: the streaming key set is a subset of the causal one,
        # so the causal max bounds it (attention sinks make the two maxima agree in practice)
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(s - m)
        den_f = jnp.sum(e, axis=-1, keepdims=True)
        den_s = jnp.sum(e * window, axis=-1, keepdims=True)
        coef = a / jnp.where(den_f > 0, den_f, 1.0) + (1.0 - a) * window / jnp.where(den_s > 0, den_s, 1.0)
        o = jnp.einsum("bkgqs,bksd->bkgqd", (e * coef).astype(v_c.dtype), v_c, preferred_element_type=jnp.float32)
        return o.astype(q.dtype)

    # query chunks (static slices) see only the keys up to their last position: the causal upper
    # triangle beyond the chunk is never computed
    outs = []
    for c0 in range(0, t, chunk):
        c1 = min(c0 + chunk, t)
        outs.append(one(qg[:, :, :, c0:c1], jnp.arange(c0, c1), k[:, :, :c1], v[:, :, :c1]))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return o.reshape(b, nh, t, d)


def _positions(tokens):
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def teacher_hidden(cfg: ModelConfig, params, stacked, tokens, lengths):
    """Final normed hidden states [B, T, H] of the full-attention model (no gradient)."""
    fam = family(cfg)
    positions = _positions(tokens)
    h = fam.embed(cfg, params, tokens, positions)

    def body(h, lp):
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        o = prefill_attention(q, k, v, lengths)
        return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o)), None

    h, _ = jax.lax.scan(body, h, stacked)
    return jax.lax.stop_gradient(final_hidden(cfg, params, h))


def student_hidden(cfg: ModelConfig, params, stacked, alpha, tokens, lengths, *, sink: int, recent: int,
                   remat: bool = True):
    """Final normed hidden states [B, T, H] with each head gated between full and streaming attention.
    alpha [L, n_kv] or [L, n_heads]."""
    fam = family(cfg)
    positions = _positions(tokens)
    h = fam.embed(cfg, params, tokens, positions)
    gates = head_gates(cfg, alpha)

    def body(h, xs):
        lp, gate = xs
        x = fam.attn_input(cfg, lp, h)
        q, k, v = fam.qkv(cfg, lp, x, positions)
        o = gated_attention(q, k, v, lengths, gate, sink=sink, recent=recent)
        return fam.post_attention(cfg, lp, h, fam.attn_out(cfg, lp, o)), None

    if remat:
        body = jax.checkpoint(body)
    h, _ = jax.lax.scan(body, h, (stacked, gates))
    return final_hidden(cfg, params, h)


def student_logits_at(cfg: ModelConfig, params, stacked, alpha, tokens, lengths, *, sink: int,
                      recent: int):
    """Greedy next-token ids [B, T] of the gated model (for the passkey accuracy check)."""
    h = student_hidden(cfg, params, stacked, alpha, tokens, lengths, sink=sink, recent=recent, remat=False)
    # h is already normed (final_hidden); apply the LM head the way the family's `logits` does
    if cfg.family == "llama":
        head = params.embed.T if params.lm_head is None else params.lm_head
        lg = jnp.einsum("...h,hv->...v", h, head, preferred_element_type=jnp.float32)
    else:
        lg = jnp.einsum("...h,vh->...v", h, params.embed, preferred_element_type=jnp.float32)
    return jnp.argmax(lg, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "sink", "recent"))
def greedy_tokens(cfg: ModelConfig, params, stacked, alpha, tokens, lengths, sink: int, recent: int):
    return student_logits_at(cfg, params, stacked, alpha, tokens, lengths, sink=sink, recent=recent)


def distillation_loss(cfg: ModelConfig, params, stacked, alpha, tokens, lengths, answer_mask, target,
                      *, sink: int, recent: int, l1: float = 0.05):
    """(loss, (mse, mean|alpha|)): MSE of student vs teacher final normed hidden states over the answer
    positions plus l1 * mean|alpha|."""
    h = student_hidden(cfg, params, stacked, alpha, tokens, lengths, sink=sink, recent=recent)
    m = answer_mask.astype(jnp.float32)[..., None]
    n = jnp.maximum(jnp.sum(m) * h.shape[-1], 1.0)
    mse = jnp.sum(jnp.square(h.astype(jnp.float32) - target.astype(jnp.float32)) * m) / n
    reg = jnp.mean(jnp.abs(alpha))
    return mse + l1 * reg, (mse, reg)
